"""Is a base layer's weight a plain float matrix, or quantized / low-precision-stored, and which kind?

Why: fd-lora's fast paths (the merged-weight cache, the fused base GEMM + LoRA kernel, per-prompt merged copies,
the decode path's direct GEMM) read the base weight W as a float matrix. That holds for a plain float nn.Linear,
transformers Conv1D or nn.Conv2d, and for nothing else:

- torchao weight-only quantization (int8, int4, float8) keeps the nn.Linear and swaps its weight for a tensor
  subclass (Int8Tensor, Int4*Tensor, Float8Tensor, AffineQuantizedTensor, ...) that reports the *original* float
  dtype, so `type(base) is nn.Linear` and `w.dtype` both look plain (the merged-weight cache then tried
  `empty_like` on an Int8Tensor and raised);
- diffusers' GGUF (GGUFLinear, a uint8 GGUFParameter) and bitsandbytes (Linear4bit / Linear8bitLt) replace the
  module class: opaque already;
- diffusers' `enable_layerwise_casting` keeps W in float8 and casts it up in a hook around the module's forward,
  so only `base(x)` sees the float weight; it may be enabled after fd-lora wrapped the layer (diffusers' own
  order: load the LoRA, then enable casting), which changes W's dtype under the layer.

Such bases run as `base(x)` (through the module and its hooks) + the LoRA delta, and no merged copy is made:
a dequantized W' would cost the memory the quantization saved. Fusing into them is refused (fdlora.integrations.fuse).
This module only looks at types and attributes; it imports neither torchao, gguf, bitsandbytes nor diffusers (a
frozen 4-bit bitsandbytes base under a trainable adapter is run by fdlora.layers.trainable.frozen_4bit).
"""

from __future__ import annotations

import torch
from torch import nn

_PLAIN_TYPES = (nn.Parameter, torch.Tensor)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                if hasattr(torch, n))


def casting_hook(module: nn.Module):
    """diffusers' layerwise-casting hook on `module` (storage_dtype / compute_dtype), or None."""
    registry = module.__dict__.get("_diffusers_hook")
    hooks = getattr(registry, "hooks", None)
    if not isinstance(hooks, dict):
        return None
    for hook in hooks.values():
        if isinstance(getattr(hook, "storage_dtype", None), torch.dtype) and isinstance(
                getattr(hook, "compute_dtype", None), torch.dtype):
            return hook
    return None


def kind(module: nn.Module) -> str | None:
    """What stores the base's weight, when it is not a plain float tensor: "torchao Int8Tensor", "gguf Q8_0",
    "bitsandbytes Linear4bit", "layerwise casting float8_e4m3fn -> float32", ...; None for a plain float weight."""
    if _plain_float(module):  # the common case, in a few dictionary reads (a load asks it of every layer)
        return None
    return _stored(module)


def _plain_float(module: nn.Module) -> bool:
    """A plain float weight in the module's parameters, no diffusers hook, no `weight` property on its class: what
    `_stored` answers None for, ~4 us a layer sooner (SDXL: 722 layers on every load); False: ask `_stored`."""
    d = module.__dict__
    w = d.get("_parameters", {}).get("weight")
    return (type(w) in _PLAIN_TYPES and w.dtype in _FLOATS and "_diffusers_hook" not in d
            and getattr(type(module), "weight", None) is None)


def _stored(module: nn.Module) -> str | None:
    """kind's full answer: hooks, the weight's type and dtype."""
    hook = casting_hook(module)
    if hook is not None:
        return f"layerwise casting {_name(hook.storage_dtype)} -> {_name(hook.compute_dtype)}"
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor):
        return None if w is None else f"opaque {type(module).__name__}"
    t = type(w)
    if t in _PLAIN_TYPES:
        if w.dtype in _FLOAT8:
            return f"{_name(w.dtype)} storage"
        return None if w.is_floating_point() else f"{_name(w.dtype)} weight of {type(module).__name__}"
    mod = t.__module__.split(".")[0]
    if mod == "torchao":
        return f"torchao {t.__name__}"
    if t.__name__ == "GGUFParameter":
        qt = getattr(w, "quant_type", None)
        return f"gguf {getattr(qt, 'name', qt)}"
    if mod == "bitsandbytes":
        return f"bitsandbytes {type(module).__name__}"
    return f"{mod} {t.__name__}"


def plain_weight(module: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `module.weight` is a plain float tensor in `dtype` on `device`, read directly by no hook: the
    merged-weight cache and the kernels that do the base GEMM themselves may use it."""
    w = getattr(module, "weight", None)
    return (type(w) in _PLAIN_TYPES and w.dtype == dtype and w.device == device and w.dtype not in _FLOAT8
            and casting_hook(module) is None)


def compute_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype a low-precision-stored base computes in (its casting hook's, or the module's `compute_dtype`,
    as GGUF and bitsandbytes layers keep it); None when the weight's own dtype is it."""
    hook = casting_hook(module)
    if hook is not None:
        return hook.compute_dtype
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and w.is_floating_point() and w.dtype not in _FLOAT8:
        return None
    dtype = getattr(module, "compute_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
