"""The one place fd-lora reads environment variables."""

from __future__ import annotations

import os
from pathlib import Path

BACKEND_VAR = "FDLORA_BACKEND"


def backend_preference() -> str:
    """`FDLORA_BACKEND`: auto | triton | cuda | triton+cuda | torch (default auto)."""
    return os.environ.get(BACKEND_VAR, "auto").strip().lower() or "auto"


def triton_interpret() -> bool:
    """`TRITON_INTERPRET=1` runs Triton kernels on CPU (tests); it must be set before triton imports."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


CACHE_BYTES_VAR = "FDLORA_CACHE_BYTES"


def adapter_cache_bytes(default: int = 4 << 30) -> int:
    """`FDLORA_CACHE_BYTES`: byte budget of the in-RAM cache of converted adapters (default 4 GiB; 0 disables it)."""
    raw = os.environ.get(CACHE_BYTES_VAR, "").strip()
    if not raw:
        return default
    try:
        return max(0, int(float(raw)))
    except ValueError:
        from .errors import FdLoraError

        raise FdLoraError(
            f"{CACHE_BYTES_VAR}={raw!r} is not a byte count; set e.g. 2e9, 0 to disable, or unset it."
        ) from None


MERGE_CACHE_VAR = "FDLORA_MERGE_CACHE"


def merge_cache_limit() -> str:
    """`FDLORA_MERGE_CACHE`: byte budget per device of merged-weight copies (fdlora.layers.fastpath.merged):
    "auto" (default), a byte count such as 8e9, a share of device memory such as 25%, or 0 to turn it off."""
    return os.environ.get(MERGE_CACHE_VAR, "auto").strip().lower() or "auto"


DISPATCH_VAR = "FDLORA_DISPATCH"


def dispatch_measure() -> bool:
    """`FDLORA_DISPATCH`: "auto" (default: the cost model of fdlora.kernels.triton.forward.lora_linear_dispatch, kept
    to the cuBLAS-based paths on a GPU it was not calibrated on), "model" (every path the model knows, on any GPU)
    or "measure" (as "model", and the first eager call of an ambiguous layer shape times the close candidates);
    "cublas": the per-call cuBLAS forms (fdlora.layers.fastpath.percall) for every eager call."""
    return os.environ.get(DISPATCH_VAR, "auto").strip().lower() == "measure"


def dispatch_mode() -> str:
    """`FDLORA_DISPATCH` as set: auto | model | measure | cublas (the per-call cuBLAS forms of
    fdlora.layers.fastpath.percall for every eager call, on any GPU or the CPU)."""
    return os.environ.get(DISPATCH_VAR, "auto").strip().lower() or "auto"


def dispatch_all_paths() -> bool:
    """FDLORA_DISPATCH=model or measure: every path the cost model knows, on calibrated and uncalibrated GPUs."""
    return os.environ.get(DISPATCH_VAR, "auto").strip().lower() in ("model", "measure")


DEBUG_DISPATCH_VAR = "FDLORA_DEBUG_DISPATCH"


def debug_dispatch() -> bool:
    """`FDLORA_DEBUG_DISPATCH=1`: log every dispatch decision (backend, per-shape plan, the path each layer takes)
    on the "fdlora.dispatch" logger."""
    return os.environ.get(DEBUG_DISPATCH_VAR, "").strip().lower() in ("1", "true", "yes", "on")


CUDA_CACHE_VAR = "FDLORA_CUDA_CACHE"
CUDA_ARCHS_VAR = "FDLORA_CUDA_ARCHS"


def cuda_cache_dir() -> Path:
    """`FDLORA_CUDA_CACHE`: where the CUDA C++ extension is built on first use (default ~/.cache/fdlora/cuda)."""
    raw = os.environ.get(CUDA_CACHE_VAR, "").strip()
    return Path(raw) if raw else Path.home() / ".cache" / "fdlora" / "cuda"


def cuda_archs() -> str:
    """`FDLORA_CUDA_ARCHS`: compute capabilities to build the CUDA extension for, e.g. "8.0;9.0" (default: the
    local GPUs')."""
    return os.environ.get(CUDA_ARCHS_VAR, "").strip()


MAX_RANK_VAR = "FDLORA_MAX_RANK"
DEFAULT_MAX_RANK = 1024  # above every published LoRA we know of; a rank-4096 module would grow each bank ~60x


def max_rank_limit() -> int:
    """`FDLORA_MAX_RANK`: the highest LoRA rank fd-lora accepts (default 1024). Banks grow to fit the largest
    rank loaded, so one huge-rank module in a small file can cost gigabytes; raise it only for adapters you need."""
    raw = os.environ.get(MAX_RANK_VAR, "").strip()
    if not raw:
        return DEFAULT_MAX_RANK
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        from .errors import FdLoraError

        raise FdLoraError(f"{MAX_RANK_VAR}={raw!r} is not a positive integer; set e.g. 2048, or unset it "
                          f"(default {DEFAULT_MAX_RANK}).")
    return value


READER_VAR = "FDLORA_READER"


def file_reader() -> str:
    """`FDLORA_READER`: how safetensors files are read: "auto" (default: the one-buffer pinned reader when the
    RAM cache pins, i.e. with CUDA; else the safetensors library), "pinned" (always the one-buffer reader; tests
    use it to cover that path on CPU) or "safetensors". Both run the same header checks (fdlora.hub.safefile)."""
    raw = os.environ.get(READER_VAR, "auto").strip().lower() or "auto"
    return raw if raw in ("auto", "pinned", "safetensors") else "auto"


PREFETCH_READER_VAR = "FDLORA_PREFETCH_READER"


def prefetch_reader() -> str:
    """`FDLORA_PREFETCH_READER`: where a background load (`prefetch_fd_lora`) reads and converts a file: "process"
    (default: fd-lora's reader process, fdlora.hub.worker, so the serving thread keeps the GIL) or "thread" (the
    prefetch's own thread in this process: no extra process, but steps running meanwhile slow down; the default
    where the process cannot be started, off POSIX: it is handed its pipes by descriptor)."""
    default = "process" if os.name == "posix" else "thread"
    raw = os.environ.get(PREFETCH_READER_VAR, default).strip().lower()
    return raw if raw in ("process", "thread") else default


TRAIN_BACKWARD_VAR = "FDLORA_TRAIN_BACKWARD"


TRAIN_CPP_VAR = "FDLORA_TRAIN_CPP"


def train_cpp() -> bool:
    """`FDLORA_TRAIN_CPP`: whether eager training steps may build and run the C++ form of the trainable layer
    (fdlora.kernels.host; default on; 0 / off / false / no: the Python Function, which computes the same)."""
    return os.environ.get(TRAIN_CPP_VAR, "").strip().lower() not in ("0", "off", "false", "no")


def train_backward() -> str:
    """`FDLORA_TRAIN_BACKWARD`: how a trainable layer's LoRA backward runs on CUDA: "blas" (default: four cuBLAS
    GEMMs in the activations' dtype, fdlora.kernels.ops.lora_train.lora_train_linear_backward_blas) or
    "triton" (the two-pass fused kernels of fdlora.kernels.triton.train.lora_backward: one read of gy, one of u, split-K
    partial sums instead of atomics; still slower than the cuBLAS path at every measured Llama-3-8B layer shape on an
    H100, 0.21-0.41 vs 0.15-0.26 ms: benchmarks/probes/sweep_train_backward.py)."""
    raw = os.environ.get(TRAIN_BACKWARD_VAR, "blas").strip().lower()
    return raw if raw in ("blas", "triton") else "blas"


def accelerate_fsdp() -> bool:
    """`ACCELERATE_USE_FSDP=true`: what `accelerate launch --use_fsdp` (or an accelerate config with
    `distributed_type: FSDP`) sets; `fdlora train` then shards the base with FSDP (fdlora.training.fsdp)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").strip().lower() in ("1", "true", "yes")
