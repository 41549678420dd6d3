"""A GPU slot pool per model: more adapters than slots, least recently used out, back on demand from RAM.

`AdapterPool` wraps an `FdLoraHandle` and uses only its public methods (plan / commit, which are
add_adapter in two steps, delete_adapter, set_adapters, list_adapters, active_adapters, state.slots).
It keeps a host copy of every adapter it was given (pinned when the model is on CUDA), so an adapter
evicted from the GPU comes back without touching the disk. Eviction takes the least recently used
resident adapter that the current request does not need and that is not active; `set_adapters` may
evict the adapters it is about to deactivate. Loads go through `handle.plan`, which validates every
shape against the target modules before anything is evicted or written, so a failed load leaves the
model and the pool unchanged (`check` validates; `make_room` evicts; `commit` writes).

`add_to_pools` loads the per-component adapters of one source into a pipeline's pools: it checks
every component before evicting or committing anything, so a bad text-encoder part leaves the UNet
untouched too.

On CUDA a load goes to the device in one transfer and reaches the banks in one launch of the bulk
writer (fdlora.layers.storage.bulk) once that kernel is built for the device and dtype (`mark_bulk_ready`:
fdlora.integrations.warmup builds it); before that, through torch copies from views of the device copy
(~1,400 small copies for an SDXL LoRA, a few ms), so no load waits for a kernel build: building it before
the first load takes 0.66 s off that load on an H100 host (benchmarks/bench_prefetch.py, cold).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import CapacityError, DuplicateAdapterError, TargetError, UnknownAdapterError
from ..steps import Steps, drain
from .adapter import LoraAdapter, ModuleLora
from .cache import Staged, keep_span, pack_adapters, span_of, stage

_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_bulk_ready: set[tuple[torch.device, torch.dtype]] = set()  # (device, adapter dtype) the bulk writer is built for


def mark_bulk_ready(device: torch.device | str, dtype: torch.dtype) -> None:
    """Loads of `dtype` adapters onto `device` may use the bulk bank writer from now on (its kernel is built)."""
    _bulk_ready.add((torch.device(device), dtype))


class AdapterPool:
    def __init__(self, handle, *, pin: bool | None = None) -> None:
        self._handle: Callable[[], Any] = lambda: handle  # a pool made directly owns its handle; `of` makes it weak
        self._host: dict[str, LoraAdapter] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()  # resident names, least recently used first
        self._names: frozenset[str] | None = None  # module paths of the model, for path alignment
        self._lock = threading.RLock()
        self.device = _device_of(handle.model)
        self.pin = self.device.type == "cuda" if pin is None else pin
        self.loads = self.reloads = self.evictions = 0

    @classmethod
    def of(cls, handle) -> AdapterPool:
        """The pool of `handle` (created on first use; one per handle)."""
        pool = _pools.get(handle)
        if pool is None:
            pool = _pools[handle] = cls(handle)
            # weak from here: `_pools` is keyed weakly by the handle, and a value that held its key would keep both
            # (and the model's GPU weights) alive for the life of the process
            pool._handle = weakref.ref(handle)
        return pool

    @property
    def handle(self):
        return self._handle()

    @property
    def capacity(self) -> int:
        """Adapters resident at once: the handle's slot limit (its banks gain slots up to it as loads need them)."""
        return self.handle.slot_limit

    def known(self) -> list[str]:
        return list(self._host)

    def resident(self) -> list[str]:
        self._sync()
        return list(self._recent)

    # --- loading -------------------------------------------------------------------------------
    def add(self, name: str, adapter: LoraAdapter, *, activate: bool = False, validate: bool = True) -> None:
        """Register `adapter` under `name` and load it into a GPU slot (evicting the LRU one when full)."""
        with self._lock:
            self.commit(self.plan(name, adapter, validate=validate), activate=activate)

    def plan(self, name: str, adapter: LoraAdapter, *, validate: bool = True,
             evict_active: bool = False) -> tuple[Any, LoraAdapter]:
        """`check`, then `make_room`: what `commit` needs to load `adapter` under `name`."""
        with self._lock:
            return self.make_room(self.check(name, adapter, validate=validate), evict_active=evict_active)

    def check(self, name: str, adapter: LoraAdapter, *, validate: bool = True,
              staged: Staged | None = None) -> tuple[Any, LoraAdapter]:
        """Check everything about loading `adapter` (shapes, targets, ranks, finite values with `validate`)
        and copy it to the device; changes nothing in the model or the pool. `staged`: a device copy made
        beforehand (a prefetch stages on a side stream, fdlora.integrations.prefetch); used if it still covers
        the adapter's tensors, else the adapter is staged again here."""
        with self._lock:
            return drain(self.check_steps(name, adapter, validate=validate, staged=staged))

    def check_steps(self, name: str, adapter: LoraAdapter, *, validate: bool = True, staged: Staged | None = None,
                    every: int = 0) -> Steps[tuple[Any, LoraAdapter]]:
        """`check`, stopping every `every` modules (fdlora.steps), where it holds no lock of the pool's."""
        with self._lock:
            if name in self._host:
                raise DuplicateAdapterError(f"the pool already holds an adapter named {name!r}; delete it first or "
                                            "pick another adapter_name.")
            host = self.align(adapter)
            if self.pin and span_of(host) is None:  # stage() needs one buffer (page-locked: faster, not required)
                host = pack_adapters({"": host})[""]
        return (yield from self._plan_steps(name, host, validate, staged, every)), host

    def make_room(self, checked: tuple[Any, LoraAdapter], *, evict_active: bool = False) -> tuple[Any, LoraAdapter]:
        """Free a slot for a checked load if none is (evicting the least recently used inactive adapter; an
        active one too with `evict_active`, for a load that activates only the new adapter)."""
        with self._lock:
            self._make_room({checked[0].name}, evict_active=evict_active)
            return checked

    def commit(self, planned: tuple[Any, LoraAdapter], *, activate: bool = False) -> None:
        plan, host = planned
        with self._lock:
            self.handle.commit(plan, activate=activate)
            self._host[plan.name] = host
            self._recent[plan.name] = None
            self.loads += 1

    def ensure(self, names: Sequence[str], *, evict_active: bool = False) -> None:
        """Make every adapter in `names` resident (reloading evicted ones from RAM), most recent last."""
        with self._lock:
            names = list(dict.fromkeys(names))
            for n in names:
                if n not in self._host:
                    raise UnknownAdapterError(f"no adapter named {n!r} in this pool (known: {self.known()}).")
            if len(names) > self.capacity:
                raise CapacityError(f"{len(names)} adapters requested at once but the model has {self.capacity} "
                                    "slots; raise max_slots (fdlora.inject(..., max_slots=N) or handle.grow).")
            self._sync()
            for n in names:
                if n not in self._recent:
                    plan = self._plan(n, self._host[n], False)
                    self._make_room(set(names), evict_active=evict_active)
                    self.handle.commit(plan, activate=False)
                    self.reloads += 1
                self._recent[n] = None
                self._recent.move_to_end(n)

    def arrange(self, names: Sequence[str]) -> None:
        """Make `names` resident with their slots in the order of `names` (the ones this pool holds).

        Sums over slots (a blend, per-sample weights, a merged copy) meet adapters in slot order, and float
        addition depends on order; after `arrange`, adapters used together are summed in the order given,
        whatever order earlier loads and evictions left them in. When they are out of order, all of them leave
        their slots and come back from RAM in that order (slots are taken lowest free first); the active set
        is put back as it was."""
        with self._lock:
            names = [n for n in dict.fromkeys(names) if n in self._host]
            self.ensure(names, evict_active=True)
            h = self.handle
            placed = [h.state.slots.by_name[n] for n in names]
            if placed == sorted(placed):
                return
            active = dict(h.state.active)
            h.delete_adapter(names)
            for n in names:
                del self._recent[n]
            for n in names:
                h.commit(self._plan(n, self._host[n], False), activate=False)
                self._recent[n] = None
                self.reloads += 1
            if dict(h.state.active) != active:
                h.set_adapters(list(active), list(active.values()))

    def set_adapters(self, names: str | Sequence[str], weights=None) -> None:
        """`handle.set_adapters` after making `names` resident; adapters it deactivates may be evicted."""
        names = [names] if isinstance(names, str) else list(names)
        with self._lock:
            self.ensure(names, evict_active=True)
            self.handle.set_adapters(names, weights)

    def delete(self, names: str | Sequence[str]) -> None:
        """Forget adapters: out of their slots and out of RAM."""
        names = [names] if isinstance(names, str) else list(names)
        with self._lock:
            for n in names:
                if n not in self._host:
                    raise UnknownAdapterError(f"no adapter named {n!r} in this pool (known: {self.known()}).")
            self._sync()
            resident = [n for n in names if n in self._recent]
            if resident:
                self.handle.delete_adapter(resident)
            for n in names:
                self._host.pop(n)
                self._recent.pop(n, None)

    def rename(self, old: str, new: str) -> None:
        """Rename an adapter (resident or not), on the handle too."""
        with self._lock:
            if old not in self._host:
                raise UnknownAdapterError(f"no adapter named {old!r} in this pool (known: {self.known()}).")
            if new in self._host:
                raise DuplicateAdapterError(f"the pool already holds an adapter named {new!r}.")
            self._sync()
            if old in self._recent:
                self.handle.rename(old, new)
                self._recent = OrderedDict((new if n == old else n, None) for n in self._recent)
            self._host = {new if n == old else n: a for n, a in self._host.items()}

    def names(self) -> list[str]:
        """Every adapter this pool or its handle knows: resident, evicted, or loaded on the handle directly."""
        return list(dict.fromkeys([*self._host, *self.handle.list_adapters()]))

    # --- internals -----------------------------------------------------------------------------
    def _sync(self) -> None:
        """Follow changes made on the handle directly (an adapter deleted there is no longer resident)."""
        loaded = set(self.handle.list_adapters())
        for n in [n for n in self._recent if n not in loaded]:
            del self._recent[n]

    def _make_room(self, keep: set[str], *, evict_active: bool) -> None:
        self._sync()
        used = len(self.handle.state.slots.by_name)
        if used < self.capacity:
            return
        active = set() if evict_active else set(self.handle.active_adapters())
        for n in self._recent:
            if n not in keep and n not in active:
                self.handle.delete_adapter(n)
                del self._recent[n]
                self.evictions += 1
                return
        foreign = sorted(set(self.handle.list_adapters()) - set(self._recent))
        unmanaged = f"; not managed by this pool: {foreign}" if foreign else ""
        raise CapacityError(
            f"all {self.capacity} slots hold adapters this request needs or that are active "
            f"({', '.join(self.handle.list_adapters())}){unmanaged}. Deactivate some (set_adapters), or raise "
            "max_slots (handle.grow(max_slots=N))."
        )

    def _plan(self, name: str, host: LoraAdapter, check_finite: bool, staged: Staged | None = None):
        """handle.plan for `host`, taking no slot yet (commit does). On CUDA the packed host copy goes to the
        device in one transfer (NaN-checked there) and `commit` fills the banks from it in one launch
        (fdlora.layers.storage.bulk)."""
        return drain(self._plan_steps(name, host, check_finite, staged))

    def _plan_steps(self, name: str, host: LoraAdapter, check_finite: bool, staged: Staged | None = None,
                    every: int = 0):
        if staged is not None and not (staged.flat.device == self.device and staged.covers(host)
                                       and (not check_finite or all(m.finite for m in host.modules.values()))):
            staged = None  # (another device, tensors made since: fused qkv; or staged without the finite check)
        if staged is None and self.device.type == "cuda":
            staged = stage(host, self.device, check_finite=check_finite)
        if staged is None:
            return (yield from self.handle.plan_steps(host, name, validate=check_finite, slot=False, every=every))
        if check_finite:
            host.check_finite(name)  # the tensors passed on the device: this checks the scales (alpha / r)
        if (staged.flat.device, next(iter(host.modules.values())).A.dtype) not in _bulk_ready:  # torch copies
            return (yield from self.handle.plan_steps(_views(host, staged), name, validate=False, slot=False,
                                                      every=every))
        plan = yield from self.handle.plan_steps(host, name, validate=False, slot=False, every=every)
        return dataclasses.replace(plan, staged=staged)

    def align(self, adapter: LoraAdapter) -> LoraAdapter:
        """`adapter` with module paths fitted to this model (see `align_paths`). Only CLIP text encoders need it:
        elsewhere the model's module names are never listed (a walk of ~10k modules on an SDXL UNet)."""
        model = self.handle.model
        if "text_model" not in model._modules and not any(p.startswith("text_model.") for p in adapter.modules):
            return adapter
        if self._names is None or any(p not in self._names for p in adapter.modules):
            self._names = frozenset(n for n, _ in model.named_modules())
        return align_paths(adapter, self._names)

    def __repr__(self) -> str:
        return (f"AdapterPool(slots={self.capacity}, resident={self.resident()}, known={len(self._host)}, "
                f"loads={self.loads}, reloads={self.reloads}, evictions={self.evictions})")


