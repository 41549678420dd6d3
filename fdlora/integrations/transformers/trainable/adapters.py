"""Trainable adapters on any torch model, from a `peft.LoraConfig`: add, list parameters, route per sample.

    fdlora.add_trainable_adapter(model, "style", LoraConfig(r=16, target_modules="all-linear"))
    opt = torch.optim.AdamW(fdlora.trainable_parameters(model), lr=1e-4)
    fdlora.lora_parameters(model, "style")   # {module path: (A [r, K], B [N, r])}, PEFT's lora_A / lora_B

Targets, ranks, alphas, rsLoRA and modules_to_save are resolved by the same code the PEFT loader uses
(fdlora.integrations.transformers.loraconfig), so an adapter trained here lands on exactly the modules PEFT would
put it on. The model is changed by swapping module instances (undo: `remove_trainable`); every parameter
that is not an adapter's A / B or a modules_to_save copy is frozen.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from fdlora.errors import (
    AdapterNameError,
    DuplicateAdapterError,
    TargetError,
    UnknownAdapterError,
    UnsupportedFeatureError,
)
from fdlora.integrations.transformers import loraconfig
from fdlora.layers.trainable import half_casts
from fdlora.layers.trainable.modules import (
    TRAINABLE,
    SavedCopy,
    TrainableLoraConv2d,
    TrainableLoraLinear,
    TrainState,
)

INITS = (True, False, "gaussian")


def _wrappers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, (*TRAINABLE, SavedCopy))]


def state_of(model: nn.Module) -> TrainState | None:
    """The model's TrainState (shared by its trainable layers), or None when it has no trainable adapter."""
    for _, m in _wrappers(model):
        return m.state
    return None


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@contextlib.contextmanager
def _bases_in_place(model: nn.Module) -> Iterator[None]:
    """Put the wrapped modules back while PEFT's targeting rules look at the model (as if no adapter were trained)."""
    wrapped = _wrappers(model)
    for path, m in wrapped:
        _set(model, path, m.base)
    try:
        yield
    finally:
        for path, m in wrapped:
            _set(model, path, m)


def _check_name(model: nn.Module, name: object) -> None:
    if not isinstance(name, str) or not name or not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
        raise AdapterNameError(f"adapter name {name!r}: use letters, digits, '_' or '-' (it names parameters).")
    if hasattr(nn.ParameterDict(), name):
        raise AdapterNameError(f"adapter name {name!r} is a torch.nn.Module attribute; pick another name.")
    st = state_of(model)
    if st is not None and name in st.configs:
        raise DuplicateAdapterError(f"a trainable adapter named {name!r} already exists on this model; pick another "
                                    "name or remove it with fdlora.training.remove_trainable(model).")


def _check_config(cfg: object) -> None:
    loraconfig.check_supported(cfg, "add_trainable_adapter")
    init = cfg.init_lora_weights
    if init not in INITS:
        raise UnsupportedFeatureError(f"init_lora_weights={init!r} is not supported for training here; use one of "
                                      "True, False, 'gaussian' (or initialise with PEFT and call fdlora.from_peft).")
    if getattr(cfg, "lora_bias", False):
        raise UnsupportedFeatureError("lora_bias=True is not supported for training; set lora_bias=False.")
    if cfg.lora_dropout is None or not 0 <= cfg.lora_dropout < 1:
        raise ValueError(f"lora_dropout={cfg.lora_dropout!r}: must be in [0, 1).")


def _no_targets(model: nn.Module, cfg: object) -> TargetError:
    names = sorted({p.rsplit(".", 1)[-1] for p, m in model.named_modules()
                    if p and isinstance(m, (nn.Linear, nn.Conv2d)) or type(m).__name__ == "Conv1D"})
    wanted = cfg.target_modules if isinstance(cfg.target_modules, str) else sorted(cfg.target_modules or [])
    hint = ""
    if not isinstance(wanted, str):
        close = [c for w in wanted for c in difflib.get_close_matches(w, names, 1)]
        hint = f" Did you mean {close}?" if close else ""
    return TargetError(f"target_modules={wanted!r} matches no module of {type(model).__name__}.{hint} Linear/conv "
                       f"module names here: {names[:20]}{' ...' if len(names) > 20 else ''}; or use 'all-linear'.")


