"""lora_linear: the base linear layer and its LoRA delta as one op.

    y = x W^T (+ bias) + sum_s w[m, s] (x A_s^T) B_s^T,    w[m, s] = scale[s] * group_weight[m // (M / G), s]

W is the untouched nn.Linear weight [N, K]. The reference runs the base GEMM in x's dtype, then adds the delta in
fp32 with one cast (lora_delta).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lora_delta import lora_delta
from .spec import OpSpec


def lora_linear(
    x: torch.Tensor,  # [M, K]
    W: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    A: torch.Tensor,  # [S, R, K]
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    group_weight: torch.Tensor,  # [G, S] fp32, G divides M
    ranks: torch.Tensor,  # [S] int32
) -> torch.Tensor:  # [M, N]
    y = F.linear(x, W, bias)
    lora_delta(y, x, A, B, scale, group_weight, ranks)
    return y


def _fake(x, W, bias, A, B, scale, group_weight, ranks) -> torch.Tensor:
    return x.new_empty(x.shape[0], W.shape[0])


SPEC = OpSpec("lora_linear", lora_linear, fake=_fake)
