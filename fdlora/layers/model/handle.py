"""The handle of an injected model: swap modules in and out, load, switch and delete adapters.

Every public call validates everything first and only then writes, so bad input leaves the model
as it was. `restore()` puts the original module objects back: the base model is bit-identical.
This module holds the handle and its module swapping; its other jobs are mixed in from beside it:
loading.py (plan, commit, delete, rename), activation.py (weights and scopes), capacity.py (bank shapes).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from fdlora import env
from fdlora.errors import CapacityError, FdLoraError, TargetError
from fdlora.layers.model import moe_targets as moe
from fdlora.layers.model.activation import Activation
from fdlora.layers.model.capacity import Capacity
from fdlora.layers.model.loading import Loading
from fdlora.layers.modules import shared_shrink as shared
from fdlora.layers.modules.fused import FusedLoraConv2d, FusedLoraLinear, _FusedLora
from fdlora.layers.registry import registry_of_models
from fdlora.layers.state import LayerDict, ModelState
from fdlora.layers.storage.bank import arena as bank_arena
from fdlora.layers.storage.bank import padded_rank


class FdLoraHandle(Loading, Activation, Capacity):
    """The handle of one injected model. A registered model holds its handle (fdlora.layers.registry), which then
    holds the model weakly (strongly while unregistered: then nothing else may), and the model's state holds the
    layers weakly (ModelState.members), so no reference cycle runs through the model: a deleted model gives its
    memory (weights, banks, merged copies) back by reference counting alone, without waiting for a collection."""

    def __init__(self, model: nn.Module, max_slots: int = 4, max_rank: int = 64,
                 dtype: torch.dtype | None = None, slot_limit: int | None = None,
                 frozen_rank: int | None = None) -> None:
        """`max_slots` slots are allocated now; with `slot_limit` above it, the banks gain a slot per load that finds
        none free (until the limit; then an AdapterPool evicts, a direct load raises CapacityError), so they hold what
        is loaded rather than the limit up front. `freeze()` allocates up to the limit and to rank `frozen_rank` (if
        above max_rank): a frozen model's shapes never change, so its loads need that room in place."""
        if max_slots < 1 or max_rank < 1:
            raise CapacityError(f"max_slots ({max_slots}) and max_rank ({max_rank}) must be at least 1.")
        cap = env.max_rank_limit()
        if max_rank > cap:
            raise CapacityError(f"max_rank {max_rank} is above the rank limit {cap}; raise it ({env.MAX_RANK_VAR}="
                                f"{max_rank}) if you need adapters that large.")
        self.model = model
        self.max_rank = padded_rank(max_rank)
        self.base_rank = self.max_rank  # the capacity asked for: delete_adapter shrinks back towards it
        self.dtype = dtype
        self.state = ModelState(0, max_slots)
        self.slot_limit = max(max_slots, slot_limit or 0)
        self.frozen_rank = padded_rank(max(max_rank, frozen_rank or 0))
        self.layers: dict[str, _FusedLora] = LayerDict()
        self.state.members = self.layers
        self._originals: dict[str, nn.Module] = {}
        self._restored = False

    @property
    def model(self) -> nn.Module | None:
        """The injected model (None once it was deleted)."""
        return self._model()

    @model.setter
    def model(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._owner = model  # strong until the model holds this handle (held_by_model)

    def held_by_model(self, held: bool) -> None:
        """The registry stored this handle on its model (True) or took it off (False)."""
        self._owner = None if held else self._model()

    def __getstate__(self) -> dict:  # copies and pickles carry the model itself, held weakly again on the other side
        return {**self.__dict__, "_model": self._model()}

    def __setstate__(self, state: dict) -> None:
        model = state.pop("_model")
        state.setdefault("slot_limit", state["state"].slots.capacity)
        state.setdefault("_owner", None)
        self.__dict__.update(state)
        self._model = weakref.ref(model) if model is not None else _gone

    def wrap(self, paths: Sequence[str]) -> list[_FusedLora]:
        """Swap fused layers in for `paths` (skipping those already wrapped)."""
        self._alive()
        new = [p for p in dict.fromkeys(paths) if p not in self.layers]
        if not new:
            return []
        self._reshapeable("wrap more modules")
        L0, S = len(self.layers), self.state.slots.capacity
        self.state.epoch += 1
        self.state.table.resize(L0 + len(new), S)
        made = []
        modules = self._modules()
        try:
            with bank_arena():  # the new banks as views of a few zeroed buffers: ~4 allocations per layer saved
                for i, path in enumerate(new):
                    layer = moe.make(self.model, path, self.state, L0 + i, self.max_rank, self.dtype, modules)  # MoE
                    if layer is None:
                        base = modules.get(path)
                        if base is None:
                            raise TargetError(f"{path!r} is not a module of this model.")
                        cls = FusedLoraConv2d if isinstance(base, nn.Conv2d) else FusedLoraLinear
                        layer = cls(base, self.state, L0 + i, path, self.max_rank, self.dtype)
                    made.append(layer)
        except BaseException as e:  # nothing swapped yet: the table back to the wrapped layers
            self.state.table.resize(L0, S)
            for layer in self.layers.values():
                layer.rebind()
            if isinstance(e, torch.OutOfMemoryError):
                raise self._no_room(f"wrapping {len(new)} modules", new, modules, S, self.max_rank) from e
            raise
        done = []
        try:  # all or nothing: an error or Ctrl-C between two swaps puts the swapped modules back
            for layer in made:
                if not moe.put(self.model, layer):
                    self._swap(layer.path, layer)
                self._originals[layer.path] = layer.base
                self.layers[layer.path] = layer
                done.append(layer)
            moe.enter(self.model, self.state, [layer.path for layer in made])
        except BaseException:
            for layer in reversed(done):
                self._unwrap(layer.path)
            raise
        for layer in self.layers.values():
            layer.rebind()
        shared.regroup(self.model, self.layers)  # q/k/v, gate/up: one shrink per input (layers.modules.shared_shrink)
        return made

    def _modules(self) -> dict[str, nn.Module]:
        """The model's modules by path, in one walk (a load looks up every target: on the SDXL UNet, 722 paths
        resolved with get_submodule's attribute walk took ~0.15 s of a first load)."""
        return dict(self.model.named_modules(remove_duplicate=False))

    def _swap(self, path: str, module: nn.Module) -> None:
        parent, _, child = path.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, module)

    def restore(self) -> nn.Module:
        """Put every original module back (bit-exact base model) and drop all adapters."""
        self._alive()
        for path, original in self._originals.items():
            if not moe.take(self.model, self.layers[path]):
                self._swap(path, original)
        moe.leave(self.model)
        for layer in self.layers.values():
            layer.release_merged()
        self._originals.clear()
        self.layers.clear()
        self._restored = True
        registry_of_models.pop(self.model, None)
        return self.model

    def _unwrap(self, path: str) -> None:
        self.state.epoch += 1
        original = self._originals.pop(path)
        if not moe.take(self.model, self.layers[path]):
            self._swap(path, original)
        self.layers.pop(path).release_merged()

    def _alive(self) -> None:
        if self._restored:
            raise FdLoraError("this handle was restored; call fdlora.inject(model, ...) again to use fd-lora.")

    def __repr__(self) -> str:
        backends = sorted({l.selection.name for l in self.layers.values() if l.selection})
        return (f"FdLoraHandle({type(self.model).__name__}, layers={len(self.layers)}, "
                f"slots={self.state.slots.capacity}, rank_capacity={self.max_rank}, backends={backends}, "
                f"adapters={self.list_adapters()}, active={self.active_adapters()})")


def _gone() -> None:
    return None
