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
from .adapter import LoraAdapter
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
        nbytes = report.nbytes or sum(a.nbytes() for a in adapters.values())
        if nbytes > self.max_bytes:
            return adapters
        if self.pin and not all(packed_pinned(a) for a in adapters.values()):
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


def cached_bytes() -> int:
    """Bytes the process-wide cache holds now (0 before its first use): host memory that stays resident by design."""
    return _default.nbytes if _default is not None else 0


def _fresh(adapters: dict[str, LoraAdapter]) -> dict[str, LoraAdapter]:
    """New adapter objects (callers may rename them) over the same cached tensors (and their known span)."""
    return {c: keep_span(a, LoraAdapter(dict(a.modules), a.use_rslora, a.name, a.provenance))
            for c, a in adapters.items()}


def pack_adapters(adapters: dict[str, LoraAdapter], pin: bool = True) -> dict[str, LoraAdapter]:
    """Copies of `adapters` whose tensors are views into one host buffer (page-locked with `pin`). The alignment
    padding between tensors is zeroed: `stage`'s finite check reads the buffer whole, and uninitialised bytes there
    (a NaN pattern left by an earlier use of the memory) sent a clean adapter through the exact host check."""
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
        end = offset + -(-n // ALIGN) * ALIGN
        if end > offset + n:
            buf[offset + n:end].zero_()
        offset = end
        return view

    out = {}
    for comp, a in adapters.items():
        mods = {p: m.replace(place(m.A), place(m.B), place(m.bias), finite=False) for p, m in a.modules.items()}
        out[comp] = LoraAdapter(mods, a.use_rslora, a.name, a.provenance)
    return out


@dataclass
class Staged:
    """A packed host adapter copied to a device in one transfer: `flat` holds its bytes, `start` is the host
    address of the packed buffer's first byte (module tensor at host address p lives at flat[p - start])."""

    flat: torch.Tensor  # uint8, on the device
    start: int

    def covers(self, adapter: LoraAdapter) -> bool:
        """Every tensor of `adapter` lies in the host bytes this copy was made from (so `view` finds them)."""
        span = span_of(adapter)
        return span is not None and self.start <= span[1] and span[2] <= self.start + self.flat.numel()

    def view(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The device copy of host tensor `t` (a view into `flat`)."""
        if t is None:
            return None
        off = t.data_ptr() - self.start
        return self.flat[off:off + t.nbytes].view(t.dtype).view(t.shape)


def _tensors(adapter: LoraAdapter) -> list[torch.Tensor]:
    return [t for m in adapter.modules.values() for t in (m.A, m.B, m.bias) if t is not None]


def _span(tensors: list[torch.Tensor]) -> tuple[int, int, int] | None:
    """(buffer start, first byte, end byte) when every tensor is a contiguous view into one buffer, else None."""
    start = tensors[0].untyped_storage().data_ptr()
    lo, hi = None, 0
    for t in tensors:
        if t.untyped_storage().data_ptr() != start or not t.is_contiguous():
            return None
        p = t.data_ptr()
        lo = p if lo is None or p < lo else lo
        hi = max(hi, p + t.nbytes)
    return start, lo, hi


def span_of(adapter: LoraAdapter) -> tuple[int, int, int] | None:
    """`_span` of the adapter's tensors, computed once per module set: a 1000-module adapter costs ~2000
    tensor queries, and the RAM cache hands out the same tensors on every hit (`_fresh` and `align_paths`
    carry the result over to the new adapter objects they make)."""
    got = adapter.__dict__.get("_span")
    if got is None or got[0] is not adapter.modules or got[1] != len(adapter.modules):
        got = adapter.__dict__["_span"] = (adapter.modules, len(adapter.modules), _span(_tensors(adapter)))
    return got[2]


def known_span(adapter: LoraAdapter, span: tuple[int, int, int]) -> LoraAdapter:
    """Give `adapter` the span (buffer start, first byte, end byte) its maker knows (`span_of` would find it by
    asking every tensor); returns `adapter`."""
    adapter.__dict__["_span"] = (adapter.modules, len(adapter.modules), span)
    return adapter


def keep_span(old: LoraAdapter, new: LoraAdapter) -> LoraAdapter:
    """Give `new` (same module tensors as `old`, maybe other paths) `old`'s computed span; returns `new`."""
    got = old.__dict__.get("_span")
    if got is not None and got[0] is old.modules and got[1] == len(old.modules) == len(new.modules):
        new.__dict__["_span"] = (new.modules, len(new.modules), got[2])
    return new


def packed_pinned(adapter: LoraAdapter) -> bool:
    """Every tensor a contiguous view into one page-locked buffer (`pack_adapters`, or the file read pinned):
    ready for `stage`, no packing needed."""
    return next(iter(adapter.modules.values())).A.is_pinned() and span_of(adapter) is not None


def stage(adapter: LoraAdapter, device: torch.device | str, *, check_finite: bool = False) -> Staged | None:
    """One host-to-device transfer of a packed adapter (`pack_adapters`), or None if it is not packed.

    With `check_finite`, NaN/Inf are looked for on the device in one pass over the buffer (when it holds
    one dtype); the modules are then marked checked. A hit (possibly in alignment padding) is settled by
    the exact host check, which raises with the module's path.
    """
    span = span_of(adapter)
    if span is None:
        return None
    first = next(iter(adapter.modules.values())).A
    start, lo, hi = span  # only the bytes this adapter's tensors span (a file read pinned holds every component's)
    lo, hi = lo - start, hi - start
    host = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())[lo:hi]
    staged = Staged(host.to(device, non_blocking=host.is_pinned()), start + lo)
    if check_finite and not all(m.finite for m in adapter.modules.values()):
        tensors = _tensors(adapter)
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) == 1:
            size = tensors[0].element_size()
            ok = bool(torch.isfinite(staged.flat[: staged.flat.numel() // size * size].view(tensors[0].dtype)).all())
        else:
            ok = bool(torch.stack([torch.isfinite(staged.view(t)).all() for t in tensors]).all())
        if not ok:
            adapter.check_finite()  # raises with the module's path, unless the hit was padding
        for m in adapter.modules.values():
            m.finite = True
    return staged


def to_device(adapter: LoraAdapter, device: torch.device | str, *, check_finite: bool = False) -> LoraAdapter:
    """`adapter` on `device`: one transfer when its tensors share one buffer (`pack_adapters`), else one each.
    With `check_finite`, NaN/Inf are looked for on the device (see `stage`)."""
    staged = stage(adapter, device, check_finite=check_finite)
    if staged is not None:
        move = staged.view
    else:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=t.is_pinned())

        if check_finite:
            adapter.check_finite()
    return LoraAdapter({p: m.replace(move(m.A), move(m.B), move(m.bias),  # (a DoRA magnitude is not packed)
                                     None if m.magnitude is None else m.magnitude.to(device),
                                     finite=True if check_finite else m.finite) for p, m in adapter.modules.items()},
                       adapter.use_rslora, adapter.name, adapter.provenance)
