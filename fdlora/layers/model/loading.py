"""Loading adapters into an injected model: check everything first (`plan`), then write (`commit`); delete, rename.

Every public call validates everything first and only then writes, so bad input leaves the model as it was. The
methods are FdLoraHandle's (fdlora.layers.model.handle), which mixes `Loading` in; they use its state, layers and
module swapping (`wrap`, `_unwrap`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fdlora import env
from fdlora.errors import CapacityError, DuplicateAdapterError, FdLoraError, TargetError
from fdlora.hub.adapter import LoraAdapter, check_adapter_name
from fdlora.hub.cache import Staged
from fdlora.hub.formats import lycoris
from fdlora.layers.fastpath import hot
from fdlora.layers.model import moe_targets as moe
from fdlora.layers.modules import shared_shrink as shared
from fdlora.layers.modules.fused import check_fits, spec_of
from fdlora.layers.storage.bank import AdapterBank, padded_rank
from fdlora.layers.storage.bulk import Prepared, prepare
from fdlora.steps import Steps, drain


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


class Loading:
    """FdLoraHandle's adapters: plan and commit a load, free slots, delete and rename."""

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

    def rename(self, old: str, new: str) -> None:
        slot = self.state.slots.slot(old)
        if new in self.state.slots.by_name:
            raise DuplicateAdapterError(f"an adapter named {new!r} is already loaded.")
        del self.state.slots.by_name[old]
        self.state.slots.by_name[new] = slot
        if old in self.state.active:
            self.state.active = {new if n == old else n: w for n, w in self.state.active.items()}


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