def add_trainable_adapter(model: nn.Module, name: str, config: object, *, dtype: torch.dtype = torch.float32
                          ) -> nn.Module:
    """Add a trainable LoRA adapter `name` described by `config` (a peft.LoraConfig or its dict) and make it active.

    Base weights and every other loaded (inference) adapter are frozen; adapters loaded with fd-lora stay active
    as a fixed blend under the new one. Returns `model` (changed in place)."""
    cfg = loraconfig.lora_config(config)
    _check_name(model, name)
    _check_config(cfg)
    with _bases_in_place(model):
        facts = loraconfig.facts(model, cfg, f"trainable adapter {name!r}")
        saved = [p for p, _ in model.named_modules()
                 if p and not p.startswith(facts.inside)
                 and any(p == s or p.endswith("." + s) for s in facts.saved_names)]
    if facts.params:  # (PEFT's ParamWrapper targets: "all-linear" on Mixtral-like models includes them)
        raise UnsupportedFeatureError(
            f"trainable adapter {name!r} puts LoRA on parameters ({sorted(facts.params)[:3]}: MoE routers / fused "
            "experts), which fd-lora serves for inference but does not train; list target_modules (e.g. the "
            "attention projections) and no target_parameters, or train with PEFT and serve with fdlora.from_peft.")
    if not facts.targets:
        raise _no_targets(model, cfg)
    st = state_of(model) or TrainState()
    for path in facts.targets:
        module = model.get_submodule(path)
        if not isinstance(module, TRAINABLE):
            inner = getattr(module, "base", module) if type(module).__name__.startswith("FusedLora") else module
            cls = TrainableLoraConv2d if isinstance(inner, nn.Conv2d) else TrainableLoraLinear
            module = cls(module, path, st)
            _set(model, path, module)
        r, alpha = facts.rank_alpha[path]
        scale = alpha / r ** 0.5 if facts.use_rslora else alpha / r
        ref = next((t for t in (module.base.parameters()) if t.is_floating_point()), None)
        device = ref.device if ref is not None else torch.device("cpu")
        module.add(name, r, scale, cfg.lora_dropout, cfg.init_lora_weights, dtype, device)
    for path in saved:
        module = model.get_submodule(path)
        if not isinstance(module, SavedCopy):
            module = SavedCopy(module, path, st)
            _set(model, path, module)
        module.add(name)
    st.configs[name] = cfg
    st.active.append(name)
    st.halves.clear()
    half_casts.arm(model, st)
    _freeze(model)
    return model


def _freeze(model: nn.Module) -> None:
    keep = {id(p) for p in trainable_parameters(model, _all=True)}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def trainable_parameters(model: nn.Module, _all: bool = False) -> list[nn.Parameter]:
    """Exactly what an optimizer should get: every trainable adapter's A and B and its modules_to_save copies
    (never a base, quantized or inference-adapter weight), in a stable order."""
    out = []
    for _, m in _wrappers(model):
        if isinstance(m, SavedCopy):
            out += [p for c in m.copies.values() for p in c.parameters()]
        else:
            out += [p for n in m.lora_A for p in (m.lora_A[n], m.lora_B[n])]
    return out if _all else [p for p in out if p.requires_grad]


def lora_parameters(model: nn.Module, name: str) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
    """{module path: (A, B)} of trainable adapter `name`: A [r, K] (conv [r, C, kh, kw]), B [N, r] (conv
    [N, r, 1, 1]), the orientation of PEFT's lora_A / lora_B weights."""
    out = {p: (m.lora_A[name], m.lora_B[name]) for p, m in _wrappers(model)
           if isinstance(m, TRAINABLE) and name in m.lora_A}
    if not out:
        st = state_of(model)
        raise UnknownAdapterError(f"no trainable adapter {name!r}; trainable adapters: "
                                  f"{sorted(st.configs) if st else []}.")
    return out


def saved_modules(model: nn.Module, name: str) -> dict[str, nn.Module]:
    """{module path: trainable copy} of adapter `name`'s modules_to_save."""
    return {p: m.copies[name] for p, m in _wrappers(model) if isinstance(m, SavedCopy) and name in m.copies}


def set_active(model: nn.Module, names: Sequence[str]) -> None:
    """Which trainable adapters every sample gets (in this order); [] for the base (plus inference adapters)."""
    st = _state(model)
    unknown = [n for n in names if n not in st.configs]
    if unknown:
        raise UnknownAdapterError(f"unknown trainable adapters {unknown}; have {sorted(st.configs)}.")
    st.active[:] = list(names)


@contextlib.contextmanager
def per_sample(model: nn.Module, names: Sequence[str | None]) -> Iterator[None]:
    """One trainable adapter (or None) per sample of the next calls' batches: each adapter's op runs on its own
    samples only, so each gets the gradients it would get trained alone on them."""
    st = _state(model)
    unknown = sorted({n for n in names if n is not None and n not in st.configs})
    if unknown:
        raise UnknownAdapterError(f"unknown trainable adapters {unknown}; have {sorted(st.configs)}.")
    old, st.samples = st.samples, list(names)
    try:
        yield
    finally:
        st.samples = old


def _state(model: nn.Module) -> TrainState:
    st = state_of(model)
    if st is None:
        raise UnknownAdapterError(f"{type(model).__name__} has no trainable adapter; add one with "
                                  "fdlora.add_trainable_adapter.")
    return st


def remove_trainable(model: nn.Module) -> None:
    """Put every wrapped module back (trainable adapters and modules_to_save copies are dropped)."""
    for path, m in _wrappers(model):
        _set(model, path, m.base)
    half_casts.disarm(model)
