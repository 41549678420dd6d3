"""PEFT-layout LoRA weights + what their LoraConfig decides (`ConfigFacts`) -> a `PeftLoad` for one model.

The last part of the read step (`.read` parses the file, `.loraconfig` answers for the config):
every check against the model happens here, before anything changes, and nothing here asks the
config again. A `PeftLoad` is what the attach step (`.attach`) puts into the model.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from fdlora.errors import FormatError, TargetError, UnsupportedFeatureError
from fdlora.hub.adapter import LoraAdapter, ModuleLora, Provenance
from fdlora.integrations.transformers.loraconfig import ConfigFacts
from fdlora.integrations.transformers.saved_modules import SavedModules
from fdlora.layers.modules import moe_experts as experts
from fdlora.layers.modules.fused import _FusedLora, spec_of
from fdlora.layers.modules.moe_router import is_router

PREFIX = "base_model.model."  # PEFT's saved key prefix


@dataclass
class PeftLoad:
    """What one PEFT adapter becomes for one model."""

    adapter: LoraAdapter
    config: object  # the LoraConfig, kept to write the adapter back unchanged (save_peft)
    saved: dict[str, nn.Module] = field(default_factory=dict)  # modules_to_save path -> full copy


def to_load(model: nn.Module, cf: ConfigFacts, config: object, parts: dict[str, dict[str, torch.Tensor]],
            rest: dict[str, torch.Tensor], name: str, provenance: Provenance | None = None) -> PeftLoad:
    """`parts`: module path -> {"A.weight", "B.weight", "B.bias"}; `rest`: every other key (module copies, biases)."""
    what = f"adapter {name!r}"
    keys = [*parts, *rest]
    missing = [p for p in parts if not _has_module(model, p)]
    if missing:
        raise TargetError(
            f"{what} has LoRA weights for {len(missing)} of its {len(parts)} modules that this "
            f"{type(model).__name__} does not have (e.g. {missing[:4]}); it was made for another architecture "
            f"(base_model_name_or_path={getattr(config, 'base_model_name_or_path', None)!r}). Load it into that model."
        )
    targeted = set(cf.targets)
    untargeted = sorted(p for p in parts if p not in targeted)
    if untargeted:
        warnings.warn(f"{what}: the file has LoRA weights for {untargeted[:4]} (+{max(0, len(untargeted) - 4)}), "
                      "which its LoraConfig does not target; PEFT ignores them, and so does fd-lora.", stacklevel=4)
    paths = [p for p in parts if p in targeted]
    if parts and not paths:
        raise TargetError(f"{what}: none of its {len(parts)} LoRA modules is targeted by its own LoraConfig "
                          f"(target_modules={config.target_modules!r}); adapter_config.json does not fit the weights.")
    with_bias = cf.with_bias
    stray = [p for p in paths if "B.bias" in parts[p]] if not with_bias else []
    if stray:
        warnings.warn(f"{what}: the file has lora_B.bias for {stray[:4]} (+{max(0, len(stray) - 4)}), but its "
                      "LoraConfig has lora_bias=False; PEFT ignores them, and so does fd-lora.", stacklevel=4)
    modules = {}
    for path in paths:
        w = parts[path]
        if "A.weight" not in w or "B.weight" not in w:
            raise FormatError(f"{what}: {path} has {sorted(w)} but a LoRA needs both lora_A.weight and lora_B.weight.")
        r, alpha = cf.rank_alpha[path]
        rank = w["A.weight"].shape[1 if w["A.weight"].dim() == 3 else 0]  # (experts: A [E, r, K])
        if rank != r:
            raise FormatError(
                f"{what}: {path} has rank {rank} in the weights but {r} in its LoraConfig "
                "(r / rank_pattern); the adapter_config.json does not belong to these weights."
            )
        if bool(getattr(config, "use_dora", False)) != ("magnitude" in w):
            raise FormatError(f"{what}: {path} has {'no ' if 'magnitude' not in w else ''}DoRA magnitude vector "
                              f"(lora_magnitude_vector) but the LoraConfig says use_dora="
                              f"{bool(getattr(config, 'use_dora', False))}; the file and its adapter_config.json do "
                              "not belong together. Save the adapter again with PEFT.")
        modules[path] = ModuleLora(w["A.weight"], w["B.weight"], alpha, w.get("B.bias") if with_bias else None,
                                   magnitude=w.get("magnitude"))  # DoRA: fdlora.layers.modules.dora
    saved = _saved_modules(model, cf, rest, what)
    _check_trained_biases(model, config, rest, what)
    if not modules:
        raise FormatError(f"{what} has no LoRA weights (keys: {keys[:4]}); fd-lora serves LoRA adapters.")
    check_wrappable(model, paths, what)
    adapter = LoraAdapter(modules, use_rslora=cf.use_rslora, name=name,
                          provenance=provenance or Provenance(format="peft"))
    return PeftLoad(adapter, config, saved)


def _has_module(model: nn.Module, path: str) -> bool:
    """A module at `path`, or a fused expert parameter ("<experts>.<param>", fdlora.layers.modules.moe_experts)."""
    try:
        model.get_submodule(path)
    except AttributeError:
        return experts.param_target(model, path) is not None
    return True


def _saved_modules(model: nn.Module, cf: ConfigFacts, rest: dict[str, torch.Tensor], what: str,
                   ) -> dict[str, nn.Module]:
    """Full copies of the modules_to_save modules, loaded with the file's weights (the original stays)."""
    names, inside = cf.saved_names, cf.inside
    hits = sorted((p for p, _ in model.named_modules(remove_duplicate=False)
                   if p and not p.startswith(inside) and any(p.endswith(n) for n in names)), key=len)
    outer = [p for i, p in enumerate(hits) if not any(p.startswith(q + ".") for q in hits[:i])]
    saved = {}
    for path in outer:
        sub = {k[len(path) + 1:]: v for k, v in rest.items() if k.startswith(path + ".")}
        if not sub:
            continue
        module = model.get_submodule(path)
        if isinstance(module, _FusedLora):
            raise UnsupportedFeatureError(f"{what} saves a full copy of {path}, which already carries fd-lora LoRA "
                                          "layers of another adapter; PEFT does not allow this mix either.")
        original = module.original if isinstance(module, SavedModules) else module
        twin = copy.deepcopy(original)
        try:
            twin.load_state_dict(sub, strict=True)
        except RuntimeError as e:
            raise FormatError(f"{what}: modules_to_save weights for {path} do not fit it: {e}") from None
        saved[path] = twin.eval()
        for k in list(rest):
            if k.startswith(path + "."):
                del rest[k]
    return saved


