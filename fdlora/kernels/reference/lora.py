"""Reference LoRA ops in plain torch, readable before fast.

Every backend implements these signatures. Bank layout (see fdlora.layers.bank):

    A  [S, R, K]      slot s holds its A (rank r_s <= R) in rows 0..r_s, zeros after
    B  [N, S, R]      so B.view(N, S*R) is the expand matrix of all slots as one rank-S*R adapter
    scale [S]         fp32 per-slot scale of this layer: weight * alpha / r (0 = inactive)
    group_weight [G, S]  fp32 per-group multiplier; rows m of group m // (M // G). G=1 for a plain blend,
                      G=batch for per-sample (diffusion) adapters, with one-hot or blended rows
    row_slot [M]      int32 slot per row (LLM mixed batches); -1 = no adapter
    ranks [S]         int32 live rank of each slot (kernels may skip the zero padding; unused here)

Numerics contract: h = x A^T accumulated in fp32, scales applied in fp32, delta added to y in fp32,
one cast at the end. Ops that take `y` update it in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_shrink(
    x: torch.Tensor,  # [M, K]
    A: torch.Tensor,  # [S, R, K]
) -> torch.Tensor:  # [M, S*R] fp32
    S, R, K = A.shape
    return x.float() @ A.reshape(S * R, K).float().t()


def _row_weights(scale: torch.Tensor, group_weight: torch.Tensor, rows: int) -> torch.Tensor:
    """[G*rows_per_group, S] fp32: the scale of every slot for every row."""
    G = group_weight.shape[0]
    return (group_weight.float() * scale.float()).repeat_interleave(rows // G, dim=0)


def lora_expand_add(
    y: torch.Tensor,  # [M, N], updated in place
    h: torch.Tensor,  # [M, S*R] fp32
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    group_weight: torch.Tensor,  # [G, S] fp32
) -> None:
    M, N = y.shape
    _, S, R = B.shape
    w = _row_weights(scale, group_weight, M)  # [M, S]
    hw = (h.view(M, S, R) * w[:, :, None]).view(M, S * R)
    y.copy_((y.float() + hw @ B.reshape(N, S * R).float().t()).to(y.dtype))


def lora_delta(
    y: torch.Tensor,  # [M, N], updated in place
    x: torch.Tensor,  # [M, K]
    A: torch.Tensor,  # [S, R, K]
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    group_weight: torch.Tensor,  # [G, S] fp32, G divides M
    ranks: torch.Tensor,  # [S] int32
) -> None:
    """Blend / per-sample-segment mode: y += ((x A^T) * w) B^T over all slots as one rank-S*R adapter."""
    lora_expand_add(y, lora_shrink(x, A), B, scale, group_weight)


def lora_delta_rows(
    y: torch.Tensor,  # [M, N], updated in place
    x: torch.Tensor,  # [M, K]
    A: torch.Tensor,  # [S, R, K]
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    row_slot: torch.Tensor,  # [M] int32, -1 = none
    ranks: torch.Tensor,  # [S] int32
) -> None:
    """Per-row mode (SGMV): row m gets slot row_slot[m] at scale[row_slot[m]], or nothing for -1."""
    M, N = y.shape
    _, S, R = B.shape
    onehot = (row_slot.long()[:, None] == torch.arange(S, device=row_slot.device)).float()
    w = onehot * scale.float()  # [M, S]
    hw = (lora_shrink(x, A).view(M, S, R) * w[:, :, None]).view(M, S * R)
    y.copy_((y.float() + hw @ B.reshape(N, S * R).float().t()).to(y.dtype))


def lora_conv_delta(
    y: torch.Tensor,  # [Bt, N, H', W'], updated in place
    x: torch.Tensor,  # [Bt, C, H, W]
    A: torch.Tensor,  # [S, R, C, kh, kw]
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    group_weight: torch.Tensor,  # [G, S] fp32, G divides Bt
    stride: tuple[int, int],
    padding: tuple[int, int] | str,
    dilation: tuple[int, int],
) -> None:
    """Conv LoRA (kohya LoCon): A is a conv with the base geometry, B a 1x1 conv."""
    S, R = A.shape[:2]
    Bt, N = y.shape[:2]
    h = F.conv2d(x.float(), A.reshape(S * R, *A.shape[2:]).float(), None, stride, padding, dilation)
    w = _row_weights(scale, group_weight, Bt)  # [Bt, S]
    h = (h.view(Bt, S, R, *h.shape[2:]) * w[:, :, None, None, None]).view(Bt, S * R, *h.shape[2:])
    delta = F.conv2d(h, B.reshape(N, S * R, 1, 1).float())
    y.copy_((y.float() + delta).to(y.dtype))
