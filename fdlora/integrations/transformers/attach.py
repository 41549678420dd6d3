"""The attach step of a PEFT load: `PeftLoad`s into a model, fused layers for the LoRA, SavedModules for copies.

What goes in was fully read and checked by the read step (`.read` for files and state dicts, `.live`
for a live PEFT model); this module only changes the model, all adapters or none.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fdlora.integrations.transformers import saved_modules
from fdlora.integrations.transformers.convert import PeftLoad
from fdlora.integrations.transformers.live import LiveRead
from fdlora.layers import FdLoraHandle, padded_rank, registry_of_models
from fdlora.runtime.scope import lock_of
from fdlora.runtime.session import session_of

DEFAULT_SLOTS, DEFAULT_RANK = 4, 64


def ensure_handle(model: nn.Module, loads: Sequence[PeftLoad]) -> tuple[FdLoraHandle, bool]:
    """The model's handle, created or grown so that `loads` fit; (handle, created)."""
    need_rank = max(padded_rank(m.rank) for ld in loads for m in ld.adapter.modules.values())
    h = registry_of_models.get(model)
    if h is None:
        # rank capacity as loaded (grown by a later, larger adapter), not DEFAULT_RANK: banks take what they hold
        # and slots as loaded, up to DEFAULT_SLOTS before a load grows them (freeze() allocates up to it)
        h = FdLoraHandle(model, max_slots=len(loads), max_rank=need_rank, slot_limit=max(DEFAULT_SLOTS, len(loads)),
                         frozen_rank=max(DEFAULT_RANK, need_rank))  # (what freeze() allocates: compiled shapes)
        registry_of_models[model] = h
        return h, True
    free = len(h.state.slots.free()) + h.slot_limit - h.state.slots.capacity
    if not h.state.static:  # a frozen model raises on add instead
        if free < len(loads):
            h.slot_limit += len(loads) - free  # the banks gain these slots as the adapters load
        if need_rank > h.max_rank:
            h.grow(max_rank=need_rank)
    return h, False


def attach(model: nn.Module, named: Sequence[tuple[str, PeftLoad]], activate: str | None = None) -> FdLoraHandle:
    """Load every (name, load) into `model` (all or nothing, Ctrl-C included); activate `activate` if given.

    Holds the model's lock (fdlora.runtime.scope.lock_of): calls in flight finish first."""
    with lock_of(model):
        return _attach(model, named, activate)


def _attach(model: nn.Module, named: Sequence[tuple[str, PeftLoad]], activate: str | None) -> FdLoraHandle:
    h, created = ensure_handle(model, [ld for _, ld in named])
    done: list[str] = []
    try:
        for name, ld in named:
            h.add_adapter(ld.adapter, name, activate=False)
            done.append(name)
    except BaseException:  # KeyboardInterrupt too: a half-attached adapter must not keep its name
        if created:
            h.restore()
        elif done:
            h.delete_adapter(done)
        raise
    session = session_of(model)
    for name, ld in named:
        session.configs[name] = ld.config
        saved_modules.drop(model, session, name)  # a reused name must not keep an old copy
        for path, copy in ld.saved.items():
            saved_modules.install(model, session, path, name, copy)
    if activate is not None:
        h.set_adapters([activate])
    return h


def attach_live(live: LiveRead) -> FdLoraHandle:
    """Put PEFT's own modules back, drop its bookkeeping, then attach what `read_live` read, state included."""
    root = live.root
    for path, original in live.originals.items():
        parent, _, child = path.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, child, original)
    for attr in ("peft_config", "_hf_peft_config_loaded"):  # PEFT / diffusers / transformers bookkeeping
        if attr in vars(root):
            delattr(root, attr)
    h = attach(root, live.loads)
    h.set_adapters(list(live.weights), list(live.weights.values()))
    if live.disabled:
        h.disable()
    return h