def _check_trained_biases(model: nn.Module, config: object, rest: dict[str, torch.Tensor], what: str) -> None:
    """bias='all' / 'lora_only' files carry base biases: harmless if unchanged, unsupported if trained."""
    changed, unknown = [], []
    for key, t in rest.items():
        path, _, param = key.rpartition(".")
        path = path.removesuffix(".base_layer")  # biases of LoRA-wrapped layers are saved under base_layer
        if param == "bias" and _has_module(model, path):
            current = getattr(_base(model.get_submodule(path)), "bias", None)
            if current is None or not torch.equal(current.detach().cpu().to(t.dtype), t):
                changed.append(key)
        else:
            unknown.append(key)
    if unknown:
        raise FormatError(f"{what} has keys that are neither LoRA weights nor modules_to_save: {unknown[:5]} "
                          f"(+{max(0, len(unknown) - 5)}). Check modules_to_save in its adapter_config.json.")
    if changed:
        raise UnsupportedFeatureError(
            f"{what} was trained with bias={config.bias!r} and changes base-layer biases ({changed[:4]}); PEFT writes "
            "them into the base model for good. fd-lora keeps the base untouched and does not implement this: "
            "merge the adapter with PEFT (merge_and_unload) instead."
        )


def _base(module: nn.Module) -> nn.Module:
    """The module PEFT would see: a fused layer's base."""
    return module.base if isinstance(module, _FusedLora) else module


def check_wrappable(model: nn.Module, paths: list[str], what: str) -> None:
    """Raise naming every targeted module that fd-lora has no fused layer for."""
    bad = [f"{p} ({type(_base(model.get_submodule(p))).__name__})" for p in paths
           if experts.param_target(model, p) is None and spec_of(model.get_submodule(p)) is None
           and not is_router(_base(model.get_submodule(p)))]
    if bad:
        raise UnsupportedFeatureError(
            f"{what} puts LoRA on {bad[:6]}; fd-lora serves LoRA on Linear, transformers Conv1D, Conv2d, "
            "Linear-like (e.g. bitsandbytes) modules, MoE routers and fused expert parameters only. Serve this "
            "adapter with PEFT, or merge it with PEFT."
        )
