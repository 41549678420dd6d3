"""Merged-weight cache: an eager blend-mode layer keeps W' = W + sum_s w_s B_s A_s and runs one GEMM.

Why: with the LoRA folded into a copy of the weight, a layer costs exactly one base GEMM ("merged
speed") and one host call, while the adapters stay unmerged in the bank and W stays untouched.
Switching stays O(1) on the host: `set_adapters` only bumps the scale table's version, and each
layer re-merges lazily on its next forward (one lora_merge kernel: read W, write W').

When a layer uses it (`_FusedLora._cached` / `_merged_forward`): blend mode with something active, eager (not
compiled, not frozen, not being captured into a CUDA graph: those need the per-call paths whose
graphs do not change with a switch), a plain nn.Linear, transformers Conv1D or nn.Conv2d base in
the bank's dtype, no lora bias, and room in the byte budget of its device. Everything else takes the per-call paths.

The cache is keyed by (scale table version, bank version, W's storage and version counter), so
set_adapters, loading/deleting adapters, fuse/unfuse and in-place edits of the base weight all
invalidate it. Numerics: one rounding of W' to the weight dtype (PEFT's merge), bounded in tests
by eager PyTorch's own error, like the per-call "merged" path of fdlora.kernels.triton.lora_linear.

Budget (bytes per device, `fdlora.set_merge_cache` or FDLORA_MERGE_CACHE): "auto" = 25% of a
CUDA device's memory, off on CPU; a byte count; a share such as "40%"; 0 turns it off. A layer
also never takes memory that would leave less than 1 GiB free on its GPU.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch

from .. import env
from ..errors import ConfigError

AUTO_SHARE = 0.25
KEEP_FREE = 1 << 30


def _total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_limit(spec: int | float | str) -> int | float | str:
    """"auto", bytes (int >= 0), or a share of device memory (float in (0, 1], or "NN%")."""
    if isinstance(spec, str):
        s = spec.strip().lower()
        try:
            if s == "auto":
                return s
            if s.endswith("%"):
                return parse_limit(float(s[:-1]) / 100)
            return parse_limit(int(float(s)))
        except (ValueError, ConfigError):
            pass
    elif isinstance(spec, bool):
        pass
    elif isinstance(spec, int) and spec >= 0:
        return spec
    elif isinstance(spec, float) and 0 < spec <= 1:
        return spec
    raise ConfigError(f"merge cache limit {spec!r} is not valid; give \"auto\", a byte count such as 8e9, a share "
                      "such as \"25%\", or 0 to turn the merged-weight cache off.")


class MergeBudget:
    """Bytes of merged-weight copies per device, under one limit."""

    def __init__(self) -> None:
        self.spec: int | float | str = parse_limit(env.merge_cache_limit())
        self.used: dict[torch.device, int] = {}
        self.generation = 0  # bumped when room may have appeared (limit change, release)
        self.caches: weakref.WeakSet[MergedWeight] = weakref.WeakSet()
        self._lock = threading.Lock()

    def limit(self, device: torch.device) -> int:
        spec = self.spec
        if spec == "auto":
            return int(AUTO_SHARE * _total_memory(device)) if device.type == "cuda" else 0
        return int(spec * _total_memory(device)) if isinstance(spec, float) else int(spec)

    def reserve(self, nbytes: int, device: torch.device) -> bool:
        with self._lock:
            used = self.used.get(device, 0)
            if used + nbytes > self.limit(device):
                return False
            if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < nbytes + KEEP_FREE:
                return False
            self.used[device] = used + nbytes
            return True

    def release(self, nbytes: int, device: torch.device) -> None:
        with self._lock:
            self.used[device] = max(0, self.used.get(device, 0) - nbytes)
            self.generation += 1

    def set_limit(self, spec: int | float | str) -> None:
        self.spec = parse_limit(spec)
        for cache in list(self.caches):  # drop every copy; layers take room again under the new limit
            cache.release()
        self.generation += 1


BUDGET = MergeBudget()


def set_merge_cache(limit: int | float | str) -> None:
    """Byte budget per device for merged-weight copies: "auto" (25% of a GPU's memory, off on CPU),
    a byte count, a share of device memory (0.4 or "40%"), or 0 to turn the cache off. Existing
    copies are dropped; layers re-merge on their next call under the new limit."""
    BUDGET.set_limit(limit)


def merge_cache_bytes(device: torch.device | str | None = None) -> int:
    """Bytes of merged-weight copies held now (on `device`, or on all devices)."""
    if device is None:
        return sum(BUDGET.used.values())
    device = torch.device(device)
    return sum(v for d, v in BUDGET.used.items() if d.type == device.type and device.index in (None, d.index))


def merged_key(layer, W: torch.Tensor) -> tuple:
    """What W' depends on: the scale table, the bank, and W's storage and in-place edits (~1 us)."""
    return (layer.state.table.version, layer.bank.version, W.data_ptr(), _version(W))


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter; fuse/unfuse invalidate explicitly
        return -1


class MergedWeight:
    """One layer's W' buffer and the key it was merged under."""

    __slots__ = ("buf", "key", "denied", "_free", "__weakref__")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.key: tuple | None = None
        self._free: weakref.finalize | None = None  # gives the bytes back once, on release or collection
        self.denied = -1  # budget generation at which a reservation failed (no retry until it changes)
        BUDGET.caches.add(self)

    def weight(self, layer, W: torch.Tensor) -> torch.Tensor | None:
        """W' for `layer`'s current blend (W: its base weight), merging if anything changed; None if the
        budget has no room."""
        if self.buf is None:
            if self.denied == BUDGET.generation:
                return None
            if not BUDGET.reserve(W.numel() * W.element_size(), W.device):
                self.denied = BUDGET.generation
                return None
            self.buf = torch.empty_like(W, memory_format=torch.contiguous_format)
            self._free = weakref.finalize(self, BUDGET.release, W.numel() * W.element_size(), W.device)
            self.key = None
        key = merged_key(layer, W)
        if key != self.key:
            layer.merge_into(self.buf, W)
            self.key = key
        return self.buf

    def __deepcopy__(self, memo) -> MergedWeight:
        return MergedWeight()  # derived state: a copied layer merges its own W' (and counts it) on first use

    def __reduce__(self):
        return MergedWeight, ()

    def release(self) -> None:
        """Give the buffer's bytes back to the budget."""
        self.buf = self.key = None
        if self._free is not None:
            self._free()
            self._free = None
