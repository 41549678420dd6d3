"""LoRA over a base that dequantizes its weight on every call, merged into that weight: torchao weight-only here.

    W' = dequant(W).to(x.dtype) + sum_s scale_blend[s] B_s A_s        (transient, never stored)
    y  = F.linear(x, W', bias)

Why: some quantized bases build a float W for every call anyway, then run a float matmul on it; the regular
quantized-base path (fdlora.layers.modules.fused: base(x) + the per-call delta) then re-reads x and reads and writes y
on top. Writing W' where the base writes W makes the LoRA nearly free. Two families: diffusers' GGUFLinear
(fdlora.layers.quant.gguf, the first; it uses this module's rule, gate and kept launch) and torchao's weight-only
tensors, here. torchao 0.18, for a float activation and no activation quantization (`act_quant_kwargs` and
`act_pre_scale` None):
- Int8Tensor, per-row or per-tensor scale: `mm(x, qdata.t().to(x.dtype)) * scale.to(x.dtype)`, then `+= bias`: the
  whole int8 weight converted per call, then a pass over y for the scale and one for the bias; per-group scales:
  `dequantize().to(x.dtype)` then the mm;
- Float8Tensor: `matmul(x, dequantize())` (qdata in fp32 times the scale, cast to the weight's dtype), then `+ bias`.
On full-size Flux-dev on an H100 base + delta was 1.160x (int8) / 1.115x (float8) the torchao base step for one
adapter (target 1.10). Here, per blend call:
- int8 / float8 with a per-row or per-tensor scale and the Triton backend: one kernel reads q and the scale and writes
  W' with the LoRA added (fdlora.kernels.triton.merge.dequant_merge), replacing torchao's conversion (and, for int8, its
  scale and bias passes over y: F.linear adds the bias in the GEMM): always taken;
- anything else (per-group or block scales, float8 on a GPU older than sm89, no Triton: the torch and cuda backends,
  CPU): torchao's own `dequantize(x.dtype)`, then one in-place addmm_ of the blend, only where it moves fewer bytes
  than the delta (`merge_pays`), else the regular path.
Numerics: W' is rounded once to x's dtype from an fp32 sum (dequant_merge's docstring); torchao's int8 linear rounds
x @ q, then the product with the scale: the outputs differ by the compute dtype's rounding.

When (`forward`, from FusedLoraLinear.forward, blend mode only; `eager_blend` is the shared gate): an eager call (not
compiling, not frozen, not being captured in a CUDA graph, no autograd through x or the bank) with some adapter
active, no lora bias in the bank (DoRA slots never get here: fdlora.layers.modules.dora serves them), on a base that no
hook manages (accelerate's `_hf_hook`, diffusers' `_diffusers_hook`, module forward hooks) and that is not offloaded
(fdlora.layers.storage.offload); here also a plain nn.Linear (a subclass may compute otherwise) and x in the weight's
dtype and on its device. Per-sample and per-row calls, and anything else, take the regular paths. Nothing is kept: the
merged-weight cache never holds a dequantized copy (fdlora.layers.quant.quantized says why).

torchao is never imported here: its tensors are recognized by type name (fdlora.layers.quant.quantized) and read through
their fields (qdata, scale, block_size) and their own `dequantize`.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fdlora.layers.quant import quantized
from fdlora.layers.state import Mode

KERNEL = "fused-dequant-merge"  # the base's dequantization and the merge in one Triton kernel
TORCH = "torch-dequant-merge"  # the base's own dequantization + addmm_
DELTA = "base+delta"  # the merge would move more bytes than the delta: the regular path
TRITON = ("triton", "triton+cuda")  # backends whose layers may launch Triton kernels
_TORCHAO = ("Int8Tensor", "Float8Tensor")  # weight-only tensors whose linear dequantizes per call (module docstring)


class Route(NamedTuple):
    """How a layer's blend calls merge into its base's per-call W: `how` (KERNEL or TORCH) and the module whose
    `forward(layer, x)` does it (looked up per call, so a test may patch it). FusedLoraLinear keeps it as `_dequant`."""

    how: str
    family: object


def route(layer) -> Route | None:
    """The route of a layer over a torchao weight-only Int8Tensor / Float8Tensor (module docstring), else None.
    Also drops the layer's kept launch: select_backend runs whenever the weight object, the device or the bank
    changed."""
    layer.__dict__.pop("_dequant_kept", None)
    base = layer.base
    w = base._parameters.get("weight")
    if type(base) is not nn.Linear or not (quantized.kind(base) or "").startswith("torchao "):
        return None
    if (type(w).__name__ not in _TORCHAO or getattr(w, "act_quant_kwargs", None) is not None
            or getattr(w, "act_pre_scale", None) is not None or getattr(w, "qdata", None) is None
            or w.qdata.dim() != 2):
        return None  # dynamic activation quantization (an int8 / float8 GEMM: no W), or a layout read otherwise
    return Route(KERNEL if _kernel_fits(layer, w) else TORCH, sys.modules[__name__])


def _kernel_fits(layer, w) -> bool:
    """The Triton kernel reads this weight: a Triton backend, int8 / float8 values, one scale per row or one for the
    tensor (torchao's non-group path), float8 only where Triton converts it (sm89+, or the interpreter). Int8 zero
    points are not read: weight-only int8 is symmetric (all zero), and torchao's own linear ignores them too."""
    from fdlora.kernels.triton.merge import dequant_merge

    q, s = w.qdata, w.scale
    N, K = q.shape
    if layer.selection.name not in TRITON or q.dtype not in dequant_merge.QDTYPES or s.numel() not in (N, 1):
        return False
    if list(getattr(w, "block_size", ())) not in ([1, K], [N, K]):
        return False
    return q.dtype == torch.int8 or not q.is_cuda or torch.cuda.get_device_capability(q.device) >= (8, 9)


def merge_pays(M: int, N: int, K: int) -> bool:
    """Whether merging the blend into W (read and write N*K) moves fewer elements than the delta (read x, M*K; read
    and write y, 2*M*N). Large M (diffusion images) merges; text streams and decode keep the delta."""
    return 2 * N * K < M * K + 2 * M * N


def eager_blend(layer, x: torch.Tensor) -> bool:
    """The gate every family shares (module docstring): this is an eager blend call with something active that may
    run on a transient W'."""
    st, base, bank = layer.state, layer.base, layer.bank
    bd = base.__dict__
    return not (st.mode is not Mode.BLEND or st.static or torch.compiler.is_compiling() or not st.active
                or layer.__dict__.get("offloaded") or bd.get("_hf_hook") is not None
                or bd.get("_diffusers_hook") is not None or base._forward_hooks or base._forward_pre_hooks
                or bank._buffers["bias"] is not None
                or (torch.is_grad_enabled() and (x.requires_grad or bank.A.requires_grad or bank.B.requires_grad))
                or (x.is_cuda and torch._C._cuda_isCurrentStreamCapturing()))


def forward(layer, x: torch.Tensor) -> torch.Tensor | None:
    """The layer's output on W' for a blend call over a torchao weight, or None when this call takes the regular
    path. The path a blend call took is noted as `layer.merge_path` (benchmarks and tests read it)."""
    base = layer.base
    w = base._parameters.get("weight")
    if w is None or not eager_blend(layer, x) or x.dtype != w.dtype:
        return None  # (torchao's float8 matmul needs x in the weight's dtype; int8 follows x: one rule for both)
    q, A = w.qdata, layer.bank._buffers["A"]
    if x.device != q.device or A.device != q.device:
        return None
    K, N = layer.in_features, layer.out_features
    if layer._dequant.how == KERNEL:
        W = _kernel_merged(layer, w, A, x.dtype)
        layer.__dict__["merge_path"] = KERNEL
    elif merge_pays(x.numel() // K, N, K):
        W = blend_addmm(layer, w.dequantize(x.dtype), q)
        layer.__dict__["merge_path"] = TORCH
    else:
        layer.__dict__["merge_path"] = DELTA
        return None
    bias = base._parameters.get("bias")
    return F.linear(x, W, None if bias is None else bias.to(x.dtype))


def _kernel_merged(layer, w, A: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W' by dequant_merge (kernel_merged)."""
    from fdlora.kernels.triton.merge import dequant_merge

    return kernel_merged(layer, (w.qdata, w.scale), A, dtype, dequant_merge.dequant_merge)


def kernel_merged(layer, weight: tuple, A: torch.Tensor, dtype: torch.dtype, merge) -> torch.Tensor:
    """W' by a dequant-merge kernel, `merge(*weight, A, B, scale, group_weight, ranks, dtype, out=, keep=True)`
    (fdlora.kernels.triton.merge.dequant_merge / gguf_merge), replayed from the launch kept for this layer while the
    weight's tensors, the bank and the scale table stay where they were."""
    bank = layer.bank
    S = bank.slots
    B, ranks, scale, gw = bank._buffers["B"], bank._buffers["ranks"], layer.scale_blend[:S], layer.blend_weight[:, :S]
    dev = weight[0].device
    key = (*(t.data_ptr() for t in weight), A.data_ptr(), B.data_ptr(), ranks.data_ptr(), scale.data_ptr(),
           gw.data_ptr(), dtype, dev)
    return kept(layer, key, torch.empty(layer.out_features, layer.in_features, dtype=dtype, device=dev),
                lambda out: merge(*weight, A, B, scale, gw, ranks, dtype, out=out, keep=True))


def blend_addmm(layer, W: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """W += the blend, in one addmm_ over the live slots' ranks side by side (inactive slots have scale 0; the bank's
    rank padding is zeros). W is written in place: a W that shares memory with `stored` (the base's quantized
    values: a dequantization may return them as they are) is copied first."""
    if W.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr():
        W = W.clone()
    bank = layer.bank
    S, R = bank.extent()
    K, dtype = W.shape[1], W.dtype
    A = bank.A[:S, :R].reshape(S * R, K)
    B = (bank.B[:, :S, :R].float() * layer.scale_blend[:S, None]).reshape(-1, S * R)
    return W.addmm_(B.to(dtype), A.to(dtype))


class Kept:
    """A layer's kept kernel launch and the addresses it was made for. Derived state: copies and pickles start
    without one (it holds the weight's bytes and the bank, which a copy must not duplicate)."""

    __slots__ = ("key", "ready")

    def __init__(self) -> None:
        self.key = self.ready = None

    def __deepcopy__(self, memo) -> Kept:
        return Kept()

    def __reduce__(self):
        return Kept, ()


def kept(layer, key: tuple, out: torch.Tensor, launch) -> torch.Tensor:
    """`out` written by the launch `layer` kept for `key` (its tensors' addresses; the route drops it when shapes may
    change), else by `launch(out)` -> (out, the launch kept ready or None), which is kept for the next call. A kept
    launch costs a fraction of the host time of a fresh one (operand checks, Triton's binder: ~13 us instead of ~35
    on an H100 host), which is more than the kernel runs at Flux's 3072^2."""
    k = layer.__dict__.get("_dequant_kept")
    if k is not None and k.key == key and k.ready is not None and k.ready(out):
        return out
    k = layer.__dict__["_dequant_kept"] = Kept()
    _, k.ready = launch(out)
    k.key = key
    return out
