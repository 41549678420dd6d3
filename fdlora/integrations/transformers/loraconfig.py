"""PEFT's LoraConfig semantics, read once: which modules an adapter targets and at what scale.

Every field that changes the math is honoured the way PEFT applies it when it injects an adapter:

    target_modules   suffix list / full-match regex / "all-linear"   (peft_targets)
    exclude_modules, layers_to_transform, layers_pattern, modules_to_save (never LoRA-targeted)
    rank_pattern, alpha_pattern (PEFT's own `get_pattern_key`), use_rslora   (rank_alpha)
    fan_in_fan_out   transformers Conv1D keeps A [r, K], B [N, r]; only merging transposes
    lora_bias        lora_B.bias, scaled like the delta (the bank's bias)
    target_parameters  fused MoE expert parameters and router weights (PEFT's ParamWrapper; .params),
                     after PEFT's own transformers-5 config conversion ("all-linear" on Mixtral wraps them)

Variants fd-lora does not compute (those in UNSUPPORTED) raise before anything loads; DoRA loads
(fdlora.layers.modules.dora).

The read step (fdlora.integrations.transformers.read) asks this module once, through `facts`, and gets
back everything the config decides for one model as plain data (`ConfigFacts`): the load never
comes back here with per-module questions.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from fdlora.errors import FormatError, TargetError, UnsupportedFeatureError
from fdlora.integrations.transformers import params
from fdlora.integrations.transformers.saved_modules import SavedModules
from fdlora.layers.modules import moe_experts as experts
from fdlora.layers.modules.fused import _FusedLora

# LoraConfig fields fd-lora cannot serve: (field, is it in use?, what it is). getattr keeps older peft working.
UNSUPPORTED: list[tuple[str, Callable[[object], bool], str]] = [
    ("trainable_token_indices", bool, "trainable tokens (trainable_token_indices)"),
    ("layer_replication", bool, "layer replication"),
    ("alora_invocation_tokens", bool, "activated LoRA (aLoRA)"),
    ("use_qalora", bool, "QA-LoRA"),
    ("use_bdlora", bool, "BD-LoRA"),
    ("velora_config", bool, "VeLoRA"),
    ("monteclora_config", bool, "MonteCLoRA"),
    ("arrow_config", bool, "Arrow routing"),
    ("kasa_config", bool, "KaSA"),
]

# task types whose PeftModel adds its head to modules_to_save (peft_model.py)
TASK_HEADS = {"SEQ_CLS": ["classifier", "score"], "TOKEN_CLS": ["classifier", "score"], "QUESTION_ANS": ["qa_outputs"]}


def lora_config(config: object) -> object:
    """A LoraConfig from a PEFT config object or an adapter_config.json dict; anything else raises."""
    from peft import LoraConfig

    if isinstance(config, dict):
        kind = str(config.get("peft_type", "LORA")).upper()
        if kind != "LORA":
            raise FormatError(f"this is a PEFT {kind} adapter, not LoRA; fd-lora serves LoRA adapters only.")
        fields = set(LoraConfig.__dataclass_fields__)
        unknown = sorted(k for k, v in config.items() if k not in fields and v)
        if unknown:
            raise UnsupportedFeatureError(
                f"adapter_config.json sets {unknown}, which this peft ({_peft_version()}) does not know; "
                "upgrade peft (pip install -U peft) or drop those fields if they are defaults."
            )
        config = LoraConfig(**{k: v for k, v in config.items() if k in fields})
    kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", ""))).upper()
    if kind != "LORA":
        raise FormatError(f"this is a PEFT {kind or type(config).__name__} adapter, not LoRA; fd-lora serves LoRA.")
    return config


def _peft_version() -> str:
    import peft

    return peft.__version__


def check_supported(config: object, what: str) -> None:
    """Raise UnsupportedFeatureError naming the first LoRA variant in `config` that fd-lora cannot compute."""
    for field, in_use, name in UNSUPPORTED:
        if in_use(getattr(config, field, None)):
            raise UnsupportedFeatureError(
                f"{what} uses {name} ({field}={getattr(config, field)!r}), which fd-lora does not implement. "
                "Serve it with PEFT, or merge it into the base model with PEFT's merge_and_unload()."
            )


def rank_alpha(config: object, path: str) -> tuple[int, float]:
    """(r, lora_alpha) PEFT gives the module at `path` (rank_pattern / alpha_pattern win over r / lora_alpha)."""
    from peft.utils.other import get_pattern_key

    rp, ap = config.rank_pattern or {}, config.alpha_pattern or {}
    r = rp.get(get_pattern_key(rp.keys(), path), config.r)
    alpha = ap.get(get_pattern_key(ap.keys(), path), config.lora_alpha)
    return int(r), float(alpha)


def modules_to_save_names(config: object) -> list[str]:
    """modules_to_save plus the head PeftModel adds for classification / QA task types."""
    names = list(config.modules_to_save or [])
    return names + [n for n in TASK_HEADS.get(task_type(config), []) if n not in names]


def task_type(config: object) -> str:
    t = getattr(config, "task_type", None)
    return str(getattr(t, "value", t))


def base_of(module: nn.Module) -> nn.Module:
    """The module PEFT would see: a fused layer's base (fd-lora layers are transparent to targeting)."""
    return module.base if isinstance(module, _FusedLora) else module


