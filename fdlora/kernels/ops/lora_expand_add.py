"""lora_expand_add: y += (h * w) B^T, w the per-row weight of every slot (scale times its group's multiplier)."""

from __future__ import annotations

import torch

from .spec import OpSpec, acc, row_weights


def lora_expand_add(
    y: torch.Tensor,  # [M, N], updated in place
    h: torch.Tensor,  # [M, S*R] fp32
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    group_weight: torch.Tensor,  # [G, S] fp32
) -> None:
    M, N = y.shape
    _, S, R = B.shape
    w = row_weights(scale, group_weight, M)  # [M, S]
    hw = (acc(h).view(M, S, R) * w[:, :, None]).view(M, S * R)
    y.copy_((acc(y) + hw @ acc(B).reshape(N, S * R).t()).to(y.dtype))


SPEC = OpSpec("lora_expand_add", lora_expand_add, mutates=frozenset({"y"}))
