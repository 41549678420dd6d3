"""One cost model: the per-layer dispatcher (fdlora.kernels.triton.forward.lora_linear_dispatch) and `fdlora plan`
import this same code, so the path a layer takes and the time the planner predicts for it cannot drift apart.

Times are microseconds from a roofline: a GEMM runs at a K-dependent share of peak tensor-core rate or at
the bytes it moves, whichever is longer, plus a launch. Every constant names the GPU and bench it was fitted to. The
module constants are the H100 SXM values the dispatcher has always used; `Device` carries the same numbers
for other GPUs (fdlora.plan.devices) and `estimate(p, dev)` evaluates the model on one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

# Fitted to an H100 SXM (bf16) run of benchmarks/bench_fused.py.
PEAK_TFLOPS = 790.0  # dense bf16 tensor-core rate cuBLAS approaches at large K
K_HALF = 400.0  # cuBLAS efficiency ~ K / (K + K_HALF): prologue/epilogue weigh more at small K
HBM_GBS = 2500.0  # what streaming kernels achieve (x, y, W reads and writes)
L2_BYTES = 50e6  # a merged weight larger than L2 is re-read from HBM by the GEMM that follows
MERGE_US_PER_MEL = 2.1  # lora_merge: microseconds per million weight elements (read W, write W')
# ... plus this per million elements per packed rank column above 16: merge_only at r16 vs r64 on an H100 gives
# 0.015-0.023 on weights of >= 1.6M elements; a larger value sends Flux r64 / blend layers to cublas_delta, which
# run faster merged (benchmarks/probes/probe_checked.py times the two).
MERGE_US_PER_MEL_RANK = 0.02
DELTA_GBS = 2600.0  # lora_delta on x + y read-modify-write, when its programs fill the GPU
DELTA_TFLOPS = 250.0  # lora_delta's shrink + expand rate per rank column above 16
LAUNCH_US = 3.0  # one extra launch in a graph / stream
TRITON_GEMM_SLOWDOWN = 1.5  # Triton 3.6 GEMM time / cuBLAS time at these shapes (measured 1.3-1.5)
FUSED_BN = 256  # N tile of the fused kernel: the in-loop shrink costs RC/BN of its GEMM


@dataclass(frozen=True)
class Device:
    """The constants of one device. Per-layer GEMM terms as above; the step terms are the planner's: `attn_eff`
    is flash attention's share of peak (fitted to Flux CUDA-graph steps, bench_captured), `host_op_us` the eager
    host time per aten op (Python modules of diffusers/transformers plus the dispatcher, fitted to the gap
    between eager (bench_pipeline) and CUDA-graph (bench_captured) SDXL steps), `host_cached_us` / `host_percall_us`
    what a fused layer adds to nn.Linear's host time (bench_pipeline: cached vs merged, per-call vs merged), and
    `host_percall_group_us` what each further distinct blend of a per-prompt batch adds to a per-call layer (its
    merge and GEMM launches; 0 where not fitted)."""

    name: str
    source: str
    peak_tflops: float = PEAK_TFLOPS
    k_half: float = K_HALF
    hbm_gbs: float = HBM_GBS
    l2_bytes: float = L2_BYTES
    merge_us_per_mel: float = MERGE_US_PER_MEL
    merge_us_per_mel_rank: float = MERGE_US_PER_MEL_RANK
    delta_gbs: float = DELTA_GBS
    delta_tflops: float = DELTA_TFLOPS
    launch_us: float = LAUNCH_US
    triton_gemm_slowdown: float = TRITON_GEMM_SLOWDOWN
    sms: int = 132
    memory_gib: float = 80.0
    attn_eff: float = 0.55
    elementwise_eff: float = 0.8
    host_op_us: float = 30.0
    host_cached_us: float = 6.0
    host_percall_us: float = 175.0
    host_percall_group_us: float = 0.0  # each further blend of a per-prompt batch, on top of host_percall_us
    h2d_gbs: float = 20.0  # loading adapters / weights from pinned host memory (PCIe 5 x16 in practice)

    def scaled(self, **kw: float) -> Device:
        return replace(self, **kw)


H100 = Device("h100", "fitted: an H100 SXM, bf16 (bench_fused, bench_pipeline, bench_captured; "
              "benchmarks/README.md)")


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


def gemm_us(M: int, K: int, N: int, itemsize: float, dev: Device = H100, batch: int = 1) -> float:
    """cuBLAS GEMM time: compute at a K-dependent share of peak, or the bytes, whichever is longer."""
    compute = 2.0 * batch * M * N * K / (dev.peak_tflops * 1e6 * K / (K + dev.k_half))
    bytes_ = batch * (M * K + N * K + M * N) * itemsize / (dev.hbm_gbs * 1e3)
    return max(compute, bytes_) + dev.launch_us


def merge_us(N: int, K: int, width: int, dev: Device = H100) -> float:
    """lora_merge of one [N, K] weight with `width` packed rank columns (read W, write W')."""
    mel = N * K / 1e6
    return max(dev.launch_us + 1.0, dev.merge_us_per_mel * mel + 1.0) + dev.merge_us_per_mel_rank * mel * max(
        0, width - 16)


def estimate(p: Problem, dev: Device | None = None, delta: bool = True) -> dict[str, float]:
    """Modelled microseconds of every path that can run problem `p` (rank = bank capacity S*R) on `dev`
    (default the H100 constants above); `delta` says whether the lora_delta op exists (the Triton backend has it)."""
    d = dev or H100
    b = torch.tensor([], dtype=p.dtype).element_size()
    base = gemm_us(p.M, p.K, p.N, b, d)
    width = p.S * p.R
    over16 = max(0, width - 16)
    x_bytes, y_bytes, w_bytes = p.M * p.K * b, p.M * p.N * b, p.N * p.K * b
    rows = max(1, p.M // p.G)
    spill = w_bytes / (d.hbm_gbs * 1e3) if w_bytes > d.l2_bytes else 0.0
    out = {
        "merged": p.G * (gemm_us(rows, p.K, p.N, b, d) + merge_us(p.N, p.K, width, d) + spill),
        "reference": base + 3 * (x_bytes + 2 * y_bytes) / (d.hbm_gbs * 1e3) + 6 * d.launch_us,
    }
    if p.dtype != torch.float32:  # fp32 Triton dots run IEEE on CUDA cores: never the fast path
        rc = min(64, max(16, width))
        more = max(0, width - 64) / 64  # extra shrink passes of the in-loop form
        triton_gemm = base * d.triton_gemm_slowdown
        out["fused"] = triton_gemm * (1 + (rc + more * 64) / FUSED_BN)
        out["fused_pre"] = triton_gemm + x_bytes / (d.hbm_gbs * 1e3) + d.launch_us
    if delta:
        # lora_delta runs one program per 64-row block (16 when few), spreading over N only when
        # row blocks are fewer than SMs: below a full GPU its bandwidth falls with the program count.
        sms = p.sms or d.sms
        blocks = -(-p.M // (16 if p.M <= 64 else 64))
        programs = blocks * max(1, min(-(-p.N // 128), sms // blocks))
        bw = d.delta_gbs * 1e3 * min(1.0, programs / sms)
        flops = 2.0 * p.M * (p.K + p.N) * over16 / (d.delta_tflops * 1e6)
        out["cublas_delta"] = base + (x_bytes + 2 * y_bytes) / bw + flops + 2 * d.launch_us
    return out


CALIBRATED = ("h100",)  # GPUs the constants above were fitted on


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def profile(name: str | None = None) -> tuple[str, bool]:
    """(GPU name, calibrated): whether these constants were fitted on this GPU (default: the current CUDA device).
    The dispatcher keeps an uncalibrated GPU to the cuBLAS-based paths unless FDLORA_DISPATCH=model."""
    if name is None:
        name = _gpu_name(torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    key = name.lower().replace(" ", "")
    return name, any(k in key for k in CALIBRATED)
