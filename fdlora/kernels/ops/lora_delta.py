"""lora_delta, blend / per-sample-segment mode: y += ((x A^T) * w) B^T over all slots as one rank-S*R adapter."""

from __future__ import annotations

import torch

from .lora_expand_add import lora_expand_add
from .lora_shrink import lora_shrink
from .spec import OpSpec


def lora_delta(
    y: torch.Tensor,  # [M, N], updated in place
    x: torch.Tensor,  # [M, K]
    A: torch.Tensor,  # [S, R, K]
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    group_weight: torch.Tensor,  # [G, S] fp32, G divides M
    ranks: torch.Tensor,  # [S] int32
) -> None:
    lora_expand_add(y, lora_shrink(x, A), B, scale, group_weight)


SPEC = OpSpec("lora_delta", lora_delta, mutates=frozenset({"y"}))
