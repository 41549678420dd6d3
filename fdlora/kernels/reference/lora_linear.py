"""Reference lora_linear: the base linear layer and its LoRA delta as one op, in plain torch.

    y = x W^T (+ bias) + sum_s w[m, s] (x A_s^T) B_s^T,    w[m, s] = scale[s] * group_weight[m // (M / G), s]

Same signature as the fused Triton op (fdlora.kernels.triton.lora_linear); W is the untouched
nn.Linear weight [N, K]. Readable first: the base GEMM in x's dtype, then the delta added in fp32
with one cast (fdlora.kernels.reference.lora_delta), which is what FusedLoraLinear computes today.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lora import lora_delta


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
