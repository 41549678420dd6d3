"""A PEFT adapter's state dict + LoraConfig -> a canonical LoraAdapter for one model (plus module copies).

Keys are PEFT's saved layout: ``base_model.model.<path>.lora_A.weight`` / ``.lora_B.weight`` /
``.lora_B.bias`` (the adapter name removed; a name segment ``lora_A.<name>.weight`` is accepted too),
and full state dicts of `modules_to_save` modules under ``base_model.model.<path>.``. Which of the
file's modules get LoRA, and at what scale, is decided by `peft_config` exactly as PEFT decides it;
file modules this model lacks are an error naming them (an adapter for another architecture).
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import FormatError, TargetError, UnsupportedFeatureError
from ..hub.adapter import LoraAdapter, ModuleLora, Provenance
from ..layers.fused import _FusedLora
from .peft_config import (
    _wrapped_children,
    base_of,
    check_supported,
    check_wrappable,
    modules_to_save_names,
    peft_targets,
    rank_alpha,
)

PREFIX = "base_model.model."
LORA_KEY = re.compile(r"^(?P<path>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.(?P<param>weight|bias)$")
UNSUPPORTED_KEYS = {"lora_magnitude_vector": "DoRA (lora_magnitude_vector)",
                    "lora_embedding_": "LoRA on embeddings (lora_embedding_A/B)",
                    "trainable_tokens": "trainable tokens"}


@dataclass
class PeftLoad:
    """What one PEFT adapter becomes for one model."""

    adapter: LoraAdapter
    config: object  # the LoraConfig, kept to write the adapter back unchanged (save_peft)
    saved: dict[str, nn.Module] = field(default_factory=dict)  # modules_to_save path -> full copy


def strip_prefix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if tensors and all(k.startswith(PREFIX) for k in tensors):
        return {k[len(PREFIX):]: v for k, v in tensors.items()}
    return dict(tensors)


def _has_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def adapter_from_state(model: nn.Module, config: object, tensors: dict[str, torch.Tensor], name: str,
                       provenance: Provenance | None = None) -> PeftLoad:
    """Validate a PEFT adapter against `model` and convert it; nothing in the model changes here."""
    what = f"adapter {name!r}"
    check_supported(config, what)
    tensors = strip_prefix(tensors)
    for key in tensors:
        for marker, feature in UNSUPPORTED_KEYS.items():
            if marker in key:
                raise UnsupportedFeatureError(
                    f"{what} has {feature} weights (e.g. {key!r}), which fd-lora does not implement. "
                    "Serve it with PEFT, or merge it into the base model with PEFT's merge_and_unload()."
                )
    parts: dict[str, dict[str, torch.Tensor]] = {}
    rest: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        m = LORA_KEY.match(key)
        if m is None:
            rest[key] = t
        else:
            parts.setdefault(m["path"], {})[f"{m['ab']}.{m['param']}"] = t
    missing = [p for p in parts if not _has_module(model, p)]
    if missing:
        raise TargetError(
            f"{what} has LoRA weights for {len(missing)} of its {len(parts)} modules that this "
            f"{type(model).__name__} does not have (e.g. {missing[:4]}); it was made for another architecture "
            f"(base_model_name_or_path={getattr(config, 'base_model_name_or_path', None)!r}). Load it into that model."
        )
    targeted = set(peft_targets(model, config))
    untargeted = sorted(p for p in parts if p not in targeted)
    if untargeted:
        warnings.warn(f"{what}: the file has LoRA weights for {untargeted[:4]} (+{max(0, len(untargeted) - 4)}), "
                      "which its LoraConfig does not target; PEFT ignores them, and so does fd-lora.", stacklevel=3)
    paths = [p for p in parts if p in targeted]
    if parts and not paths:
        raise TargetError(f"{what}: none of its {len(parts)} LoRA modules is targeted by its own LoraConfig "
                          f"(target_modules={config.target_modules!r}); adapter_config.json does not fit the weights.")
    check_wrappable(model, paths, what)
    with_bias = bool(getattr(config, "lora_bias", False))
    stray = [p for p in paths if "B.bias" in parts[p]] if not with_bias else []
    if stray:
        warnings.warn(f"{what}: the file has lora_B.bias for {stray[:4]} (+{max(0, len(stray) - 4)}), but its "
                      "LoraConfig has lora_bias=False; PEFT ignores them, and so does fd-lora.", stacklevel=3)
    modules = {}
    for path in paths:
        w = parts[path]
        if "A.weight" not in w or "B.weight" not in w:
            raise FormatError(f"{what}: {path} has {sorted(w)} but a LoRA needs both lora_A.weight and lora_B.weight.")
        r, alpha = rank_alpha(config, path)
        if w["A.weight"].shape[0] != r:
            raise FormatError(
                f"{what}: {path} has rank {w['A.weight'].shape[0]} in the weights but {r} in its LoraConfig "
                "(r / rank_pattern); the adapter_config.json does not belong to these weights."
            )
        modules[path] = ModuleLora(w["A.weight"], w["B.weight"], alpha, w.get("B.bias") if with_bias else None)
    saved = _saved_modules(model, config, rest, what)
    if not modules:
        raise FormatError(f"{what} has no LoRA weights (keys: {list(tensors)[:4]}); fd-lora serves LoRA adapters.")
    adapter = LoraAdapter(modules, use_rslora=bool(config.use_rslora), name=name,
                          provenance=provenance or Provenance(format="peft"))
    return PeftLoad(adapter, config, saved)


def _saved_modules(model: nn.Module, config: object, rest: dict[str, torch.Tensor], what: str) -> dict[str, nn.Module]:
    """Full copies of the modules_to_save modules, loaded with the file's weights (the original stays)."""
    from .saved_modules import SavedModules

    names = modules_to_save_names(config)
    inside = tuple(_wrapped_children(model))
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
    _check_trained_biases(model, config, rest, what)
    return saved


def _check_trained_biases(model: nn.Module, config: object, rest: dict[str, torch.Tensor], what: str) -> None:
    """bias='all' / 'lora_only' files carry base biases: harmless if unchanged, unsupported if trained."""
    changed, unknown = [], []
    for key, t in rest.items():
        path, _, param = key.rpartition(".")
        path = path.removesuffix(".base_layer")  # biases of LoRA-wrapped layers are saved under base_layer
        if param == "bias" and _has_module(model, path):
            current = getattr(base_of(model.get_submodule(path)), "bias", None)
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
