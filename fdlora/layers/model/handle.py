"""The handle of an injected model: swap modules in and out, load, switch and delete adapters.

Every public call validates everything first and only then writes, so bad input leaves the model
as it was. `restore()` puts the original module objects back: the base model is bit-identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fdlora import env
from fdlora.errors import (
    CapacityError,
    CompiledModelError,
    DeviceMemoryError,
    DuplicateAdapterError,
    FdLoraError,
    TargetError,
)
from fdlora.hub.adapter import LoraAdapter, check_adapter_name
from fdlora.hub.cache import Staged
from fdlora.hub.formats import lycoris
from fdlora.layers.fastpath import hot
from fdlora.layers.model import moe_targets as moe
from fdlora.layers.modules import shared_shrink as shared
from fdlora.layers.modules.fused import FusedLoraConv2d, FusedLoraLinear, _FusedLora, check_fits, spec_of
from fdlora.layers.registry import registry_of_models
from fdlora.layers.state import LayerDict, Mode, ModelState, lasting
from fdlora.layers.storage.bank import AdapterBank, bank_bytes, padded_rank
from fdlora.layers.storage.bank import arena as bank_arena
from fdlora.layers.storage.bulk import Prepared, prepare
from fdlora.steps import Steps, drain

SampleSpec = str | None | Mapping[str, float]
Weight = float | Callable[[str], float] | None


@dataclass(frozen=True)
class LoadPlan:
    """A checked load: which slot, which modules still to wrap. Only `commit` acts on it."""

    name: str
    slot: int
    adapter: LoraAdapter
    to_wrap: list[str]
    staged: Staged | None = None  # the adapter's device copy (fdlora.hub.cache.stage): commit writes from it
    writes: Writes | None = None  # the writes, made beforehand for `slot` (FdLoraHandle.writes_steps)


@dataclass(frozen=True)
class Writes:
    """A plan's writes into slot `slot`: its scale-table rows and scales, the banks' writes (from the staged copy by
    the bulk writer, `bulk`; else `AdapterBank.write_many` over `modules`), and which kept hot-path entries hold
    past them (`rekey`)."""

    slot: int
    rows: torch.Tensor  # [n] the modules' rows of the scale table
    scales: torch.Tensor
    bulk: Prepared | None
    modules: list
    rekey: tuple[int, list] | None  # hot.rekey_steps' check, for the re-arm after the write (None: not made)

    def launch(self, scaling: torch.Tensor, check: bool = False) -> bool:
        """Write; with `check`, False (nothing written) if a bank moved since the writes were made."""
        if self.bulk is not None and not self.bulk.launch(check):
            return False
        if self.bulk is None:
            AdapterBank.write_many(self.modules)
        scaling[self.rows, self.slot] = self.scales
        return True


class FdLoraHandle:
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

    # --- module swapping -----------------------------------------------------------------------
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
        shared.regroup(self.model, self.layers)  # q/k/v, gate/up: one shrink per input (fdlora.layers.modules.shared_shrink)
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

    # --- adapters ------------------------------------------------------------------------------
    def add_adapter(self, adapter: LoraAdapter, name: str | None = None, *, activate: bool = True,
                    validate: bool = True) -> int:
        """Load `adapter` into a free slot of every layer it targets; returns the slot.

        With `activate` (the default, as diffusers' `load_lora_weights`) it becomes the only active
        adapter. Modules it targets that are not wrapped yet are wrapped first.
        """
        return self.commit(self.plan(adapter, name, validate=validate), activate=activate)

    def plan(self, adapter: LoraAdapter, name: str | None = None, *, validate: bool = True,
             slot: bool = True) -> LoadPlan:
        """Check everything about loading `adapter` and say how; raises on any problem (naming every module
        that cannot take it), changes nothing. With `slot=False` the plan does not need a free slot yet (a
        pool checks first and makes room after): `commit` takes one."""
        return drain(self.plan_steps(adapter, name, validate=validate, slot=slot))

    def plan_steps(self, adapter: LoraAdapter, name: str | None = None, *, validate: bool = True,
                   slot: bool = True, every: int = 0) -> Steps[LoadPlan]:
        """`plan`, stopping every `every` modules (fdlora.steps; 0: never)."""
        self._alive()
        adapter = lycoris.resolve(adapter, self.model)  # LyCORIS flat names and flat conv factors fitted to the model
        name = check_adapter_name(name if name is not None else adapter.name or
                                  f"default_{len(self.state.slots.by_name)}")
        self.state.slots.check_name(name)
        what = f"adapter {name!r}"
        to_wrap, problems = [], []
        layers, cap = self.layers, env.max_rank_limit()
        # the model's modules only when a path is not wrapped yet: a load into wrapped layers (every load but the
        # first, and every prefetch's publication) walks no module tree (~4k modules on an SDXL UNet once wrapped)
        modules = None if all(p in layers for p in adapter.modules) else self._modules()
        for i, (path, m) in enumerate(adapter.modules.items()):
            if every and i and not i % every:
                yield
            try:
                if self._check_module(path, m, what, modules, cap):
                    to_wrap.append(path)
            except FdLoraError as e:
                problems.append(e)
        if problems:
            raise _all_of(problems, what, self._unmatched_hint(adapter))
        if validate:
            adapter.check_finite(name)
        if to_wrap:
            self._reshapeable(f"wrap {len(to_wrap)} more modules for {what}")
        return LoadPlan(name, self.free_slot(name) if slot else -1, adapter, to_wrap)

    def _check_module(self, path: str, m, what: str, modules: dict[str, nn.Module] | None, cap: int) -> bool:
        """Raise if module `path` cannot take LoRA `m`; True if it still has to be wrapped. `modules`: the model's
        modules by path (`_modules`; None when every path of the adapter is wrapped); `cap`: the rank limit."""
        layer = self.layers.get(path)
        if layer is None:
            modules = self._modules() if modules is None else modules
            parts = path.split(".")
            inner = next((p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in self.layers), None)
            if inner is not None:  # a path read off the wrapped model (`X.base`): never wrap inside a fused layer
                raise TargetError(f"{what} targets {path!r}, inside fd-lora's layer at {inner!r}; name the module "
                                  f"{inner!r} (its path in the model as it was before fd-lora wrapped it).")
            if not moe.check(self.model, path, m, what, modules):  # routers, fused expert parameters: layers.moe
                base = modules.get(path)
                spec = None if base is None else spec_of(base)
                if spec is None:
                    raise TargetError(f"{what} targets {path!r}, which is " + (
                        "not a module of this model." if base is None else f"a {type(base).__name__}."))
                check_fits(spec, m, path, what)
        else:
            layer.check(m, what)
        rank = m.rank
        if rank > cap:
            raise CapacityError(f"{what}: {path} has rank {rank}, above the rank limit {cap}; raise it "
                                f"({env.MAX_RANK_VAR}={rank}) if the adapter is genuine.")
        if padded_rank(rank) > self.max_rank:
            raise CapacityError(
                f"{what}: {path} has rank {rank}, above this model's rank capacity {self.max_rank}. "
                f"Raise max_rank (fdlora.inject(..., max_rank={padded_rank(rank)}) or "
                f"handle.grow(max_rank={padded_rank(rank)}))."
            )
        return layer is None

    def commit(self, plan: LoadPlan, *, activate: bool = True) -> int:
        """Carry out a `plan` from `plan()`: wrap, write the banks, register the name. A plan carrying its writes
        (`writes_steps`, made for its slot) launches them if every bank is still where they were made for."""
        free = self.free_slot(plan.name)  # the name is still new and a slot is free (or one more can be made)
        if plan.slot < 0:  # planned without a slot (a pool made room after checking)
            plan = dataclasses.replace(plan, slot=free)
        elif plan.slot in self.state.slots.by_name.values():
            raise CapacityError(f"slot {plan.slot} of the plan for {plan.name!r} was taken since; plan again.")
        S0 = self.state.slots.capacity
        if plan.slot >= S0:  # the banks gain the slot (DeviceMemoryError if they cannot: nothing changed then)
            self._resize(plan.slot + 1, self.max_rank)
        try:
            wrapped = self.wrap(plan.to_wrap)
        except BaseException:
            if self.state.slots.capacity != S0:
                self._resize(S0, self.max_rank)
            raise
        try:
            writes = plan.writes
            if not (writes is not None and writes.slot == plan.slot and not wrapped
                    and writes.launch(self.state.table.scaling, check=True)):
                writes = drain(self.writes_steps(plan))
                writes.launch(self.state.table.scaling)
        except BaseException:  # KeyboardInterrupt too: a retry must find the name free and the banks clean
            self._clear_slot(plan.slot)
            for layer in wrapped:
                self._unwrap(layer.path)
            shared.regroup(self.model, self.layers)
            if self.state.slots.capacity != S0:
                self._resize(S0, self.max_rank)
            raise
        self.state.epoch += 1
        self.state.slots.by_name[plan.name] = plan.slot
        if activate:
            self.set_adapters([plan.name])
        else:
            version = self.state.table.version
            self.state.table.flush()
            ahead = writes.rekey  # (made with the writes, under this table version: see hot.rekey)
            hot.rekey(self.state, self.layers.values(),  # copies the blend did not change serve the next step
                      ahead if ahead is not None and ahead[0] == version else None)
        return plan.slot

    def writes_steps(self, plan: LoadPlan, every: int = 0, rekey: bool = False) -> Steps[Writes]:
        """The bank and scale-table writes of `plan` into its slot (`plan.slot` >= 0, every path wrapped), ready for
        `commit`; nothing written yet. With `every`, stopping every that many modules (fdlora.steps); with `rekey`
        (a load that will not activate), the hot path's re-arm check too (hot.rekey_steps)."""
        writes, rows, layers, slot = [], [], self.layers, plan.slot
        for i, (path, m) in enumerate(plan.adapter.modules.items()):
            if every and i and not i % every:
                yield
            layer = layers[path]
            writes.append((layer.bank, slot, m))
            rows.append(layer.index)
        scales = torch.tensor(plan.adapter.scales(), dtype=self.state.table.scaling.dtype)
        bulk = None if plan.staged is None else (yield from prepare(writes, plan.staged, every))
        ahead = (yield from hot.rekey_steps(self.state, self.layers.values(), every)) if rekey else None
        return Writes(slot, torch.tensor(rows, dtype=torch.long), scales, bulk, writes, ahead)

    def free_slot(self, name: str) -> int:
        """The slot a new adapter `name` takes: the first free one, else the one a growth adds (under `slot_limit`,
        not frozen); raises if the name is taken or no slot can be had."""
        slots = self.state.slots
        slots.check_name(name)
        if len(slots.by_name) >= slots.capacity and slots.capacity < self.slot_limit and not self.state.static:
            return slots.capacity
        return slots.check_new(name)

    def _unmatched_hint(self, adapter: LoraAdapter) -> str:
        missing = [p for p in adapter.modules if p not in self.layers]
        return (f"{len(missing)} of its {len(adapter.modules)} module paths are not wrapped here "
                f"(e.g. {missing[:3]}); it was probably made for another model.")

    def _unwrap(self, path: str) -> None:
        self.state.epoch += 1
        original = self._originals.pop(path)
        if not moe.take(self.model, self.layers[path]):
            self._swap(path, original)
        self.layers.pop(path).release_merged()

    def _clear_slot(self, slot: int) -> None:
        self.state.epoch += 1
        AdapterBank.clear_many([layer.bank for layer in self.layers.values() if layer.bank.used[slot]], slot)
        self.state.table.scaling[:, slot] = 0

    def delete_adapter(self, names: str | Sequence[str]) -> None:
        names = [names] if isinstance(names, str) else list(names)
        slots = [self.state.slots.slot(n) for n in names]  # validates every name first
        for name, slot in zip(names, slots):
            self._clear_slot(slot)
            del self.state.slots.by_name[name]
            self.state.active.pop(name, None)
            self.state.touch()
        self._write_weights()
        self.shrink()

    def shrink(self) -> bool:
        """Give rank capacity back once the adapters that needed it are gone: the banks go down to the largest
        loaded rank, never below the capacity asked for at injection (`base_rank`). Not on a frozen model
        (its buffers keep their shapes). True if the banks were reallocated. `delete_adapter` calls it."""
        if self.state.static:
            return False
        need = max([self.base_rank] + [padded_rank(r) for layer in self.layers.values()
                                       for r in layer.bank.host_ranks])
        if need >= self.max_rank:
            return False
        self._resize(self.state.slots.capacity, need)
        return True

    def rename(self, old: str, new: str) -> None:
        slot = self.state.slots.slot(old)
        if new in self.state.slots.by_name:
            raise DuplicateAdapterError(f"an adapter named {new!r} is already loaded.")
        del self.state.slots.by_name[old]
        self.state.slots.by_name[new] = slot
        if old in self.state.active:
            self.state.active = {new if n == old else n: w for n, w in self.state.active.items()}

    def set_adapters(self, names: str | Sequence[str], weights: Weight | Sequence[Weight] | None = None) -> None:
        """Activate `names` with `weights` (default 1.0 each); every other adapter goes inactive.

        A weight is a number, or a function of the layer path returning one (block-wise weights).
        Numbers cost one small table write whatever the model size; functions are evaluated once per
        layer here, never in forward.
        """
        names = [names] if isinstance(names, str) else list(names)
        if weights is None or isinstance(weights, (int, float)) or callable(weights):
            weights = [1.0 if weights is None else weights] * len(names)
        weights = list(weights)
        if len(weights) != len(names):
            raise FdLoraError(f"{len(names)} adapter names but {len(weights)} weights; give one weight per name.")
        for n in names:
            self.state.slots.slot(n)
        self.state.active = {n: 1.0 if w is None else w if callable(w) else float(w)
                             for n, w in zip(names, weights)}
        self._write_weights()

    def _write_weights(self) -> None:
        st = self.state
        per_layer = any(callable(x) for x in st.active.values())
        with lasting():
            w = torch.zeros(len(self.layers), st.slots.capacity) if per_layer else torch.zeros(st.slots.capacity)
        for n, x in st.active.items():
            slot = st.slots.by_name[n]
            if callable(x):
                w[:, slot] = torch.tensor([float(x(layer.path)) for layer in self.layers.values()])
            else:
                w[..., slot] = x
        st.table.weights = w
        st.table.flush()

    def set_multiplier(self, multiplier: float) -> None:
        """Scale every adapter by `multiplier` (diffusers' per-call `scale`): one table write."""
        self.state.table.multiplier = float(multiplier)
        self.state.table.flush()

    def active_adapters(self) -> list[str]:
        return list(self.state.active) if self.state.enabled else []

    def list_adapters(self) -> list[str]:
        return list(self.state.slots.by_name)

    def disable(self) -> None:
        self.state.enabled = False
        self.state.mode = Mode.OFF

    def enable(self) -> None:
        self.state.enabled = True
        self.state.mode = Mode.BLEND

    # --- per-sample / per-row scopes ------------------------------------------------------------
    def sample_weights(self, adapters: Sequence[SampleSpec]) -> torch.Tensor:
        """[G, S] weights for per-sample specs (a name, None / "__base__", or {name: weight} each).
        Built as one host list (a decode step calls this once per token)."""
        slot, S = self.state.slots.slot, self.state.slots.capacity
        rows = []
        for spec in adapters:
            row = [0.0] * S
            if not (spec is None or spec == "__base__"):
                for n, w in ({spec: 1.0} if isinstance(spec, str) else spec).items():
                    row[slot(n)] = float(w)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.float32).view(len(rows), S)

    @contextlib.contextmanager
    def per_sample(self, adapters: Sequence[SampleSpec] | Mapping[int, Sequence[SampleSpec]]) -> Iterator[None]:
        """Within the block, sample i of a batch uses `adapters[i]`: a name, None, or {name: weight}.

        A mapping {batch size: specs} serves several batch sizes in one call (a pipeline's text
        encoders see the prompts, its denoiser the CFG-doubled, per-image-repeated batch).
        """
        by_batch = adapters if isinstance(adapters, Mapping) else {len(adapters): adapters}
        weights = {b: self.sample_weights(specs) for b, specs in by_batch.items()}
        with self._mode(Mode.SAMPLES):
            self.state.set_sample_weights(weights)
            yield

    @contextlib.contextmanager
    def per_row(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within the block, row m of every [M, K] input uses `adapters[m]` (None / "__base__": no adapter)."""
        slots = [-1 if a is None or a == "__base__" else self.state.slots.slot(a) for a in adapters]
        with self._mode(Mode.ROWS):
            self.state.set_row_slot(torch.tensor(slots, dtype=torch.int32))
            yield

    @contextlib.contextmanager
    def _mode(self, mode: Mode) -> Iterator[None]:
        previous = self.state.mode
        self.state.mode = mode if self.state.enabled else Mode.OFF
        try:
            yield
        finally:
            self.state.mode = previous

    # --- capacity ------------------------------------------------------------------------------
    def freeze(self) -> None:
        """Promise static buffers (torch.compile, CUDA graphs): no host-side shortcuts, no reallocation. Blend-mode
        nn.Linear layers then use the merged-weight cache through fdlora::merged_linear, checked on the device.
        Banks still below `slot_limit` get their slots now (later loads find them; shapes never change after)."""
        frozen_rank = max(self.max_rank, self.__dict__.get("frozen_rank", 0))
        if not self.state.static and (self.state.slots.capacity < self.slot_limit or self.max_rank < frozen_rank):
            self._resize(max(self.slot_limit, self.state.slots.capacity), frozen_rank)
        self.state.static = True

    def unfreeze(self) -> None:
        """Undo `freeze` once no compiled graph or captured CUDA graph of this model is replayed any more:
        eager calls take host shortcuts again (skipping idle layers, the merged-weight cache's host key)."""
        self.state.static = False

    def grow(self, max_slots: int | None = None, max_rank: int | None = None) -> None:
        """Raise slot and/or rank capacity, keeping loaded adapters (not on a frozen model)."""
        self._reshapeable("grow the banks")
        S = max(max_slots or 0, self.state.slots.capacity)
        self.slot_limit = max(self.slot_limit, S)
        cap = env.max_rank_limit()
        if (max_rank or 0) > cap:
            raise CapacityError(f"cannot grow to rank {max_rank}: above the rank limit {cap}; raise it "
                                f"({env.MAX_RANK_VAR}={max_rank}) if you need adapters that large.")
        self._resize(S, max(padded_rank(max_rank or 1), self.max_rank))

    def _resize(self, S: int, R: int) -> None:
        """Every bank to S slots at rank capacity R, one bank at a time (each bank's old buffers go as its new ones
        come: the peak is one bank more, not all of them twice). Out of device memory, the banks already resized go
        back and DeviceMemoryError names what was needed."""
        self.state.epoch += 1
        S0, R0, done = self.state.slots.capacity, self.max_rank, []
        try:
            for layer in self.layers.values():
                layer.bank.resize(S, R)
                done.append(layer)
        except torch.OutOfMemoryError as e:
            for layer in done:
                layer.bank.resize(S0, R0)
            raise self._no_room(f"resizing the banks to {S} slots x rank {R}", list(self.layers), None, S, R,
                                now=(S0, R0)) from e
        self.state.table.resize(len(self.layers), S)
        self.state.slots.capacity = S
        self.max_rank = R
        for layer in self.layers.values():
            layer.rebind()
            layer.select_backend()
        self._write_weights()

    def _no_room(self, what: str, paths: list[str], modules: dict | None, S: int, R: int,
                 now: tuple[int, int] | None = None) -> DeviceMemoryError:
        """The error for banks that did not fit: the bytes they need (beyond what the banks hold now), what is free,
        and what to change."""
        need, device = 0, None
        for path in paths:
            layer = self.layers.get(path)
            if layer is not None:
                bank = layer.bank
                need += bank.nbytes_at(S, R) - (bank.nbytes_at(*now) if now else 0)
                device = device or bank.A.device
                continue
            spec = spec_of(modules[path]) if modules is not None and path in modules else None
            if spec is not None:
                base = modules[path]
                w = next(iter(base.parameters()), None)
                dtype = self.dtype or (w.dtype if w is not None and w.is_floating_point() else torch.float32)
                need += bank_bytes(S, R, math.prod(spec.a_shape), spec.out_features, dtype)
                device = device or (w.device if w is not None else None)
        free = ""
        if device is not None and device.type == "cuda":
            free = f", {torch.cuda.mem_get_info(device)[0] / 2**30:.2f} GiB free"
        at = f" on {device}" if device is not None else ""
        return DeviceMemoryError(
            f"out of device memory {what}: the adapter banks need {need / 2**30:.2f} GiB more{at}{free} ({S} slots "
            f"x rank {R} per layer, {len(paths)} layers). The model is as it was before this call. Load with fewer "
            f"slots or a lower rank capacity (load_fd_lora(..., max_slots=N, max_rank=R) or fdlora.inject(..., "
            "max_slots=N, max_rank=R) on a fresh model; each slot holds one adapter), delete adapters you no longer "
            "use, or free device memory (other models, torch.cuda.empty_cache()).")

    def _reshapeable(self, what: str) -> None:
        if self.state.static:
            raise CompiledModelError(
                f"cannot {what}: this model is frozen for torch.compile / CUDA graphs, and its buffers must keep "
                "their shapes. Prepare before compiling: inject with larger max_slots / max_rank, and wrap every "
                "module adapters may target (fdlora.inject targets, or pipe.load_fd_lora(..., targets=[...]))."
            )

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


def _all_of(problems: list[FdLoraError], what: str, hint: str) -> FdLoraError:
    """One error for every module that cannot take the adapter (of the first problem's type); the hint
    about another model goes with it when a module was missing or not wrappable."""
    first = problems[0]
    hint = hint if any(isinstance(e, TargetError) for e in problems) else ""
    if len(problems) == 1:
        return type(first)(f"{first} {hint}".rstrip())
    shown = "\n".join(f"  - {e}" for e in problems[:12])
    more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
    return type(first)(f"{what}: {len(problems)} modules cannot take it:\n{shown}{more}\n{hint}".rstrip())
