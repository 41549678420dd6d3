"""lora_delta_rows, per-row mode (SGMV): row m gets slot row_slot[m] at scale[row_slot[m]], or nothing for -1."""

from __future__ import annotations

import torch

from .lora_shrink import lora_shrink
from .spec import OpSpec, acc


def lora_delta_rows(
    y: torch.Tensor,  # [M, N], updated in place
    x: torch.Tensor,  # [M, K]
    A: torch.Tensor,  # [S, R, K]
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    row_slot: torch.Tensor,  # [M] int32, -1 = none
    ranks: torch.Tensor,  # [S] int32
) -> None:
    M, N = y.shape
    _, S, R = B.shape
    onehot = (row_slot.long()[:, None] == torch.arange(S, device=row_slot.device)).to(acc(scale).dtype)
    w = onehot * acc(scale)  # [M, S]
    hw = (lora_shrink(x, A).view(M, S, R) * w[:, :, None]).view(M, S * R)
    y.copy_((acc(y) + hw @ acc(B).reshape(N, S * R).t()).to(y.dtype))


SPEC = OpSpec("lora_delta_rows", lora_delta_rows, mutates=frozenset({"y"}))
