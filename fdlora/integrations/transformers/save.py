"""Write an fd-lora adapter in PEFT's layout, merge adapters into a plain model, or unload everything.

These work on the module that holds the fused layers and leave its class alone: the public
`save_peft` / `merge_and_unload` / `unload` (fdlora.integrations.transformers.model) unwrap a compiled
model first and switch the instance back to its own class after, so this module never needs the
model API (and the model API imports it, one way).

`write_peft` writes adapter_config.json + adapter_model.safetensors that `PeftModel.from_pretrained`
loads back unchanged: the LoraConfig the adapter came with (from a PEFT folder or a live PEFT model)
when there is one, else one written from the banks (exact module list as target_modules, per-module
rank_pattern / alpha_pattern holding each module's scale). Weights are read back from the banks, so
the file is what fd-lora serves, in the bank dtype; keys are ``base_model.model.<path>.lora_A.weight``
etc., and modules_to_save copies are written as full state dicts, as PEFT does.

`merge` bakes adapters into the base weights (delta computed in fp32, one cast). By
default it works in place like PEFT's: the original modules come back with merged weights and
fd-lora is gone. `copy=True` leaves the fd-lora model untouched and returns a merged deep copy
(twice the memory); everything but the merged weights is the same in both.
"""

from __future__ import annotations

import copy as copy_module
import os
from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from fdlora.errors import FdLoraError, SaveError, UnsupportedFeatureError
from fdlora.integrations.fuse import delta_weight
from fdlora.integrations.transformers import params, saved_modules
from fdlora.integrations.transformers.convert import PREFIX
from fdlora.integrations.transformers.loraconfig import for_transformers
from fdlora.layers import registry_of_models
from fdlora.layers.modules import moe_experts as experts
from fdlora.layers.modules import moe_routed as routed
from fdlora.layers.modules.fused import _is_conv1d
from fdlora.layers.modules.moe_router import is_router
from fdlora.layers.quant import quantized
from fdlora.runtime.session import session_of


def _handle(model: nn.Module):
    h = registry_of_models.get(model)
    if h is None:
        raise FdLoraError(f"{type(model).__name__} has no fd-lora adapters; load one with fdlora.load_fd_lora first.")
    return h


def _module_weights(h, slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float]]:
    """path -> (A, B, bias or None, scale) of one slot, as PEFT shapes them."""
    out = {}
    for path, layer in h.layers.items():
        b = layer.bank
        if not b.used[slot]:
            continue
        r = int(b.ranks[slot])
        if layer.kind == "experts":  # A [E, r, K], B [E, N, r] (fdlora.layers.modules.moe_experts)
            out[path] = (b.A[:, slot, :r], b.B[:, :, slot, :r], None, float(h.state.table.scaling[layer.index, slot]))
            continue
        A = b.A[slot, :r]
        B = b.B[:, slot, :r]
        if A.dim() == 4:
            B = B.reshape(*B.shape, 1, 1)
        bias = b.bias[slot] if b.bias is not None else None
        out[path] = (A, B, bias, float(h.state.table.scaling[layer.index, slot]))
    return out


def _peft_target(layer) -> tuple[str, bool]:
    """(PEFT's name for what `layer` adapts, whether it is a target_parameters entry): fused expert parameters
    ("<experts>.<param>") and routers ("<router>.weight") are parameter targets, other layers target_modules."""
    if layer.kind == "experts":
        return layer.path, True
    if is_router(layer.base):
        return f"{layer.path}.weight", True
    return layer.path, False


def _config_from_banks(model: nn.Module, h, weights, saved_paths: list[str]):
    """A LoraConfig that makes PEFT build exactly these modules with exactly these scales."""
    from peft import LoraConfig

    keys = {p: _peft_target(h.layers[p]) for p in weights}  # (PEFT's name for it, is it a parameter target)
    ranks = {keys[p][0]: int(A.shape[1 if A.dim() == 3 else 0]) for p, (A, _, _, _) in weights.items()}
    alphas = {keys[p][0]: s * ranks[keys[p][0]] for p, (_, _, _, s) in weights.items()}
    r0 = Counter(ranks.values()).most_common(1)[0][0]
    a0 = Counter(alphas.values()).most_common(1)[0][0]
    on_params = sorted(k for k, is_param in keys.values() if is_param)
    return LoraConfig(
        r=r0, lora_alpha=a0, target_modules=sorted(k for k, is_param in keys.values() if not is_param),
        target_parameters=on_params or None,
        rank_pattern={p: r for p, r in ranks.items() if r != r0},
        alpha_pattern={p: a for p, a in alphas.items() if a != a0},
        fan_in_fan_out=any(_is_conv1d(h.layers[p].base) for p in weights),
        lora_bias=any(b is not None and bool(b.any()) for (_, _, b, _) in weights.values()),
        modules_to_save=saved_paths or None,
        base_model_name_or_path=getattr(getattr(model, "config", None), "_name_or_path", None) or None,
        inference_mode=True,
    )


