"""The Triton backend's ops: same functions and signatures as fdlora.kernels.reference (linear ops).

Each op is registered with torch.library (`triton_op` + `wrap_triton`, namespace "fdlora"), so
torch.compile(fullgraph=True) traces into the kernels and CUDA graphs capture them. Nothing about
a launch depends on which adapters are active: slot activity, ranks and weights are read from
device tensors inside the kernels.

Which kernel runs:
- lora_delta: fused (one launch, lora_delta.py) or split (lora_shrink + lora_expand_add) by the
  static rule in dispatch.py: split only for few rows (M <= 256) with a large bank (S*R*K bytes
  above 256 KiB), where the fused kernel's re-reads of A would dominate. Cached per shape.
- lora_delta_rows: always one launch (lora_delta_rows.py).
- lora_shrink / lora_expand_add: the two halves, also usable on their own.
Conv LoRA stays on the torch backend (the registry says so: kinds={"linear"}).
"""

from __future__ import annotations

import torch

from . import lora_delta as _delta  # noqa: F401  (registers fdlora::lora_delta)
from . import lora_delta_rows as _rows  # noqa: F401  (registers fdlora::lora_delta_rows)
from . import lora_expand_add as _expand  # noqa: F401  (registers fdlora::lora_expand_add)
from . import lora_shrink as _shrink  # noqa: F401  (registers fdlora::lora_shrink)

__all__ = ["lora_delta", "lora_delta_rows", "lora_expand_add", "lora_shrink"]


def lora_shrink(
    x: torch.Tensor,  # [M, K]
    A: torch.Tensor,  # [S, R, K]
) -> torch.Tensor:  # [M, S*R] fp32
    return torch.ops.fdlora.lora_shrink(x, A)


def lora_expand_add(
    y: torch.Tensor,  # [M, N], updated in place
    h: torch.Tensor,  # [M, S*R] fp32
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    group_weight: torch.Tensor,  # [G, S] fp32
) -> None:
    torch.ops.fdlora.lora_expand_add(y, h, B, scale, group_weight)


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
    torch.ops.fdlora.lora_delta(y, x, A, B, scale, group_weight, ranks)


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
    torch.ops.fdlora.lora_delta_rows(y, x, A, B, scale, row_slot, ranks)
