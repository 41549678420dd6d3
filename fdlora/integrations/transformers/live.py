"""The read step of a live PEFT model: its LoraLayers and ModulesToSaveWrappers -> `PeftLoad`s, nothing changed.

    adapter = adapter_from_peft(peft_model, "name")      # one adapter as a LoraAdapter
    live = read_live(peft_model)                         # every adapter + active set, for from_peft

`read_live` reads every adapter out of every LoraLayer (weights, r, lora_alpha, rsLoRA, lora_bias,
the scale PEFT applies now) and every ModulesToSaveWrapper, and the PEFT modules to put back; the
attach step (`attach.attach_live`) swaps them and loads the adapters, so a refusal here leaves the
PEFT model as it was.

Scales: PEFT's current scale of a layer is (alpha / r or alpha / sqrt(r)) * w, where w comes from
`set_scale` (diffusers' set_adapters weights, component and block dicts included). The adapters keep
their own alpha; w is a weight, never part of the adapter: the w of each active adapter becomes its
fd-lora blend weight (one number when every layer has the same, else per layer: `LayerWeights`), and an
inactive adapter's last w is dropped (diffusers and PEFT set it again when they activate it). So blends
compute what PEFT computed, and a later `fdlora.set_adapters(names, weights)` means what diffusers' and
PEFT's `set_adapters(names, weights)` mean: weight * alpha / r. Per-sample calls (adapter_names) run
each adapter at alpha / r, as fd-lora's per-sample calls always do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fdlora.errors import FdLoraError, FormatError, UnsupportedFeatureError
from fdlora.hub.adapter import LoraAdapter, ModuleLora, Provenance
from fdlora.integrations.transformers import params
from fdlora.integrations.transformers.convert import PeftLoad
from fdlora.layers import registry_of_models
from fdlora.layers.modules.fused import check_fits, spec_of


@dataclass
class _Live:
    modules: dict[str, ModuleLora] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)  # path -> PEFT's current scale / alpha-over-r (its w)
    rslora: bool = False
    saved: dict[str, nn.Module] = field(default_factory=dict)


def peft_root(model: nn.Module) -> nn.Module:
    """The wrapped base model inside a PeftModel / LoraModel (module paths are relative to it)."""
    return root_and_configs(model)[0]


def root_and_configs(model: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
    """(the model whose module paths the adapters use, the PEFT configs by adapter name)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraModel

    configs = dict(getattr(model, "peft_config", None) or {})
    if isinstance(model, PeftModel):
        model = model.base_model
    if isinstance(model, LoraModel):
        configs = configs or dict(model.peft_config)
        model = model.model
    return model, configs


def adapter_from_peft(model: nn.Module, adapter_name: str = "default") -> LoraAdapter:
    """A `LoraAdapter` with the exact weights and scaling of `adapter_name` in a PEFT model.

    PEFT's scale at weight 1 (alpha/r, alpha/sqrt(r) for rsLoRA) is kept exactly by storing alpha = that scale
    * r; a weight set on the layers (`set_scale`, diffusers' set_adapters) is not part of the adapter.
    """
    from peft.tuners.lora import LoraLayer

    modules: dict[str, ModuleLora] = {}
    for outer, module in peft_root(model).named_modules():
        if not isinstance(module, LoraLayer) or outer.endswith(params.BASE_LAYER):
            continue  # (an inner ParamWrapper is read with its outermost one)
        for path, layer in params.wrappers(outer, module):
            if adapter_name not in layer.lora_A:
                continue
            B_mod = layer.lora_B[adapter_name]
            bias = B_mod.bias.detach() if getattr(B_mod, "bias", None) is not None else None
            r = int(layer.r[adapter_name])
            modules[path] = params.module_lora(path, layer, adapter_name, _unit(layer, adapter_name) * r,
                                               bias, _magnitude(layer, adapter_name), f"adapter {adapter_name!r}")
    if not modules:
        raise FormatError(f"the PEFT model holds no LoRA adapter named {adapter_name!r}.")
    return LoraAdapter(modules, name=adapter_name, provenance=Provenance(source="<peft model>", format="peft-live"))


def _unit(layer: nn.Module, name: str) -> float:
    """PEFT's scale of adapter `name` in `layer` at weight 1: alpha / r, or alpha / sqrt(r) for rsLoRA."""
    r, alpha = int(layer.r[name]), float(layer.lora_alpha[name])
    return alpha / (math.sqrt(r) if layer.use_rslora.get(name, False) else r)


def _magnitude(layer: nn.Module, name: str):
    """DoRA's magnitude vector m [N] of adapter `name` in a PEFT LoraLayer, or None (fdlora.layers.modules.dora
    serves it)."""
    if not layer.use_dora.get(name, False):
        return None
    return layer.lora_magnitude_vector[name].weight.detach().reshape(-1)


@dataclass
class LiveRead:
    """Everything a live PEFT model holds, read out: what the attach step needs, nothing else."""

    root: nn.Module  # the model whose module paths the adapters use (inside any PeftModel wrapper)
    loads: list[tuple[str, PeftLoad]]  # (adapter name, its load), every adapter
    weights: dict[str, Weight]  # active adapter -> its fd-lora blend weight
    disabled: bool  # PEFT's disable_adapters flag
    originals: dict[str, nn.Module]  # path of a PEFT wrapper -> the module to put back


