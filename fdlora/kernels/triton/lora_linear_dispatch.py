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

A CUTLASS fused form was built and measured too, and is not a path (fdlora/kernels/cutlass, bench_cutlass.py,
results/.../cutlass_s9_*.json): CUTLASS 4.2's warp-specialized cooperative GEMM with the shrink as a second,
N=16 wgmma per k-block and the expand as one extra k-stage. Exact on every check, but on the seven SDXL/Flux
shapes its plain GEMM alone runs at 1.06-1.31x cuBLAS (128x256 tiles, cluster 1x1; the best of 1x1, 2x1 and
stream-K 1.03-1.23x) and the in-loop shrink adds 5-21% to it at r16 (28-48% at r64): 1.20-1.48x cuBLAS at r16,
behind "merged" (1.03-1.19x) on every shape. Of that, the N=16 wgmma itself costs 8-16% (the same kernel
without it, cutlass_s9_noshrink.json; its FLOP share is 6%), the extra stage and A loads 0-14% (most at
small K). The Triton TMA probe found the same in-loop cost (probe_tma.json).

The choice depends on static shapes only (M, K, N, bank [S, R], groups G, dtype, SM count), never
on which adapters are active, so compiled graphs and CUDA graphs never change with a switch. It
comes from the cost model `estimate` (microseconds, constants fitted to H100 measurements of
every path at the SDXL / Flux / decode shapes); benchmarks/bench_fused.py re-measures every path
and checks that the modelled choice is within 3% of the measured best. `record` lets a caller
that measured override the model for one shape.

With FDLORA_DISPATCH=measure, the first eager CUDA call of a shape where the model's best paths lie
within `AMBIGUOUS` of each other times those paths on the call's own inputs and keeps the fastest:
GPU time only (each path captured once in a CUDA graph and replayed between CUDA events), since
host-inclusive wall time ranks paths by launch overhead instead (a rejected first try:
benchmarks/results/nvidia-h100-80gb-hbm3/fused_measured_dispatch_rejected.json). Calls that cannot
time (compiling, capturing, fake tensors) use the model; a failed measurement falls back to it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ... import env

PATHS = ("fused", "fused_pre", "cublas_delta", "merged", "reference")

# Cost model constants, fitted to an H100 SXM (bf16) run of benchmarks/bench_fused.py
# (benchmarks/results/nvidia-h100-80gb-hbm3/fused.json).
PEAK_TFLOPS = 790.0  # dense bf16 tensor-core rate cuBLAS approaches at large K
K_HALF = 400.0  # cuBLAS efficiency ~ K / (K + K_HALF): prologue/epilogue weigh more at small K
HBM_GBS = 2500.0  # what streaming kernels achieve (x, y, W reads and writes)
L2_BYTES = 50e6  # a merged weight larger than L2 is re-read from HBM by the GEMM that follows
MERGE_US_PER_MEL = 2.1  # lora_merge: microseconds per million weight elements (read W, write W')
# ... plus this per million elements per packed rank column above 16. Refit in session 10 from merge_only at r16 vs
# r64 (fused_s10.json: 0.015-0.023 on weights of >= 1.6M elements); 0.062 before chose cublas_delta on Flux r64 /
# blend layers that run 4-11% faster merged in interleaved timing (probe_checked.json).
MERGE_US_PER_MEL_RANK = 0.02
DELTA_GBS = 2600.0  # lora_delta on x + y read-modify-write, when its programs fill the GPU
DELTA_TFLOPS = 250.0  # lora_delta's shrink + expand rate per rank column above 16
LAUNCH_US = 3.0  # one extra launch in a graph / stream
TRITON_GEMM_SLOWDOWN = 1.5  # Triton 3.6 GEMM time / cuBLAS time at these shapes (measured 1.3-1.5)
FUSED_BN = 256  # N tile of the fused kernel: the in-loop shrink costs RC/BN of its GEMM


@dataclass(frozen=True)
class Problem:
    M: int
    K: int
    N: int
    S: int
    R: int
    dtype: torch.dtype
    device: str
    sms: int
    G: int = 1


