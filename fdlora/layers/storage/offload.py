"""Offload awareness: fused layers under accelerate / diffusers offload hooks and device maps.

What those mechanisms do to a wrapped base module, and what a fused layer must do about it:

- accelerate's AlignDevicesHook with offload (diffusers' enable_sequential_cpu_offload, `cpu_offload`,
  `disk_offload`, a transformers device_map with "cpu"/"disk" entries) keeps the weights on the meta device
  between calls and loads them in a pre-forward hook (on the leaf module itself, or on a parent block with
  place_submodules); the loaded tensors are new objects on every call;
- diffusers' group offloading (block or leaf level, with or without streams) swaps `param.data` between the
  offload and the onload device around each block's call, without nn.Module.to;
- model offload (enable_model_cpu_offload) moves whole components with .to(), which a fused layer already
  follows (`_FusedLora._apply`).

So a layer whose base weight is meta, whose base carries a hook (`_hf_hook`, `_diffusers_hook`), or whose
tensors changed device or identity without passing through `_apply` is *offloaded*: it is never "plain" (no
merged-weight cache, so no GPU copy of W' outlives the call, no direct reads of `base.weight`: `base(x)` runs,
so the hooks load the weight), and its bank follows the device its inputs arrive on (moved once, kept there: a
bank is LoRA-sized; with offload_buffers=False accelerate keeps buffers on the execution device the same way).

The forward-time check (`stale`) is one device compare and one identity compare per call.
"""

from __future__ import annotations

import torch
from torch import nn


def hooked(module: nn.Module) -> str | None:
    """Why `module`'s weight is managed by an offload mechanism, or None. Hooks that only move inputs (accelerate's
    AlignDevicesHook without offload on a device_map's resident layers) and model offload (CpuOffload: whole
    components moved with .to(), which `_apply` follows) leave the layer plain."""
    w = module._parameters.get("weight") if isinstance(module._parameters, dict) else None
    if isinstance(w, torch.Tensor) and w.is_meta:
        return "its weight is on the meta device (offloaded)"
    hook = module.__dict__.get("_hf_hook")
    for h in getattr(hook, "hooks", None) or (hook,):
        if getattr(h, "offload", False) is True:
            return f"it carries an accelerate offload hook ({type(h).__name__})"
    registry = module.__dict__.get("_diffusers_hook")
    names = [str(k) for k in getattr(registry, "hooks", {})]
    if any("offload" in k for k in names):
        return f"it carries a diffusers offload hook ({', '.join(names)})"
    return None


def note(layer: nn.Module) -> None:
    """After select_backend: remember the devices and weight object this layer was set up with, and drop the
    plain (merged-cache, direct weight read) paths if the base is managed by an offload mechanism."""
    d = layer.__dict__
    reason = d.get("offloaded") or hooked(layer.base)
    d["offloaded"] = reason
    if reason:
        layer._plain = layer._whole = False
    bd, w = layer.base.__dict__, layer.base._parameters.get("weight")
    d["_seen"] = (layer.bank._buffers["A"].device, w, bd.get("_hf_hook"), bd.get("_diffusers_hook"),
                  w.device if isinstance(w, torch.Tensor) else None)


def stale(layer: nn.Module, x: torch.Tensor) -> bool:
    """The per-call check: did the input's device or the base weight object change since `note`, or did a hook
    arrive on the base (a few dict reads)?"""
    d = layer.__dict__
    seen, base = d["_seen"], d["base"]
    if x.device != seen[0] or base._parameters.get("weight") is not seen[1]:
        return True
    bd = base.__dict__
    return bd.get("_hf_hook") is not seen[2] or bd.get("_diffusers_hook") is not seen[3]


def follow(layer: nn.Module, device: torch.device) -> None:
    """Bring `layer` in line with a mechanism that moved or replaced tensors behind its back: the bank (and the scale
    views, backend and merged copy) onto `device`, where the layer executes. The layer is marked offloaded when its
    weight is meta, off `device`, under an offload hook, or the same object moved in place (diffusers' group
    offloading swaps `.data`); a weight replaced by a new resident tensor (accelerate's dispatch of a device_map's
    resident layers, or a user's reassignment) leaves it plain."""
    d = layer.__dict__
    w = layer.base._parameters.get("weight")
    A = layer.bank._buffers["A"]
    seen = d["_seen"]
    if device == seen[0] and A.device == device and d.get("offloaded"):
        d["_seen"] = (device, w, *seen[2:])  # a hook's per-call weight: nothing else to do
        return
    wdev = w.device if isinstance(w, torch.Tensor) else None
    swapped = w is seen[1] and wdev != seen[4]
    why = hooked(layer.base)
    if why is None and wdev is None:
        why = f"its tensors moved to {device} outside .to() and it has no weight to check (taken as offloaded)"
    elif why is None and (wdev != device or swapped):
        why = f"its weight moved to {wdev} in place, outside .to() (an offload hook)"
    if why is not None:
        d["offloaded"] = d.get("offloaded") or why
    if A.device != device:
        layer.bank.to(device)
    layer.release_merged()
    layer.rebind()
    layer.select_backend()  # calls note()


def offloaded_layers(model: nn.Module) -> dict[str, str]:
    """{path: why} for every fused layer of `model` that runs offloaded (so without the merged-weight cache)."""
    return {name: m.__dict__["offloaded"] for name, m in model.named_modules()
            if m.__dict__.get("offloaded")}


def home(base: nn.Module, device: torch.device) -> torch.device:
    """Where a new bank for `base` goes: its weight's device, or for an offloaded (meta) weight the hook's
    execution device, else the CPU (the bank then follows the first input, `follow`)."""
    if device.type != "meta":
        return device
    hook = getattr(base, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or (hook,):
        dev = getattr(h, "execution_device", None)
        if dev is not None:
            return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")
    return torch.device("cpu")


def current(layer: nn.Module) -> bool:
    """Whether the base weight is still the real tensor this layer was set up with (a model-wide re-merge must
    skip layers that a hook attached after wrapping has offloaded, before their own first call notices)."""
    w = layer.base._parameters.get("weight")
    return w is layer.__dict__["_seen"][1] and not w.is_meta
