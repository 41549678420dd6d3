"""When the blend/per-sample delta runs fused (one launch) or split (shrink, then expand-add).

The fused kernel computes h = x A^T once per row block. With few rows there are too few row blocks
to fill the GPU, so its programs also split the N sweep, and each of them re-reads every live A
(L2 traffic n_split * S*R*K): that is cheap for a small rank and wasteful for a large one. The
split path streams A once across the whole GPU (K split into partial sums), writes a tiny fp32 h,
and expands over N tiles: two launches, but no redundant A reads.

Rule (static shapes only, so it never depends on which adapters are active and never recompiles):
split when M <= SPLIT_MAX_ROWS and the bank's A (S*R*K elements) exceeds SPLIT_MIN_A_BYTES; fused
otherwise. Decided once per shape (cached). The thresholds come from the decode benchmarks
(benchmarks/bench_delta.py times both paths at the LLM shapes).
"""

from __future__ import annotations

import functools

SPLIT_MAX_ROWS = 256
SPLIT_MIN_A_BYTES = 256 * 1024


@functools.cache
def delta_plan(M: int, K: int, N: int, S: int, R: int, itemsize: int, sms: int) -> str:
    """"fused" or "split" for a [M, K] x bank [S, R, K] -> [M, N] delta."""
    if M <= SPLIT_MAX_ROWS and S * R * K * itemsize > SPLIT_MIN_A_BYTES:
        return "split"
    return "fused"
