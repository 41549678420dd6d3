"""Merged-weight cache: a blend-mode layer keeps W' = W + sum_s w_s B_s A_s and runs one GEMM.

Why: with the LoRA folded into a copy of the weight, a layer costs exactly one base GEMM ("merged
speed"), while the adapters stay unmerged in the bank and W stays untouched. Switching stays O(1) on
the host: `set_adapters` only writes the scale table, and each layer re-merges lazily on its next
forward (one lora_merge kernel: read W, write W').

Two ways to find out that W' is stale, one buffer:
- eager calls (`_FusedLora._cached` / `_merged_forward`): a host key (`blend_key`: the blend row's
  version, the bank versions of the slots it weighs, W's storage and version counter), so set_adapters,
  loads/deletes in those slots, fuse/unfuse and in-place edits of W all invalidate it (a load into a
  slot the blend does not weigh, such as a prefetch's publication, does not), and a fresh key costs one
  GEMM and no launch; the first stale layer re-merges every stale layer of its model in one launch
  (fdlora.layers.fastpath.remerge);
- calls that must not branch on the host: frozen (`handle.freeze()`), compiled, or being captured
  into a CUDA graph (`FusedLoraLinear._on_device_cache`). They call the opaque op fdlora::merged_linear,
  which launches lora_merge with a stamp every call: on the device it compares the blend weights and
  the bank's device version (bumped by every bank write) with what the buffer holds and returns at
  once if nothing changed, so a traced graph or a CUDA graph holds the same launches whatever the
  adapters, and a switch between replays is merged by the next replay. In-place edits of W outside
  fuse/unfuse are not seen there. A buffer a CUDA graph captured is pinned: never freed (only marked
  stale), since replays keep writing it.

Used for: blend mode, a plain nn.Linear (eager also transformers Conv1D and nn.Conv2d) base in the
bank's dtype (never a quantized or float8-stored weight: torchao, GGUF, bitsandbytes, layerwise casting;
see fdlora.layers.quant.quantized: those run base(x) + delta and hold no copy, so merge_cache_bytes() does not
grow), no autograd through W or x, and room in the byte budget of its device; the eager form also needs
no lora bias. Everything else, and per-sample / per-row calls, take the per-call paths.
Numerics: one rounding of W' to the weight dtype (PEFT's merge), bounded in tests by eager PyTorch's
own error, like the per-call "merged" path of fdlora.kernels.triton.forward.lora_linear.

Budget (bytes per device, `fdlora.set_merge_cache` or FDLORA_MERGE_CACHE): "auto" = 25% of a
CUDA device's memory, off on CPU; a byte count; a share such as "40%"; 0 turns it off. A layer
also never takes memory that would leave less than 1 GiB free on its GPU. Under
`torch.cuda.set_per_process_memory_fraction` both count what the process may use, not the device.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

import torch

from fdlora import env
from fdlora.errors import ConfigError, FdLoraError
from fdlora.kernels.ops.lora_merge import new_stamp
from fdlora.layers.state import lasting

logger = logging.getLogger("fdlora")
AUTO_SHARE = 0.25
KEEP_FREE = 1 << 30


def _total_memory(device: torch.device) -> int:
    """What this process may use of the device: a GPU's memory times the process's allowed fraction
    (`torch.cuda.set_per_process_memory_fraction`), or the host's RAM."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * torch.cuda.get_per_process_memory_fraction(device))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _free_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on a GPU: the device's free memory, and under a per-process fraction
    no more than the fraction's bytes less what torch's allocator has reserved."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1:
        free = min(free, int(total * fraction) - torch.cuda.memory_reserved(device))
    return free


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
        self.warned = -1  # generation of the last out-of-memory warning (one per generation)
        self.caches: weakref.WeakSet[MergedWeight] = weakref.WeakSet()
        self._lock = threading.Lock()

    def limit(self, device: torch.device) -> int:
        spec = self.spec
        if spec == "auto":
            return int(AUTO_SHARE * _total_memory(device)) if device.type == "cuda" else 0
        return int(spec * _total_memory(device)) if isinstance(spec, float) else int(spec)

    def enabled(self, device_type: str) -> bool:
        """Whether any layer on a device of this type may cache (plain reads: compiled code checks it)."""
        spec = self.spec
        return spec != 0 and (spec != "auto" or device_type == "cuda")

    def reserve(self, nbytes: int, device: torch.device) -> bool:
        with self._lock:
            used = self.used.get(device, 0)
            if used + nbytes > self.limit(device):
                return False
            if device.type == "cuda" and _free_memory(device) < nbytes + KEEP_FREE:
                return False
            self.used[device] = used + nbytes
            return True

    def release(self, nbytes: int, device: torch.device, room: bool = True) -> None:
        """Give bytes back; `room=False` for a reservation that was never used (no one else may retry for it)."""
        with self._lock:
            self.used[device] = max(0, self.used.get(device, 0) - nbytes)
            self.generation += room

    def set_limit(self, spec: int | float | str) -> None:
        self.spec = parse_limit(spec)
        for cache in list(self.caches):  # drop every copy; layers take room again under the new limit
            cache.release()
        self.generation += 1