def write_peft(base: nn.Module, directory: str | os.PathLike, adapter_name: str = "default") -> str:
    """Write adapter `adapter_name` as a PEFT adapter folder; returns the directory."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    h = _handle(base)
    slot = h.state.slots.slot(adapter_name)
    session = session_of(base)
    weights = _module_weights(h, slot)
    saved = {p: sw.copies[adapter_name] for p, sw in session.saved.items() if adapter_name in sw.copies}
    config = copy_module.copy(session.configs.get(adapter_name) or _config_from_banks(base, h, weights, sorted(saved)))
    config.inference_mode = True  # what PeftModel.save_pretrained writes, also for configs taken from a live model
    if config.task_type is None and config.auto_mapping is None:  # AutoPeftModel finds the base class through it
        config.auto_mapping = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    with_bias = bool(getattr(config, "lora_bias", False))
    found = params.targeted_params(base, for_transformers(base, config))  # ParamWrapper nesting (.params)
    tensors = {}
    for path, (A, B, bias, _) in weights.items():
        key, A, B = params.to_peft(base, path, A, B, found)
        tensors[f"{PREFIX}{key}.lora_A.weight"] = A
        tensors[f"{PREFIX}{key}.lora_B.weight"] = B
        if with_bias:
            tensors[f"{PREFIX}{path}.lora_B.bias"] = bias if bias is not None else B.new_zeros(B.shape[0])
    for path, module in saved.items():
        tensors.update({f"{PREFIX}{path}.{k}": v for k, v in module.state_dict().items()})
    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        config.save_pretrained(directory)
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()},
                  os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    except (OSError, SafetensorError) as e:  # NotADirectoryError, PermissionError, a full disk: name the path
        why = f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"
        raise SaveError(f"could not save adapter {adapter_name!r} to {directory!r} ({why}); give a directory path "
                        "that is a folder or does not exist yet, and that you can write to.") from e
    return directory


def _merge_plan(base: nn.Module, h, names: Sequence[str]):
    """({path: (delta of the weight, delta of the bias or None)}, {saved path: module to keep}), checked."""
    st = h.state
    slot_w = torch.zeros(len(h.layers), st.slots.capacity)
    for n in names:
        w = st.active.get(n, 1.0)
        col = [float(w(p)) for p in h.layers] if callable(w) else float(w)
        slot_w[:, st.slots.slot(n)] = torch.as_tensor(col)
    scale = st.table.scaling * slot_w * st.table.multiplier  # [L, S]
    deltas = {}
    for path, layer in h.layers.items():
        s = scale[layer.index]
        if not bool(s.any()):
            continue
        if layer.kind == "experts":  # a fused expert parameter (fdlora.layers.modules.moe_experts)
            deltas[path] = (experts.delta_weight(layer, s), None)
            continue
        w = getattr(layer.base, "weight", None)
        if quantized.kind(layer.base) or not isinstance(w, torch.Tensor) or not w.is_floating_point():
            raise UnsupportedFeatureError(  # (torchao weights report a float dtype: fdlora.layers.quant.quantized)
                f"{path}: cannot merge into a {type(layer.base).__name__} (quantized or opaque weights: "
                f"{quantized.kind(layer.base) or 'not float'}) without "
                "dequantizing it; keep the adapter unmerged (fd-lora serves it at nearly base speed)."
            )
        db = None
        if layer.bank.bias is not None and bool((layer.bank.bias.float() * s[:, None].to(w.device)).any()):
            if getattr(layer.base, "bias", None) is None:
                raise UnsupportedFeatureError(f"{path}: the adapter has a lora bias but the base layer has no bias "
                                              "to merge it into.")
            db = (s.to(w.device)[:, None] * layer.bank.bias.float()).sum(0)
        deltas[path] = (delta_weight(layer, s), db)
    keep = {}
    for path, switch in session_of(base).saved.items():
        owners = [n for n in names if n in switch.copies]
        if len(owners) > 1:
            raise FdLoraError(f"{path}: adapters {owners} each have their own copy of this module; merge one of them.")
        keep[path] = switch.copies[owners[0]] if owners else switch.original
    return deltas, keep


def _apply(model: nn.Module, deltas) -> None:
    with torch.no_grad():
        for path, (dw, db) in deltas.items():
            target = experts.param_target(model, path)  # a fused expert parameter, else a module's weight
            m, name = (target[0], target[1]) if target is not None else (model.get_submodule(path), "weight")
            w = getattr(m, name)
            w.copy_((w.float() + dw.to(w.device)).to(w.dtype))
            if db is not None:
                m.bias.copy_((m.bias.float() + db.to(m.bias.device)).to(m.bias.dtype))


def merge(base: nn.Module, adapter_names: Sequence[str] | None = None, *, copy: bool = False) -> nn.Module:
    """`base` (or with copy=True a deep copy) without fd-lora layers, `adapter_names` merged in."""
    h = _handle(base)
    names = list(h.state.active) if adapter_names is None else [adapter_names] if isinstance(
        adapter_names, str) else list(adapter_names)
    deltas, keep = _merge_plan(base, h, names)
    if copy:
        memo = {id(layer): copy_module.deepcopy(layer.base) for layer in h.layers.values()
                if not isinstance(layer, experts.ExpertLora)}
        for m in base.modules():  # fd-lora's MoE wrappers: their original modules (the layers inside mapped above)
            if isinstance(m, experts.FusedLoraExperts):
                memo[id(m)] = copy_module.deepcopy(m.base)
            elif isinstance(m, routed.RoutedExperts):
                memo[id(m)] = copy_module.deepcopy(m.original, memo)
        memo.update({id(sw): copy_module.deepcopy(keep[p]) for p, sw in session_of(base).saved.items()})
        memo[id(h)] = None  # a registry that keeps the handle on the model must not copy it along
        out = copy_module.deepcopy(base, memo)
        registry_of_models.pop(out, None)
        _apply(out, deltas)
        return out
    session = session_of(base)
    saved_modules.unload(base, session)
    for path, module in keep.items():
        saved_modules._swap(base, path, module)
    h.restore()
    _apply(base, deltas)
    return base


def remove(base: nn.Module) -> nn.Module:
    """Every original module back, all adapters dropped; returns `base`."""
    h = _handle(base)
    saved_modules.unload(base, session_of(base))
    h.restore()
    return base

