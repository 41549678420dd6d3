"""The "triton+cuda" backend: each op from the backend measured faster for it, once the CUDA extension is built.

Measured on an H100 (benchmarks/bench_cuda_backend.py, same calls, same tensors):
- the per-call GEMM paths are the compiled extension's (cuBLAS with fp32 output for the shrink, beta=1 expand, the
  merged W' on tensor cores): lora_linear 0.075 vs 0.147 ms at SDXL attention sizes, 0.17 vs 0.24 ms at Flux
  sizes, lora_delta and lora_shrink ahead at every shape, and full-size eager steps without the merged-weight
  cache at 1.66x (SDXL) and 1.16x (Flux) the base step where Triton's kernels give 3.52x and 1.41x;
- the merges stay Triton's (lora_merge 0.094 vs 0.20 ms on SDXL feed-forward weights, 0.068 vs 0.11 ms at Flux
  sizes; lora_merge_many walks a kept table of layers: what a slider move re-merges), and so do the per-row decode
  launches kept ready by eager decode layers (fdlora.layers.fastpath.decode) where the extension cannot bind the layer's
  whole call; where it can (prepare_linear_rows: base GEMM + per-row kernel in one C++ call, no Triton launcher
  in Python), decode layers take that (Llama-3-8B decode steps, bench_fullsize).
The registry picks this backend under `auto` only when the extension is already built (ahead of time with
`FDLORA_BUILD_CUDA=1 pip install ...` or `fdlora env --build-cuda`, or by an earlier JIT build): choosing a backend
never starts a build. Both halves implement the reference's semantics (fp32 accumulation, one rounding), and each
op's tests run on each backend.
"""

from __future__ import annotations

from .cuda.ops import (
    lora_delta,
    lora_expand_add,
    lora_linear,
    lora_shrink,
    prepare_groups,
    prepare_linear,
    prepare_linear_rows,
    prepare_samples,
    prepare_samples_banked,
)
from .triton.ops import (
    lora_delta_rows,
    lora_merge,
    lora_merge_many,
    merge_table,
    prepare_delta_rows,
    prepare_merge,
    prepare_merge_many,
)

__all__ = ["lora_delta", "lora_delta_rows", "lora_expand_add", "lora_linear", "lora_merge", "lora_merge_many",
           "lora_shrink", "merge_table", "prepare_delta_rows", "prepare_groups", "prepare_linear",
           "prepare_linear_rows", "prepare_merge", "prepare_merge_many", "prepare_samples",
           "prepare_samples_banked"]

NOT_IMPLEMENTED = {"lora_conv_delta": "conv LoRA runs on the torch or cuda backend "
                                      "(the registry routes conv layers there)"}