BUDGET = MergeBudget()
PASS_HOLDERS: weakref.WeakSet = weakref.WeakSet()  # model states whose kept refresh (remerge) references buffers


def set_merge_cache(limit: int | float | str) -> int | float | str:
    """Byte budget per device for merged-weight copies: "auto" (25% of a GPU's memory, off on CPU),
    a byte count, a share of device memory (0.4 or "40%"), or 0 to turn the cache off. Existing
    copies are dropped; layers re-merge on their next call under the new limit. Returns the limit it
    replaces, so a caller can put it back."""
    previous = BUDGET.spec
    BUDGET.set_limit(limit)
    return previous


def merge_cache_bytes(device: torch.device | str | None = None) -> int:
    """Bytes of merged-weight copies held now (on `device`, or on all devices)."""
    if device is None:
        return sum(BUDGET.used.values())
    device = torch.device(device)
    return sum(v for d, v in BUDGET.used.items() if d.type == device.type and device.index in (None, d.index))


def merged_key(layer, W: torch.Tensor) -> tuple:
    """What any W' of the layer may depend on: the whole scale table, the whole bank, and W's storage and in-place
    edits (~1 us); per-prompt copies (other blends than the model's) and DoRA's W' key on it."""
    return (layer.state.table.version, layer.bank.version, W.data_ptr(), _version(W))


def blend_key(layer, W: torch.Tensor) -> tuple:
    """What the blend's W' depends on: the blend row (ScaleTable.blend_version), the slots it weighs (their bank
    versions), and W's storage and in-place edits; a load or delete in a slot the blend does not weigh keeps it.
    Same layout as merged_key: W's two entries last."""
    return blend_key_of(layer.state.table, layer.bank, W.data_ptr(), _version(W))


def blend_key_of(table, bank, ptr: int, version: int) -> tuple:
    """blend_key from its parts (remerge's slider replay has W's address and version at hand)."""
    return (table.blend_version, bank.live_versions(table.live), ptr, version)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter; fuse/unfuse invalidate explicitly
        return -1


class MergedWeight:
    """One layer's W' buffer, the host key it was merged under (eager calls), and its device stamp (the weights and
    bank version it holds, which compiled and captured calls check on the device)."""

    __slots__ = ("buf", "key", "stamp", "pinned", "denied", "groups", "kept", "hot", "rows", "_free", "__weakref__")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.key: tuple | None = None
        self.stamp: torch.Tensor | None = None  # int32 [S + 2] (fdlora.kernels.ops.lora_merge.new_stamp)
        self.pinned = False  # a CUDA graph captured the buffer: it is never freed (replays would write freed memory)
        self._free: weakref.finalize | None = None  # gives the bytes back once, on release or collection
        self.denied = -1  # budget generation at which a reservation failed (no retry until it changes)
        self.groups: dict[tuple, MergedWeight] = {}  # per-sample blend -> its copy, least recently used first
        self.kept: tuple | None = None  # (addresses, the stamped merge kept ready) of weight_on_device
        self.hot: tuple | None = None  # the layer's hot path (fdlora.layers.fastpath.hot): dropped with the buffer
        self.rows = 0  # rows per sample of its last cache-deciding call (fdlora.layers.fastpath.remerge.note_rows)
        BUDGET.caches.add(self)

    def _buffer(self, W: torch.Tensor) -> torch.Tensor | None:
        if self.buf is None:
            if self.denied == BUDGET.generation:
                return None
            if type(W) not in (torch.nn.Parameter, torch.Tensor) or W.element_size() < 2:
                # a quantized (torchao, GGUF) or float8-stored weight: never a dequantized copy (layers.quantized)
                self.denied = BUDGET.generation
                return None
            if not BUDGET.reserve(W.numel() * W.element_size(), W.device):
                self.denied = BUDGET.generation
                return None
            try:
                with lasting():  # written in place by later merges, whatever their mode
                    self.buf = torch.empty_like(W, memory_format=torch.contiguous_format)
            except torch.OutOfMemoryError:  # room in the budget, none in the allocator (fragmentation, other
                BUDGET.release(W.numel() * W.element_size(), W.device, room=False)  # processes): the per-call path
                self.denied = BUDGET.generation  # needs no copy; retried once the budget changes
                if BUDGET.warned != BUDGET.generation:
                    BUDGET.warned = BUDGET.generation
                    logger.warning("fd-lora: out of device memory for a merged copy of a %s weight: layers without "
                                   "one run the per-call kernels until memory is freed", tuple(W.shape))
                return None
            self._free = weakref.finalize(self, BUDGET.release, W.numel() * W.element_size(), W.device)
            self.key = self.stamp = None
        return self.buf

    def _stamp(self, layer) -> torch.Tensor:
        S = layer.bank.slots
        if self.stamp is None or self.stamp.shape[0] != S + 2:
            with lasting():
                self.stamp = new_stamp(S, self.buf.device)
        return self.stamp

    def _mark_stale(self) -> None:
        """The next stamped merge runs whatever the weights and bank version (W itself may have changed)."""
        self.key = None
        if self.stamp is not None:
            self.stamp[-2:-1].fill_(-1)  # the stamp's bank version: matches no bank

    def weight_on_device(self, layer, W: torch.Tensor) -> torch.Tensor | None:
        """W' for calls that must not decide on the host (compiled, captured, frozen): the merge launches every
        call and returns at once on the device unless the blend weights or the bank changed since it last ran.
        A call that is not being captured skips the launch while the host key still matches the last merge (eager,
        or stamped: launched in stream order after the state's device write), as a compiled graph run eagerly
        does every step: one launch less per layer. None if the budget has no room."""
        if self._buffer(W) is None:
            return None
        capturing = W.is_cuda and torch.cuda.is_current_stream_capturing()
        # the host key this merge holds; none under capture (replays re-merge without the host)
        key = None if capturing else blend_key(layer, W)
        if key is not None:
            if self.key == key:
                return self.buf
            if self.key is None or self.key[2:] != key[2:]:  # W replaced or edited in place: the stamp cannot tell
                self._mark_stale()
        b, stamp = layer.bank, self._stamp(layer)
        at = (self.buf.data_ptr(), W.data_ptr(), b.A.data_ptr(), b.B.data_ptr(), layer.scale_blend.data_ptr(),
              stamp.data_ptr())
        kept = self.kept
        if kept is not None and kept[0] == at and kept[1] is not None:
            kept[1]()  # the same launch, every argument bound: the check (and a merge if stale) on the device
        else:
            self.kept = (at, layer.prepare_merge(self.buf, W, stamp))
        self.key = key
        if capturing:
            self.pinned = True
        return self.buf

    def __deepcopy__(self, memo) -> MergedWeight:
        return MergedWeight()  # derived state: a copied layer merges its own W' (and counts it) on first use

    def __reduce__(self):
        return MergedWeight, ()

    def release_groups(self) -> None:
        """Give back the per-prompt copies (regenerable: a per-prompt call merges them again)."""
        for copy in self.groups.values():
            copy.release()
        self.groups = {}

    def release(self, groups: bool = True) -> None:
        """Give the buffer's bytes back to the budget (and the per-prompt copies', unless `groups` is False); a buffer
        a CUDA graph captured is kept and only marked stale (its next use re-merges: fuse / unfuse change W in place,
        which a replay then reads)."""
        self.hot = None
        if groups:
            self.release_groups()
        for st in list(PASS_HOLDERS):  # a kept refresh must neither keep this buffer alive nor write it
            st.fast_pass = None
        PASS_HOLDERS.clear()
        if self.pinned:
            self._mark_stale()
            return
        self.buf = self.key = self.stamp = self.kept = None
        if self._free is not None:
            self._free()
            self._free = None


