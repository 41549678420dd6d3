"""The compiled CUTLASS library (csrc/lora_gemm_sm90.cu) through ctypes: find it, load it, call it.

The library has a C ABI and links the CUDA runtime statically, so it needs neither torch's C++ headers
nor a matching toolkit at run time: only an sm_90 GPU and a driver for CUDA 13. benchmarks/build_cutlass.sh
compiles it. It is an experiment, not a dispatch path (see fdlora/kernels/triton/lora_linear_dispatch.py for why).
"""

from __future__ import annotations

import ctypes

import torch

from ... import env
from ...errors import BackendUnavailableError

DTYPES = {torch.bfloat16: 0, torch.float16: 1}

_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """The loaded library; BackendUnavailableError says how to build it when it is missing."""
    global _lib
    if _lib is None:
        path = env.cutlass_lib()
        if not path.is_file():
            raise BackendUnavailableError(f"the CUTLASS kernels are not built ({path} is missing): run "
                                          "`bash benchmarks/build_cutlass.sh` (it fetches nvcc and CUTLASS from pip), "
                                          f"or point {env.CUTLASS_LIB_VAR} at a built library")
        lib = ctypes.CDLL(str(path))
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p
        lib.fdlora_lora_gemm_sm90.argtypes = [i, p, p, p, p, p, f, f, f, i, i, p, i, i, i, i, p]
        lib.fdlora_lora_gemm_sm90.restype = i
        lib.fdlora_lora_gemm_sm90_noshrink.argtypes = lib.fdlora_lora_gemm_sm90.argtypes[1:]
        lib.fdlora_lora_gemm_sm90_noshrink.restype = i
        lib.fdlora_gemm_sm90.argtypes = [i, i, p, p, p, p, i, i, i, i, p]
        lib.fdlora_gemm_sm90.restype = i
        lib.fdlora_last_error.restype = ctypes.c_char_p
        _lib = lib
    return _lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _device_args(x: torch.Tensor) -> tuple[int, int]:
    """The SM count (the persistent grid) and the stream handle of x's device, the last two C arguments."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count  # torch caches the properties
    return sms, torch.cuda.current_stream(x.device).cuda_stream


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"fdlora cutlass {what}: {load().fdlora_last_error().decode()}")


def lora_gemm(
    x: torch.Tensor,  # [M, K] contiguous
    W: torch.Tensor,  # [N, K] contiguous
    bias: torch.Tensor | None,  # [N]
    A: torch.Tensor,  # [S, R, K] contiguous (packed: [S * R, K])
    B: torch.Tensor,  # [N, S, R] contiguous (packed: [N, S * R])
    scale: torch.Tensor,  # [S] fp32
    weight: torch.Tensor,  # [S] fp32 blend weights
    ranks: torch.Tensor,  # [S] int32
    out: torch.Tensor,  # [M, N]
    shrink: bool = True,  # False: the bf16 r16 timing probe without the shrink (the delta is then zero)
) -> torch.Tensor:
    """out = x W^T (+ bias) + sum_s scale[s] weight[s] (x A_s[:ranks[s]]^T) B_s[:, :ranks[s]]^T, one launch."""
    M, K = x.shape
    N = W.shape[0]
    S, R = A.shape[0], A.shape[1]
    lib = load()
    fn, head = (lib.fdlora_lora_gemm_sm90, [DTYPES[x.dtype]]) if shrink else (lib.fdlora_lora_gemm_sm90_noshrink, [])
    rc = fn(
        *head, _ptr(x), _ptr(W), _ptr(bias), _ptr(A), _ptr(B), _ptr(scale), _ptr(weight), _ptr(ranks),
        R, S * R, _ptr(out), M, N, K, *_device_args(x))
    _check(rc, "lora_gemm")
    return out


def gemm(x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
         variant: int = 1) -> torch.Tensor:
    """out = x W^T (+ bias) with CUTLASS's own main loop, the baseline the LoRA main loop is measured against
    (variant 1: cluster 1x1, 2: cluster 2x1, 3: stream-K, bf16 only)."""
    M, K = x.shape
    rc = load().fdlora_gemm_sm90(DTYPES[x.dtype], variant, _ptr(x), _ptr(W), _ptr(bias), _ptr(out), M, W.shape[0], K,
                                 *_device_args(x))
    _check(rc, "gemm")
    return out
