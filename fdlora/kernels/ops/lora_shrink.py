"""lora_shrink: h = x A^T over all slots as one rank-S*R adapter, accumulated in fp32."""

from __future__ import annotations

import torch

from .spec import OpSpec, acc


def lora_shrink(
    x: torch.Tensor,  # [M, K]
    A: torch.Tensor,  # [S, R, K]
) -> torch.Tensor:  # [M, S*R] fp32
    S, R, K = A.shape
    return acc(x) @ acc(A).reshape(S * R, K).t()


def _fake(x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], A.shape[0] * A.shape[1], dtype=torch.float32)


SPEC = OpSpec("lora_shrink", lora_shrink, fake=_fake)
