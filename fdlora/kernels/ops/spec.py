"""What an op of the contract is: a name in the one `fdlora::` namespace, the reference that defines its math (and
its signature: every backend's function takes the same parameters), the arguments it writes in place, and a fake
for ops that return a tensor (what torch.compile traces with).

Bank layout, shared by every op and backend (see fdlora.layers.storage.bank):

    A  [S, R, K]      slot s holds its A (rank r_s <= R) in rows 0..r_s, zeros after
    B  [N, S, R]      so B.view(N, S*R) is the expand matrix of all slots as one rank-S*R adapter
    scale [S]         fp32 per-slot scale of this layer: weight * alpha / r (0 = inactive)
    group_weight [G, S]  fp32 per-group multiplier; rows m of group m // (M // G). G=1 for a plain blend,
                      G=batch for per-sample (diffusion) adapters, with one-hot or blended rows
    row_slot [M]      int32 slot per row (LLM mixed batches); -1 = no adapter
    ranks [S]         int32 live rank of each slot (kernels may skip the zero padding)

Numerics contract: h = x A^T accumulated in fp32, scales applied in fp32, delta added to y in fp32, one cast at the
end. The references accumulate in fp64 for fp64 inputs, so the same functions are the float64 oracle of the tests.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OpSpec:
    name: str
    reference: Callable
    mutates: frozenset[str] = frozenset()
    fake: Callable | None = None  # ops that return a tensor: its shape and dtype from the inputs

    @property
    def qualname(self) -> str:
        return f"fdlora::{self.name}"

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(inspect.signature(self.reference).parameters)


def acc(t: torch.Tensor) -> torch.Tensor:
    """`t` in the accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return t.double() if t.dtype == torch.float64 else t.float()


def row_weights(scale: torch.Tensor, group_weight: torch.Tensor, rows: int) -> torch.Tensor:
    """[G*rows_per_group, S]: the scale of every slot for every row, fp32 (fp64 with fp64 scales)."""
    G = group_weight.shape[0]
    return (acc(group_weight) * acc(scale)).repeat_interleave(rows // G, dim=0)
