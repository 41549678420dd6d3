"""lora_conv_delta, conv LoRA (kohya LoCon): A is a conv with the base geometry, B a 1x1 conv; y += its delta."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import OpSpec, acc, row_weights


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
    S, R = A.shape[:2]
    Bt, N = y.shape[:2]
    h = F.conv2d(acc(x), acc(A).reshape(S * R, *A.shape[2:]), None, stride, padding, dilation)
    w = row_weights(scale, group_weight, Bt)  # [Bt, S]
    h = (h.view(Bt, S, R, *h.shape[2:]) * w[:, :, None, None, None]).view(Bt, S * R, *h.shape[2:])
    delta = F.conv2d(h, acc(B).reshape(N, S * R, 1, 1))
    y.copy_((acc(y) + delta).to(y.dtype))


SPEC = OpSpec("lora_conv_delta", lora_conv_delta, mutates=frozenset({"y"}))
