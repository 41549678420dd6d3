"""Which path computes y = x W^T (+ bias) + LoRA delta for one layer shape, decided once and cached.

Paths (all give y within the numerics contract's tolerance; tests/kernels/test_lora_linear.py):
- "merged":       lora_merge writes W'_g = W + sum_s w_gs B_s A_s (fp32 sum, one rounding), then one
                  cuBLAS GEMM (a batched one for G groups): ~4*G*N*K extra bytes, independent of M,
                  plus a rank-proportional term;
- "cublas_delta": cuBLAS base GEMM, then the lora_delta kernel (re-reads x, read-modify-writes y):
                  ~2MK + 4MN extra bytes, the cheapest for few rows;
- "fused":        one Triton launch, base GEMM with the shrink in its K loop, expand in the epilogue;
- "fused_pre":    lora_shrink, then the Triton GEMM with the expand in its epilogue;
- "reference":    cuBLAS base GEMM, then the torch delta (fallback only).

Measured on an H100 (benchmarks/results/nvidia-h100-80gb-hbm3/fused.json): the Triton GEMM under the fused forms
runs at 0.65-0.8 of cuBLAS at these shapes (Triton 3.6 on Hopper, pointer loads, no TMA or warp
specialisation), which no saving on the LoRA side makes up, so on Hopper the choice is between
"merged" (many rows) and "cublas_delta" (few rows); the fused forms stay for GPUs and shapes where
the model says otherwise, and are tested like the rest.

A CUTLASS fused form was built and measured too, and is not a path (deleted after session 11, in git history
as fdlora/kernels/cutlass; results/.../cutlass_s9_*.json): CUTLASS 4.2's warp-specialized cooperative GEMM with
the shrink as a second,
N=16 wgmma per k-block and the expand as one extra k-stage. Exact on every check, but on the seven SDXL/Flux
shapes its plain GEMM alone runs at 1.06-1.31x cuBLAS (128x256 tiles, cluster 1x1; the best of 1x1, 2x1 and
stream-K 1.03-1.23x) and the in-loop shrink adds 5-21% to it at r16 (28-48% at r64): 1.20-1.48x cuBLAS at r16,
behind "merged" (1.03-1.19x) on every shape. Of that, the N=16 wgmma itself costs 8-16% (the same kernel
without it, cutlass_s9_noshrink.json; its FLOP share is 6%), the extra stage and A loads 0-14% (most at
small K). The Triton TMA probe found the same in-loop cost (probe_tma.json).

The choice depends on static shapes only (M, K, N, bank [S, R], groups G, dtype, SM count), never
on which adapters are active, so compiled graphs and CUDA graphs never change with a switch. It
comes from the cost model `estimate` (fdlora/kernels/costmodel.py, shared with `fdlora plan`: microseconds,
constants fitted to H100 measurements of every path at the SDXL / Flux / decode shapes);
benchmarks/bench_fused.py re-measures every path and checks that the modelled choice is within 3% of the
measured best. `record` lets a caller that measured override the model for one shape.

With FDLORA_DISPATCH=measure, the first eager CUDA call of a shape where the model's best paths lie
within `AMBIGUOUS` of each other times those paths on the call's own inputs and keeps the fastest:
GPU time only (each path captured once in a CUDA graph and replayed between CUDA events), since
host-inclusive wall time ranks paths by launch overhead instead (a rejected first try:
benchmarks/results/nvidia-h100-80gb-hbm3/fused_measured_dispatch_rejected.json). Calls that cannot
time (compiling, capturing, fake tensors) use the model; a failed measurement falls back to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fdlora import env
from fdlora.kernels.costmodel import (
    Problem,
    estimate,
)
from fdlora.kernels.eager import graphed, warm_up


def delta_available() -> bool:
    """The Triton lora_delta op (the cuBLAS + delta path) is registered."""
    from fdlora.kernels.triton.forward import lora_delta  # noqa: F401  registers fdlora::lora_delta

    return hasattr(torch.ops.fdlora, "lora_delta")


PATHS = ("fused", "fused_pre", "cublas_delta", "merged", "reference")


@dataclass(frozen=True)
class Plan:
    path: str
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.path} [{'; '.join(self.reasons)}]"


_PLANS: dict[Problem, Plan] = {}


def _fastest(how: str, us: dict[str, float]) -> tuple[str, tuple[str, ...]]:
    order = sorted(us, key=us.get)
    return order[0], (f"{how}: " + ", ".join(f"{k} {us[k]:.1f}us" for k in order),)


AMBIGUOUS = 0.15  # modelled paths within this share of the best are timed when measuring (the model errs ~10%)
MEASURE_REPS = 10


def graph_us(fn: Callable[[], object], reps: int = MEASURE_REPS) -> float:
    """GPU microseconds of one `fn()`: warmed up on a side stream (autotuning, compiles), captured once in a
    CUDA graph, replayed `reps` times between CUDA events; the best of three rounds."""
    warm_up(fn)
    graph, _ = graphed(fn)
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def decided(p: Problem) -> Plan | None:
    """The cached plan for `p`, if one was made (the per-call fast path: no runner, no timing)."""
    return _PLANS.get(p)


def plan(p: Problem, run: Callable[[str], object] | None = None,
         timer: Callable[[Callable[[], object]], float] = graph_us) -> Plan:
    """The path for `p`, decided once per shape and cached: a recorded measurement if there is one; else the
    cost model, or with FDLORA_DISPATCH=measure and `run` (path -> runs it on the call's real inputs) the
    fastest of the model's close candidates by `timer`."""
    got = _PLANS.get(p)
    if got is not None:
        return got
    if p.device != "cuda":  # CPU: the Triton interpreter (tests); the fused kernel is what they test
        got = Plan("fused", (f"device {p.device}: Triton interpreter, fused kernel",))
    else:
        us = estimate(p)
        got = Plan(*_fastest("cost model", us))
        close = [k for k in sorted(us, key=us.get) if us[k] <= us[got.path] * (1 + AMBIGUOUS)]
        if run is not None and len(close) > 1 and env.dispatch_measure():
            try:
                timed = {k: timer(lambda k=k: run(k)) for k in close}
            except Exception as e:  # capture refused, out of memory, ...: the model decides
                got = Plan(got.path, got.reasons + (f"measuring failed ({type(e).__name__}: {e})"[:200],))
            else:
                path, why = _fastest("measured", timed)
                got = Plan(path, why + got.reasons)
    _PLANS[p] = got
    return got


def record(p: Problem, timings_us: dict[str, float]) -> Plan:
    """Make measured timings the plan for `p` (the fastest path wins)."""
    got = Plan(*_fastest("measured", timings_us))
    _PLANS[p] = got
    return got


def clear() -> None:
    _PLANS.clear()
