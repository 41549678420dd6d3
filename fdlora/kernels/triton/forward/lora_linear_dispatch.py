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

The Triton GEMM under the fused forms runs well below cuBLAS on Hopper (no TMA or warp specialisation), which no
saving on the LoRA side makes up, so on Hopper the choice is between "merged" (many rows) and "cublas_delta" (few
rows); the fused forms stay for shapes where the model says otherwise, and are tested like the rest.

The cost model's constants are fitted to one GPU (the H100). On any other GPU the dispatcher is conservative: it
chooses among the cuBLAS-based paths only ("merged", "cublas_delta", "reference"), which are never pathological,
unless FDLORA_DISPATCH=model asks for every path the model knows. `profile()` says which holds here (`fdlora env`
prints it). With FDLORA_DEBUG_DISPATCH=1 every new plan is logged (logger "fdlora.dispatch") with its reasons.

The choice depends on static shapes only (M, K, N, bank [S, R], groups G, dtype, SM count) and the GPU, never
on which adapters are active or on what ran before in the process, so compiled graphs and CUDA graphs never change
with a switch. It comes from the cost model `estimate` (fdlora/kernels/costmodel.py, shared with `fdlora plan`);
benchmarks/bench_fused.py re-measures every path and checks that the modelled choice is within 3% of the measured
best. `record` lets a caller that measured override the model for one shape.

With FDLORA_DISPATCH=measure, the first eager CUDA call of a shape where the model's best paths lie
within `AMBIGUOUS` of each other times those paths on the call's own inputs and keeps the fastest:
GPU time only (each path captured once in a CUDA graph and replayed between CUDA events), since
host-inclusive wall time ranks paths by launch overhead instead. Calls that cannot
time (compiling, capturing, fake tensors) use the model; a failed measurement falls back to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fdlora import env
from fdlora.kernels.costmodel import (  # noqa: F401  the one cost model, shared with `fdlora plan` (re-exported)
    CALIBRATED,
    DELTA_GBS,
    DELTA_TFLOPS,
    FUSED_BN,
    HBM_GBS,
    K_HALF,
    L2_BYTES,
    LAUNCH_US,
    MERGE_US_PER_MEL,
    MERGE_US_PER_MEL_RANK,
    PEAK_TFLOPS,
    TRITON_GEMM_SLOWDOWN,
    Problem,
    estimate,
    profile,
)
from fdlora.kernels.eager import graphed, warm_up


def delta_available() -> bool:
    """The Triton lora_delta op (the cuBLAS + delta path) is registered."""
    from fdlora.kernels.triton.forward import lora_delta  # noqa: F401  registers fdlora::lora_delta

    return hasattr(torch.ops.fdlora, "lora_delta")


PATHS = ("fused", "fused_pre", "cublas_delta", "merged", "reference")
CUBLAS_PATHS = ("merged", "cublas_delta", "reference")  # what an uncalibrated GPU chooses among
log = logging.getLogger("fdlora.dispatch")


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
        name, calibrated = profile()
        if not calibrated and not env.dispatch_all_paths():
            us = {k: v for k, v in us.items() if k in CUBLAS_PATHS}
            how = f"cost model, cuBLAS paths only ({name} is not calibrated)"
        else:
            how = f"cost model ({name})"
        got = Plan(*_fastest(how, us))
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
    if env.debug_dispatch():
        log.warning("lora_linear M=%d K=%d N=%d bank %dx%d G=%d %s -> %s", p.M, p.K, p.N, p.S, p.R, p.G, p.dtype, got)
    return got


def record(p: Problem, timings_us: dict[str, float]) -> Plan:
    """Make measured timings the plan for `p` (the fastest path wins)."""
    got = Plan(*_fastest("measured", timings_us))
    _PLANS[p] = got
    return got


def clear() -> None:
    _PLANS.clear()