def _read_layer(path: str, layer: nn.Module, adapters: dict[str, _Live]) -> None:
    if getattr(layer, "merged_adapters", None):
        raise FdLoraError(f"{path}: adapters {layer.merged_adapters} are merged into the base weights; call "
                          "peft_model.unmerge_adapter() first, then convert.")
    if len(getattr(layer, "lora_embedding_A", {})):
        raise UnsupportedFeatureError(f"{path}: LoRA on embeddings (lora_embedding_A/B) is not implemented by "
                                      "fd-lora; merge that adapter with PEFT instead.")
    base = layer.get_base_layer()
    spec = spec_of(base) if not params.is_param_wrapper(layer) else None  # (ParamWrapper: .params checks)
    for name in layer.lora_A:
        what = f"adapter {name!r}"
        variant = getattr(layer, "lora_variant", {}).get(name)
        if variant is not None and not type(variant).__name__.startswith("Dora"):  # DoRA: fdlora.layers.modules.dora
            raise UnsupportedFeatureError(f"{path}: {what} is a {type(variant).__name__} LoRA variant, which "
                                          "fd-lora does not implement; serve it with PEFT.")
        if spec is None and not params.is_param_wrapper(layer):
            raise UnsupportedFeatureError(f"{path}: {what} puts LoRA on a {type(base).__name__} "
                                          f"({type(layer).__name__}); fd-lora serves Linear, Conv1D, Conv2d, MoE "
                                          "routers and fused expert parameters.")
        b_mod = layer.lora_B[name]
        alpha = float(layer.lora_alpha[name])
        rs = bool(layer.use_rslora.get(name, False))
        bias = b_mod.bias.detach() if getattr(layer, "lora_bias", {}).get(name) and b_mod.bias is not None else None
        m = params.module_lora(path, layer, name, alpha, bias, _magnitude(layer, name), what)
        if spec is not None:
            check_fits(spec, m, path, what)
        live = adapters.setdefault(name, _Live(rslora=rs))
        live.modules[path] = m
        live.ratios[path] = float(layer.scaling[name]) / _unit(layer, name)


def _read(root: nn.Module) -> tuple[dict[str, _Live], list[str], bool, dict[str, nn.Module]]:
    """(adapters, active names, disabled, PEFT modules to put back {path: original}), nothing changed."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    adapters: dict[str, _Live] = {}
    active: list[str] = []
    disabled = False
    originals: dict[str, nn.Module] = {}
    for path, module in root.named_modules():
        if any(path.startswith(p + ".") for p in originals):
            continue
        if isinstance(module, LoraLayer):
            for fd_path, layer in params.wrappers(path, module):  # nested ParamWrappers: one per parameter
                _read_layer(fd_path, layer, adapters)
            originals[path] = module.get_base_layer()
        elif isinstance(module, ModulesToSaveWrapper):
            for name, copy in module.modules_to_save.items():
                adapters.setdefault(name, _Live()).saved[path] = copy
            originals[path] = module.original_module
        elif isinstance(module, (AuxiliaryTrainingWrapper, BaseTunerLayer)):
            raise UnsupportedFeatureError(f"{path}: {type(module).__name__} (a non-LoRA PEFT layer) is not "
                                          "implemented by fd-lora; serve this model with PEFT.")
        else:
            continue
        active += [a for a in module.active_adapters if a not in active]
        disabled = disabled or bool(module.disable_adapters)
    if not originals:
        raise FdLoraError(f"{type(root).__name__} holds no PEFT LoRA layers; nothing to convert. Load adapters "
                          "with fdlora.load_fd_lora(model, source) instead.")
    for name, live in adapters.items():
        if not live.modules:
            raise UnsupportedFeatureError(f"adapter {name!r} has only modules_to_save copies and no LoRA weights; "
                                          "fd-lora serves LoRA adapters.")
    return adapters, active, disabled, originals


class LayerWeights(dict):
    """Block-wise blend weights read off PEFT layers: layer path -> weight, called with a layer's path by
    `set_adapters` (fdlora.layers.model.activation); 1.0 for layers the adapter does not touch (their scale is 0)."""

    def __call__(self, path: str) -> float:
        return self.get(path, 1.0)


Weight = float | LayerWeights


def _weights(adapters: dict[str, _Live], active: list[str]) -> dict[str, Weight]:
    """The fd-lora blend weight of each active adapter: its PEFT w, one number when every layer has the same, else
    per layer (see the module docstring). Inactive adapters' w are not kept."""
    weights: dict[str, Weight] = {}
    for name in active:
        live = adapters.get(name)
        if live is None:
            continue
        ratios = set(live.ratios.values())
        weights[name] = ratios.pop() if len(ratios) == 1 else LayerWeights(live.ratios)
    return weights


def read_live(model: nn.Module) -> LiveRead:
    """Read every PEFT adapter of `model` (a PeftModel, LoraModel or a model with PEFT layers; see the module
    docstring); raises before anything changes."""
    root, configs = root_and_configs(model)
    if root in registry_of_models:
        raise FdLoraError(f"{type(root).__name__} already has fd-lora layers; convert before loading fd-lora adapters.")
    adapters, active, disabled, originals = _read(root)
    weights = _weights(adapters, active)
    loads = [(n, PeftLoad(LoraAdapter(lv.modules, lv.rslora, n, Provenance("<peft model>", format="peft-live")),
                          configs.get(n), lv.saved)) for n, lv in adapters.items()]
    return LiveRead(root, loads, weights, disabled, originals)
