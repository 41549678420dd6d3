"""The in-RAM LRU of converted adapters, so a second load of the same bytes skips the disk and the converter.

Entries are keyed by `CacheKey` (source, fingerprint, file, dtype, conversion options): the
fingerprint is the commit sha for Hub sources (a branch that moved is a new key) and size+mtime
for local files. The budget is in bytes (`FDLORA_CACHE_BYTES`, default 4 GiB); least recently used
entries go first. When CUDA is available, host copies live in pinned memory, packed into one
pinned buffer per entry (one page-locked allocation instead of one per tensor), so copies into
GPU slots run at full PCIe speed.

Cached tensors are shared by every load that hits the entry: treat returned adapters as read-only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from .. import env
from .adapter import LoraAdapter, ModuleLora
from .report import LoadReport

ALIGN = 64  # bytes; every dtype's alignment divides it


@dataclass(frozen=True)
class CacheKey:
    source: str
    fingerprint: str
    file: str | None
    dtype: str | None
    options: tuple = ()


@dataclass
class _Entry:
    adapters: dict[str, LoraAdapter]
    report: LoadReport
    nbytes: int


class AdapterCache:
    """LRU of {component: LoraAdapter} by `CacheKey`, within `max_bytes` (0 disables it)."""

    def __init__(self, max_bytes: int | None = None, pin: bool | None = None) -> None:
        self.max_bytes = env.adapter_cache_bytes() if max_bytes is None else int(max_bytes)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._entries: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def get(self, key: CacheKey) -> tuple[dict[str, LoraAdapter], LoadReport] | None:
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return _fresh(e.adapters), replace(e.report, from_cache=True)

    def put(self, key: CacheKey, adapters: dict[str, LoraAdapter], report: LoadReport) -> dict[str, LoraAdapter]:
        """Store (pinned when enabled) and return the adapters the caller should use from now on."""
        nbytes = sum(a.nbytes() for a in adapters.values())
        if nbytes > self.max_bytes:
            return adapters
        if self.pin:
            adapters = pack_adapters(adapters, pin=True)
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = _Entry(adapters, report, nbytes)
            total = self.nbytes
            while total > self.max_bytes and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                total -= old.nbytes
                self.evictions += 1
        return _fresh(adapters)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __repr__(self) -> str:
        return (f"AdapterCache(entries={len(self)}, {self.nbytes / 1e6:.1f}/{self.max_bytes / 1e6:.0f} MB, "
                f"hits={self.hits}, misses={self.misses}, evictions={self.evictions}, pinned={self.pin})")


_default: AdapterCache | None = None
_default_lock = threading.Lock()


def default_cache() -> AdapterCache | None:
    """The process-wide cache `load_adapters` uses unless given another (None when the budget is 0)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = AdapterCache()
    return _default if _default.max_bytes > 0 else None


def _fresh(adapters: dict[str, LoraAdapter]) -> dict[str, LoraAdapter]:
    """New adapter objects (callers may rename them) over the same cached tensors."""
    return {c: LoraAdapter(dict(a.modules), a.use_rslora, a.name, a.provenance) for c, a in adapters.items()}


def pack_adapters(adapters: dict[str, LoraAdapter], pin: bool = True) -> dict[str, LoraAdapter]:
    """Copies of `adapters` whose tensors are views into one host buffer (page-locked with `pin`)."""
    tensors = [t for a in adapters.values() for m in a.modules.values() for t in (m.A, m.B, m.bias) if t is not None]
    sizes = [-(-t.nbytes // ALIGN) * ALIGN for t in tensors]
    buf = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin)
    offset = 0

    def place(t: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal offset
        if t is None:
            return None
        n = t.nbytes
        view = buf[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        offset += -(-n // ALIGN) * ALIGN
        return view

    out = {}
    for comp, a in adapters.items():
        mods = {p: ModuleLora(place(m.A), place(m.B), m.alpha, place(m.bias)) for p, m in a.modules.items()}
        out[comp] = LoraAdapter(mods, a.use_rslora, a.name, a.provenance)
    return out


def to_device(adapter: LoraAdapter, device: torch.device | str, *, check_finite: bool = False) -> LoraAdapter:
    """`adapter` on `device`: one transfer when its tensors share one buffer (`pack_adapters`), else one each.

    With `check_finite`, NaN/Inf are looked for on the device, in one pass over the whole buffer per dtype
    instead of one host pass per tensor; the modules are then marked checked, so the handle's own
    `check_finite` skips them. A hit there (possibly in alignment padding) is settled by the exact host check,
    which raises with the module's path.
    """
    tensors = [t for m in adapter.modules.values() for t in (m.A, m.B, m.bias) if t is not None]
    storage = tensors[0].untyped_storage()
    start = storage.data_ptr()
    packed = all(t.untyped_storage().data_ptr() == start and t.is_contiguous() for t in tensors)
    if packed:
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        dev = flat.to(device, non_blocking=flat.is_pinned())

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            off = t.data_ptr() - start
            return dev[off:off + t.nbytes].view(t.dtype).view(t.shape)
    else:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=t.is_pinned())

    mods = {p: ModuleLora(move(m.A), move(m.B), m.alpha, move(m.bias), finite=m.finite)
            for p, m in adapter.modules.items()}
    out = LoraAdapter(mods, adapter.use_rslora, adapter.name, adapter.provenance)
    if check_finite and not all(m.finite for m in mods.values()):
        dtypes = {t.dtype for t in tensors}
        if packed and len(dtypes) == 1:
            ok = bool(torch.isfinite(dev[: dev.numel() // tensors[0].element_size() * tensors[0].element_size()]
                                     .view(tensors[0].dtype)).all())
        else:
            ok = bool(torch.stack([torch.isfinite(t).all() for m in mods.values()
                                   for t in (m.A, m.B, m.bias) if t is not None]).all())
        if not ok:
            adapter.check_finite()  # raises with the module's path, unless the hit was padding
        for m in (*adapter.modules.values(), *mods.values()):
            m.finite = True
    return out