def align_paths(adapter: LoraAdapter, names: frozenset[str] | set[str]) -> LoraAdapter:
    """Fit CLIP text-encoder paths to the model: with or without the ``text_model.`` level.

    transformers 5 flattens `CLIPTextModel` (no ``text_model.``) but not `CLIPTextModelWithProjection`,
    while LoRA files spell it either way; diffusers strips it the same way. Other paths are kept.
    """
    if all(p in names for p in adapter.modules):
        return adapter
    mods = {}
    for path, m in adapter.modules.items():
        if path not in names:
            alt = path.removeprefix("text_model.") if path.startswith("text_model.") else "text_model." + path
            path = alt if alt in names else path
        mods[path] = m
    if len(mods) != len(adapter.modules):
        raise TargetError("two module paths of the adapter map to the same module once text_model. is fitted.")
    return keep_span(adapter, LoraAdapter(mods, adapter.use_rslora, adapter.name, adapter.provenance))


def _views(host: LoraAdapter, staged: Staged) -> LoraAdapter:
    """`host` over its device copy: each module's tensors as views of `staged` (a DoRA magnitude stays on the host:
    it is not packed)."""
    return LoraAdapter({p: ModuleLora.checked({**vars(m), "A": staged.view(m.A), "B": staged.view(m.B),
                                               "bias": staged.view(m.bias)})  # (same shapes: no checks again)
                        for p, m in host.modules.items()}, host.use_rslora, host.name, host.provenance)


def add_to_pools(pools: Mapping[str, AdapterPool], adapters: Mapping[str, LoraAdapter], name: str, *,
                 activate: bool = False, validate: bool = True) -> None:
    """Load one source's per-component adapters into the matching pools; all or nothing."""
    missing = [c for c in adapters if c not in pools]
    if missing:
        raise TargetError(f"the adapter has weights for {missing} but there is no pool (model) for "
                          f"{'them' if len(missing) > 1 else 'it'}; pools: {sorted(pools)}.")
    checked = [(pools[c], pools[c].check(name, a, validate=validate)) for c, a in adapters.items()]
    ready = [(pool, pool.make_room(plan)) for pool, plan in checked]
    for pool, plan in ready:
        pool.commit(plan, activate=activate)


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
