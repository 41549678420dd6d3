"""When the blend/per-sample delta runs fused (one launch) or split (shrink, then expand-add).

The fused kernel computes h = x A^T once per row block. With few rows there are too few row blocks
to fill the GPU, so its programs also split the N sweep, and each of them re-reads every live A
over the whole K (L2 traffic n_split * S*R*K, and a long serial K loop per program). The split
path streams A once across the whole GPU (K split into partial sums), writes a tiny fp32 h, and
expands over N tiles: two launches, but no redundant A reads and short loops.

Rule (static shapes only, so it never depends on which adapters are active and never recompiles):
split when M <= SPLIT_ALWAYS_ROWS, or when M <= SPLIT_MAX_ROWS and the bank's A (S*R*K elements)
exceeds SPLIT_MIN_A_BYTES; fused otherwise. Decided once per shape (cached).
Measured on an H100 (benchmarks/bench_delta.py times both paths at the LLM shapes, CUDA graphs):
16 x 4096 -> 4096 bf16, added to the base GEMM: r16 fused 16.5 us / split 9.8 us; 4 x r16 blend
20.0 / 13.1; 256 rows: r16 18.4 / 19.0, 4 x r16 34.5 / 22.7, r16 in an 8 x 64 bank 26.3 / 13.3.
"""

from __future__ import annotations

import functools

SPLIT_ALWAYS_ROWS = 64
SPLIT_MAX_ROWS = 256
SPLIT_MIN_A_BYTES = 256 * 1024


@functools.cache
def delta_plan(M: int, K: int, N: int, S: int, R: int, itemsize: int, sms: int) -> str:
    """"fused" or "split" for a [M, K] x bank [S, R, K] -> [M, N] delta."""
    if M <= SPLIT_ALWAYS_ROWS or (M <= SPLIT_MAX_ROWS and S * R * K * itemsize > SPLIT_MIN_A_BYTES):
        return "split"
    return "fused"