@dataclass(frozen=True)
class Plan:
    path: str
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.path} [{'; '.join(self.reasons)}]"


_PLANS: dict[Problem, Plan] = {}


def delta_available() -> bool:
    """The Triton lora_delta op (cuBLAS + delta path) is importable and registered."""
    try:
        importlib.import_module("fdlora.kernels.triton.lora_delta")
    except Exception:
        return False
    return hasattr(torch.ops.fdlora, "lora_delta")


def _gemm_us(M: int, K: int, N: int, itemsize: int) -> float:
    """cuBLAS GEMM time: compute at a K-dependent share of peak, or the bytes, whichever is longer."""
    compute = 2.0 * M * N * K / (PEAK_TFLOPS * 1e6 * K / (K + K_HALF))
    bytes_ = (M * K + N * K + M * N) * itemsize / (HBM_GBS * 1e3)
    return max(compute, bytes_) + LAUNCH_US


def estimate(p: Problem) -> dict[str, float]:
    """Modelled microseconds of every path that can run problem `p` (rank = bank capacity S*R)."""
    b = torch.tensor([], dtype=p.dtype).element_size()
    base = _gemm_us(p.M, p.K, p.N, b)
    width = p.S * p.R
    over16 = max(0, width - 16)
    x_bytes, y_bytes, w_bytes = p.M * p.K * b, p.M * p.N * b, p.N * p.K * b
    rows = max(1, p.M // p.G)
    mel = p.N * p.K / 1e6
    merge = max(LAUNCH_US + 1.0, MERGE_US_PER_MEL * mel + 1.0) + MERGE_US_PER_MEL_RANK * mel * over16
    spill = w_bytes / (HBM_GBS * 1e3) if w_bytes > L2_BYTES else 0.0
    out = {
        "merged": p.G * (_gemm_us(rows, p.K, p.N, b) + merge + spill),
        "reference": base + 3 * (x_bytes + 2 * y_bytes) / (HBM_GBS * 1e3) + 6 * LAUNCH_US,
    }
    if p.dtype != torch.float32:  # fp32 Triton dots run IEEE on CUDA cores: never the fast path
        rc = min(64, max(16, width))
        more = max(0, width - 64) / 64  # extra shrink passes of the in-loop form
        triton_gemm = base * TRITON_GEMM_SLOWDOWN
        out["fused"] = triton_gemm * (1 + (rc + more * 64) / FUSED_BN)
        out["fused_pre"] = triton_gemm + x_bytes / (HBM_GBS * 1e3) + LAUNCH_US
    if delta_available():
        # lora_delta runs one program per 64-row block (16 when few), spreading over N only when
        # row blocks are fewer than SMs: below a full GPU its bandwidth falls with the program count.
        blocks = -(-p.M // (16 if p.M <= 64 else 64))
        programs = blocks * max(1, min(-(-p.N // 128), p.sms // blocks))
        bw = DELTA_GBS * 1e3 * min(1.0, programs / p.sms)
        flops = 2.0 * p.M * (p.K + p.N) * over16 / (DELTA_TFLOPS * 1e6)
        out["cublas_delta"] = base + (x_bytes + 2 * y_bytes) / bw + flops + 2 * LAUNCH_US
    return out


def _fastest(how: str, us: dict[str, float]) -> tuple[str, tuple[str, ...]]:
    order = sorted(us, key=us.get)
    return order[0], (f"{how}: " + ", ".join(f"{k} {us[k]:.1f}us" for k in order),)


AMBIGUOUS = 0.15  # modelled paths within this share of the best are timed when measuring (the model errs ~10%)
MEASURE_REPS = 10


def graph_us(fn: Callable[[], object], reps: int = MEASURE_REPS) -> float:
    """GPU microseconds of one `fn()`: warmed up on a side stream (autotuning, compiles), captured once in a
    CUDA graph, replayed `reps` times between CUDA events; the best of three rounds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
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