# --- the compile- and graph-safe form: one opaque op --------------------------------------------------------

_LAYERS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_BY_BANK: dict[int, weakref.ref] = {}  # the bank's A storage address -> its layer (rebuilt when a lookup misses)


def bind(layer) -> None:
    """Make `layer` findable by fdlora::merged_linear (through its bank, see layer_of)."""
    _LAYERS.add(layer)


def layer_of(A: torch.Tensor):
    """The live layer whose bank is `A`. The op finds its layer through a tensor it is given anyway, not through an
    integer argument: a per-layer integer would be a constant of the traced graph, guarded per block instance, so
    diffusers' regional compilation (one graph for all instances of a block) would recompile for every block."""
    ref = _BY_BANK.get(A.data_ptr())
    layer = None if ref is None else ref()
    if layer is None or layer.bank.A.data_ptr() != A.data_ptr():
        _BY_BANK.clear()
        _BY_BANK.update({lay.bank.A.data_ptr(): weakref.ref(lay) for lay in list(_LAYERS)})
        ref = _BY_BANK.get(A.data_ptr())
        layer = None if ref is None else ref()
    return layer


@torch.library.custom_op("fdlora::merged_linear", mutates_args=())
def merged_linear(
    x: torch.Tensor,  # [M, K]
    W: torch.Tensor,  # [N, K] the base nn.Linear weight
    bias: torch.Tensor | None,  # [N]
    A: torch.Tensor,  # [S, R, K] the layer's bank (also how the op finds the layer: layer_of)
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32 blend weights
    ranks: torch.Tensor,  # [S] int32
) -> torch.Tensor:  # [M, N]
    """y = x W'^T + bias from the layer's merged-weight buffer, re-merged on the device only when stale; the
    layer's per-call path when the budget has no room. Opaque to torch.compile (its graph holds one call per
    layer, whatever the adapters); in CUDA graphs the stamp check replays with it, so a switch made between
    replays is merged by the next one."""
    layer = layer_of(A)
    if layer is None:
        raise FdLoraError("fdlora::merged_linear: no live fd-lora layer owns this bank; call it through the layer.")
    w = layer.merged.weight_on_device(layer, W)
    if w is None:
        return layer.per_call_linear(x, W, bias, A, B, scale, ranks)
    return torch.nn.functional.linear(x, w, bias)


@merged_linear.register_fake
def _(x, W, bias, A, B, scale, ranks):
    return x.new_empty(x.shape[0], W.shape[0])
