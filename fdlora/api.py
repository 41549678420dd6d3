"""Model-level API (no diffusers needed): inject fused layers, then load and switch adapters.

    handle = fdlora.inject(model, ["q_proj", "v_proj"])       # PEFT target semantics
    fdlora.add_adapter(model, adapter, "a")                   # a LoraAdapter from any format
    fdlora.set_adapters(model, ["a", "b"], [0.7, 0.3])        # one tiny write
    with fdlora.per_sample(model, ["a", None, {"a": .5, "b": .5}]):
        model(batch)
    handle.restore()                                          # original modules back, bit-exact
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fdlora.layers.model.activation import SampleSpec
from fdlora.layers.model.targets import Targets
from fdlora.runtime.scope import lock_of

from .errors import FdLoraError
from .hub.adapter import LoraAdapter
from .layers import FdLoraHandle, match_targets, padded_rank, registry_of_models


def inject(
    model: nn.Module,
    targets: Targets,
    *,
    exclude: Targets | None = None,
    layers_to_transform: int | Sequence[int] | None = None,
    layers_pattern: str | Sequence[str] | None = None,
    max_slots: int = 4,
    max_rank: int = 64,
    dtype: torch.dtype | None = None,
) -> FdLoraHandle:
    """Swap fused LoRA layers in for the modules PEFT would target; returns the model's handle.

    `max_slots` adapters of rank up to `max_rank` (padded to a multiple of 16) fit at once; both
    can grow later with `handle.grow(...)` unless the model is frozen for compilation.
    """
    if model in registry_of_models:
        raise FdLoraError(
            f"{type(model).__name__} already has fd-lora layers; use fdlora.handle(model).wrap(paths) to add more, "
            "or handle.restore() first."
        )
    paths = match_targets(model, targets, exclude, layers_to_transform, layers_pattern)
    h = FdLoraHandle(model, max_slots=max_slots, max_rank=max_rank, dtype=dtype)
    h.wrap(paths)
    registry_of_models[model] = h
    return h


def handle(model: nn.Module) -> FdLoraHandle:
    """The handle of a model that `inject` (or `add_adapter`) prepared."""
    h = registry_of_models.get(model)
    if h is None:
        raise FdLoraError(
            f"{type(model).__name__} has no fd-lora layers; call fdlora.inject(model, targets) or "
            "fdlora.add_adapter(model, adapter) first."
        )
    return h  # type: ignore[return-value]


def add_adapter(model: nn.Module, adapter: LoraAdapter, name: str | None = None, *, activate: bool = True,
                validate: bool = True, max_slots: int = 4, max_rank: int | None = None) -> int:
    """Load `adapter` into `model`, injecting fused layers for its modules if needed; returns its slot.

    Waits for the model's calls in flight (fdlora.runtime.scope.lock_of); an interrupted first load
    (Ctrl-C included) takes the fused layers out again."""
    with lock_of(model):
        h = registry_of_models.get(model)
        if h is None:
            need = max(padded_rank(m.rank) for m in adapter.modules.values())
            h = FdLoraHandle(model, max_slots=max_slots, max_rank=max(max_rank or 64, need))
            registry_of_models[model] = h
            try:
                return h.add_adapter(adapter, name, activate=activate, validate=validate)
            except BaseException:
                h.restore()
                raise
        return h.add_adapter(adapter, name, activate=activate, validate=validate)  # type: ignore[union-attr]


def set_adapters(model: nn.Module, names: str | Sequence[str], weights: Any = None) -> None:
    with lock_of(model):
        handle(model).set_adapters(names, weights)


def delete_adapter(model: nn.Module, names: str | Sequence[str]) -> None:
    with lock_of(model):
        handle(model).delete_adapter(names)


def active_adapters(model: nn.Module) -> list[str]:
    return handle(model).active_adapters()


def disable(model: nn.Module) -> None:
    handle(model).disable()


def enable(model: nn.Module) -> None:
    handle(model).enable()


def restore(model: nn.Module) -> nn.Module:
    return handle(model).restore()


@contextlib.contextmanager
def per_sample(model: nn.Module, adapters: Sequence[SampleSpec]) -> Iterator[None]:
    """Context: sample i of each batch uses adapters[i] (name, None, or {name: weight}).

    The block holds the model's lock: other threads' scopes and calls on `model` wait for it."""
    with lock_of(model), handle(model).per_sample(adapters):
        yield


@contextlib.contextmanager
def per_row(model: nn.Module, adapters: Sequence[str | None]) -> Iterator[None]:
    """Context: row m of each flattened [M, K] input uses adapters[m] (None = base); holds the model's lock."""
    with lock_of(model), handle(model).per_row(adapters):
        yield


def dispatch_counts(model: nn.Module) -> dict[str, int]:
    """How many fused layers of `model` (any module tree: a pipeline's UNet, a Transformers model) took each path on
    their last full call, with their backend: what a benchmark records beside its timings. FDLORA_DEBUG_DISPATCH=1
    logs each decision as it is made."""
    from .layers.modules.fused import _FusedLora

    counts = collections.Counter(m.dispatch_path() for m in model.modules() if isinstance(m, _FusedLora))
    return dict(counts.most_common())