def wrapped_children(model: nn.Module) -> list[str]:
    """Prefixes of the insides of fd-lora wrappers (fused banks, saved-module copies, fused experts): never targets."""
    return [p + "." for p, m in model.named_modules()
            if p and isinstance(m, (_FusedLora, SavedModules, experts.FusedLoraExperts))]


def _all_linear(model: nn.Module, config: object, inside: list[str]) -> set[str]:
    """PEFT's `_maybe_include_all_linear_layers`: every Linear / Conv1D except the output head."""
    from transformers import PreTrainedModel
    from transformers.pytorch_utils import Conv1D

    names = {p for p, m in model.named_modules()
             if p and not p.startswith(tuple(inside)) and isinstance(base_of(m), (nn.Linear, Conv1D))}
    if isinstance(model, PreTrainedModel):
        head = model.get_output_embeddings()
        heads = [head] if head is not None else []
        if not heads and task_type(config) == "SEQ_CLS":
            heads = [m for m in (getattr(model, n, None) for n in TASK_HEADS["SEQ_CLS"]) if m is not None][:1]
        names -= {p for p, m in model.named_modules() if any(m is h for h in heads)}
    return names


def peft_targets(model: nn.Module, config: object) -> list[str]:
    """Module paths PEFT would put this adapter's LoRA layers on (fused layers count as their base)."""
    return _targets(model, config, wrapped_children(model))


def _targets(model: nn.Module, config: object, inside: list[str]) -> list[str]:
    from peft.tuners.tuners_utils import check_target_module_exists

    cfg = copy.copy(config)
    cfg.modules_to_save = modules_to_save_names(config) or None
    if isinstance(cfg.target_modules, str) and cfg.target_modules.lower() == "all-linear":
        cfg.target_modules = _all_linear(model, config, inside)
    if cfg.target_modules is None:
        raise TargetError("the adapter config has no target_modules; fd-lora needs them to place the LoRA layers.")
    paths = []
    for path, _ in model.named_modules():
        if not path or path.startswith(tuple(inside)):
            continue
        hit = check_target_module_exists(cfg, path)
        if hit and type(hit).__name__ != "_ExcludedModule":
            paths.append(path)
    return paths


@dataclass
class ConfigFacts:
    """What a LoraConfig decides for one model, as data: all the read step needs from the config."""

    targets: list[str]  # module paths PEFT would put LoRA on
    rank_alpha: dict[str, tuple[int, float]]  # target path -> (r, lora_alpha) after rank/alpha patterns
    saved_names: list[str]  # modules_to_save suffixes (task heads included)
    inside: tuple[str, ...]  # prefixes of fd-lora wrappers' insides: never targets, never saved
    with_bias: bool  # lora_bias: lora_B.bias is part of the adapter
    use_rslora: bool
    params: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # module -> targeted parameters (.params)


def facts(model: nn.Module, config: object, what: str) -> ConfigFacts:
    """Check `config` is a LoRA fd-lora computes, then resolve it against `model` (nothing changes)."""
    check_supported(config, what)
    config = for_transformers(model, config)
    inside = wrapped_children(model)
    targets = [] if config.target_modules is None and config.target_parameters else _targets(model, config, inside)
    ranks = {p: rank_alpha(config, p) for p in targets}
    found = params.targeted_params(model, config)
    for module, names in found.items():
        for name in names:  # PEFT's key for a parameter's rank / alpha pattern is "<module>.<param>"
            path = params.fd_path(model, module, name)
            targets.append(path)
            ranks[path] = rank_alpha(config, f"{module}.{name}")
    return ConfigFacts(targets, ranks, modules_to_save_names(config), tuple(inside),
                       bool(getattr(config, "lora_bias", False)), bool(config.use_rslora), found)


def for_transformers(model: nn.Module, config: object) -> object:
    """A copy of `config` as PEFT rewrites it before injecting into a transformers-5 model (for Mixtral-like MoE
    models "all-linear" then also targets the router and the fused expert parameters: target_parameters)."""
    if not hasattr(getattr(model, "config", None), "model_type"):
        return config
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # an older peft / transformers: no conversion, as PEFT itself does then
        return config
    config = copy.deepcopy(config)
    convert_peft_config_for_transformers(config, model=model, conversions=get_model_conversion_mapping(model))
    return config
