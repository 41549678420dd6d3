"""LoRA over a diffusers GGUF base, merged into the weight diffusers dequantizes on every call anyway.

    W' = dequant(Wq).to(compute_dtype) + sum_s scale_blend[s] B_s A_s        (transient, never stored)
    y  = F.linear(x, W', bias.to(compute_dtype))

Why: GGUFLinear.forward_native (diffusers' path wherever its optional CUDA kernels are not loaded) builds a full
dequantized W for every call and runs F.linear on it. The regular quantized-base path (fdlora.layers.modules.fused:
base(x) + the per-call delta) then re-reads x and reads and writes y on top: on full-size Flux-dev Q8_0 on an H100 that
was 1.149x the base step for one adapter (target 1.10). Writing W' where diffusers writes W costs, per call:
- Q8_0 with the Triton backend: nothing but a rank-r dot per tile of the one kernel that dequantizes
  (fdlora.kernels.triton.merge.gguf_merge), which also replaces diffusers' dequantization (several torch kernels and an
  fp16 intermediate): always taken;
- any other quant type, or no Triton (the torch and cuda backends, CPU): diffusers' own dequantization, then one
  in-place addmm_ of the blend (the live slots' ranks side by side, B scaled): ~2*N*K elements read and written,
  against ~M*K + 2*M*N for the delta, so taken only where it moves fewer bytes (`merge_pays`).
Nothing is kept: W' lives for the call, as diffusers' W does; the merged-weight cache never holds a dequantized
copy (fdlora.layers.quant.quantized says why). Measured on an H100 (benchmarks/bench_quantized.py, full-size Flux-dev
Q8_0, bf16, r16): the step runs at 0.81-0.90x the GGUF base's for one adapter and 0.83x for a 4-blend, below the base
because the kernel also replaces diffusers' dequantization (~5x faster without the LoRA, ~3.4x with one r16); the
LoRA itself adds ~50% to the dequantizing kernel (+25 us at 3072 x 12288), not to the step's GEMMs.

When (`forward`, from FusedLoraLinear.forward, blend mode only): the eager blend calls of fdlora.layers.quant.dequant
(the gate, the byte rule and the kept launch shared with torchao's weight-only bases), on a base that diffusers would
run through forward_native (its module-level `ops` is None, or the weight or input is not on CUDA). Per-sample and
per-row calls, and anything else, take the regular paths.

This is the one module of fdlora.layers that reads diffusers, lazily and only for a base that already is diffusers'
GGUFLinear: what it replaces is diffusers' own per-call computation, so it must follow diffusers' dispatch and
dequantization exactly.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from fdlora.layers.quant import quantized
from fdlora.layers.quant.dequant import (
    DELTA,
    KERNEL,
    TORCH,
    TRITON,
    Route,
    blend_addmm,
    eager_blend,
    kernel_merged,
    merge_pays,
)

_UTILS: list = []  # diffusers.quantizers.gguf.utils, once imported (None where it cannot be)


def _utils():
    if not _UTILS:
        try:
            from diffusers.quantizers.gguf import utils
        except Exception:  # diffusers or gguf missing or broken: no GGUF layer can exist then
            utils = None
        _UTILS.append(utils)
    return _UTILS[0]


def route(layer) -> Route | None:
    """How `layer`'s blend calls merge into its GGUF base (KERNEL or TORCH), or None when the base is not diffusers'
    GGUFLinear itself (then nothing here applies); FusedLoraLinear.select_backend keeps it as `_dequant`. Also drops
    the layer's kept launch: select_backend runs whenever the weight object, the device or the bank changed."""
    layer.__dict__.pop("_dequant_kept", None)
    base = layer.base
    kind = quantized.kind(base)
    if not (kind and kind.startswith("gguf ")):
        return None
    utils = _utils()
    if utils is None or type(base) is not utils.GGUFLinear or not isinstance(base.compute_dtype, torch.dtype):
        return None  # a subclass may compute otherwise; without a compute dtype forward_native keeps fp16
    this = sys.modules[__name__]
    if kind == "gguf Q8_0" and layer.selection.name in TRITON and base.in_features % 32 == 0:
        return Route(KERNEL, this)
    return Route(TORCH, this)


def forward(layer, x: torch.Tensor) -> torch.Tensor | None:
    """The layer's output on W' for a blend call (see the module docstring), or None when this call takes the regular
    path. The path a blend call took is noted as `layer.gguf_path` and `layer.merge_path` (benchmarks and tests read
    them)."""
    base, w = layer.base, layer.base._parameters.get("weight")
    if w is None or not eager_blend(layer, x):
        return None
    raw = torch.Tensor._make_subclass(torch.Tensor, w, False)  # the bytes (GGUFParameter's ops are slow to call)
    if x.is_cuda and raw.is_cuda and _utils().ops is not None:
        return None  # diffusers' forward_cuda (its fused GGUF matmul): no W to merge into
    A = layer.bank._buffers["A"]
    if x.device != raw.device or A.device != raw.device:
        return None
    K, N = layer.in_features, layer.out_features
    dtype = base.compute_dtype
    if layer._dequant.how == KERNEL:
        W, how = _kernel_merged(layer, raw, A, dtype), KERNEL
    elif merge_pays(x.numel() // K, N, K):
        W, how = _torch_merged(layer, w, raw, dtype), TORCH
    else:
        W, how = None, DELTA
    layer.__dict__.update(gguf_path=how, merge_path=how)
    if W is None:
        return None
    bias = base._parameters.get("bias")
    return F.linear(x, W, None if bias is None else bias.to(dtype))


def _kernel_merged(layer, raw: torch.Tensor, A: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W' by the Q8_0 kernel (dequant.kernel_merged: a kept launch replays in ~13 us of host time instead of ~35 on
    an H100 host; the kernel runs ~17 us at Flux's 3072^2)."""
    from fdlora.kernels.triton.merge import gguf_merge

    return kernel_merged(layer, (raw,), A, dtype, gguf_merge.gguf_q8_0_merge)


def _torch_merged(layer, w: torch.Tensor, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' dequantization of `w` in `dtype`, plus the blend (dequant.blend_addmm)."""
    return blend_addmm(layer, _utils().dequantize_gguf_tensor(w).to(dtype), raw)
