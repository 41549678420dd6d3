"""When the blend/per-sample delta runs fused (one launch) or split (shrink, then expand-add).

The fused kernel computes h = x A^T once per row block. With few rows there are too few row blocks
to fill the GPU, so its programs also split the N sweep, and each of them re-reads every live A
over the whole K (L2 traffic n_split * S*R*K, and a long serial K loop per program). The split
path streams A once across the whole GPU (K split into partial sums), writes a tiny fp32 h, and
expands over N tiles: two launches, but no redundant A reads and short loops.

Rule (static shapes only, so it never depends on which adapters are active and never recompiles):
split when M <= SPLIT_MAX_ROWS, fused otherwise. Decided once per shape (cached).
Measured on an H100 (benchmarks/bench_delta.py times both paths at the LLM shapes; CUDA graphs,
L2 flushed; time added to the base GEMM, bf16, 4096 -> 4096), fused / split:
  16 rows:  r16 15.9 / 11.6 us, r64 283 / 15.6, 4 x r16 blend 20.9 / 14.8, r16 in an 8 x 64 bank 14.4 / 14.0
  256 rows: r16 19.1 / 10.6 us, r64 29.3 / 25.4, 4 x r16 blend 30.3 / 22.7, r16 in an 8 x 64 bank 20.3 / 19.1
At diffusion sizes (4608 rows and up) the fused kernel is the one that reaches the bandwidth floor.
"""

from __future__ import annotations

import functools

SPLIT_MAX_ROWS = 256


@functools.cache
def delta_plan(M: int, K: int, N: int, S: int, R: int, itemsize: int, sms: int) -> str:
    """"fused" or "split" for a [M, K] x bank [S, R, K] -> [M, N] delta."""
    return "split" if M <= SPLIT_MAX_ROWS else "fused"
