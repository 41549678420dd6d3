"""State shared by every fused layer of one model: slot names, the scale table, the mode.

The scale table is what makes switching O(1). Host side it is two small fp32 matrices,
`scaling[L, S]` (alpha/r of slot s in layer l, 0 where the adapter does not touch l) and the
user's `weights[S]` (or `[L, S]` for block-wise weights). Device side it is one fp32 tensor per
device, `table[2, L, S]`:

    table[0, l] = weights * scaling[l] * multiplier    (blend mode: the layer's per-slot scale)
    table[1, l] = scaling[l] * multiplier             (per-sample / per-row modes)

Every layer holds views `table[0, l]` and `table[1, l]`, so `set_adapters` is one host
multiply and one copy per device, whatever the number of layers or of loaded adapters.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import weakref
from collections.abc import Iterator

import torch

from ..errors import CapacityError, DuplicateAdapterError, FdLoraError, UnknownAdapterError


@contextlib.contextmanager
def lasting() -> Iterator[None]:
    """Around the making of a tensor fd-lora keeps and writes in place later (banks, scale tables, merged copies and
    their stamps, per-sample weights, row slots, captured steps' inputs): it is a normal tensor whatever mode the
    caller runs in. One made under torch.inference_mode would be an inference tensor, which no in-place write outside
    inference mode may touch (and which has no version counter); a normal tensor is written in either mode."""
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


def to_device(src: torch.Tensor, device: torch.device | str, dst: torch.Tensor | None = None) -> torch.Tensor:
    """A small host tensor onto `device` (into `dst` when given) without waiting for the GPU: a copy from pageable
    memory blocks the host until the stream has run everything queued before it, so a set_adapters or a
    per-prompt call before every step would cost the host its lead over the GPU (the step became host time plus
    the GPU's backlog). Through the caching pinned allocator (blocks are not reused before their copy ran)."""
    device = torch.device(device)
    if device.type == "cuda" and src.device.type == "cpu":
        src = src.pin_memory()
    if dst is None:
        with lasting():  # (an inference tensor is copied even onto its own device)
            return src.to(device, non_blocking=True, copy=src.is_inference())
    return dst.copy_(src, non_blocking=True)


class Mode(enum.Enum):
    OFF = "off"  # base only
    BLEND = "blend"  # active slots as one rank-sum adapter
    SAMPLES = "samples"  # per-sample weights [G, S], rows grouped contiguously
    ROWS = "rows"  # per-row slot index (LLM mixed batches)


class CopyableLock:
    """A re-entrant lock that deep copies (and pickles) as a fresh lock, so models and pipes stay copyable."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc) -> None:
        self._lock.__exit__(*exc)

    def __deepcopy__(self, memo) -> CopyableLock:
        return CopyableLock()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._lock = threading.RLock()


class SlotTable:
    """Adapter name <-> slot index."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.by_name: dict[str, int] = {}

    def free(self) -> list[int]:
        used = set(self.by_name.values())
        return [s for s in range(self.capacity) if s not in used]

    def check_name(self, name: str) -> None:
        if name in self.by_name:
            raise DuplicateAdapterError(
                f"an adapter named {name!r} is already loaded; delete it first or pick another adapter_name."
            )

    def check_new(self, name: str) -> int:
        """A free slot for a new adapter `name` (raises if the name is taken or every slot is used)."""
        self.check_name(name)
        free = self.free()
        if not free:
            raise CapacityError(
                f"all {self.capacity} adapter slots are in use ({', '.join(self.by_name)}); delete an adapter, "
                f"or raise max_slots (fdlora.inject(..., max_slots=N) or handle.grow(max_slots=N))."
            )
        return free[0]

    def slot(self, name: str) -> int:
        try:
            return self.by_name[name]
        except KeyError:
            loaded = ", ".join(map(repr, self.by_name)) or "none"
            raise UnknownAdapterError(f"no adapter named {name!r} is loaded (loaded: {loaded}).") from None


class ScaleTable:
    def __init__(self, layers: int, slots: int) -> None:
        with lasting():
            self.scaling = torch.zeros(layers, slots)
            self.weights = torch.zeros(slots)  # [S] or [L, S]
        self.multiplier = 1.0
        self._device: dict[torch.device, torch.Tensor] = {}
        self._lock = CopyableLock()
        self.version = 0  # bumped on every device write
        # replaced on every change of this table or of its model's state (fdlora.layers.fastpath.hot)
        self.token = object()
        # the blend row's own version and the slots it weighs: what a blend's merged copies key on (layers.merged).
        # A load or delete in a slot the blend gives weight 0 changes neither, so publishing a prefetched adapter
        # does not re-merge every layer of a serving model.
        self.blend_version = 0
        self.live: tuple[int, ...] = ()
        self._blend: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.scaling.shape)  # type: ignore[return-value]

    def host(self) -> torch.Tensor:
        blend = self.scaling * self.weights * self.multiplier
        return torch.stack([blend, self.scaling * self.multiplier])

    def on(self, device: torch.device) -> torch.Tensor:
        """The [2, L, S] table on `device` (created on first use)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        t = self._device.get(device)
        if t is None:
            t = self._device[device] = to_device(self.host(), device)
        return t

    def flush(self) -> None:
        """Write the host state to every device table: one small copy per device."""
        with self._lock:
            host = self.host()
            for t in self._device.values():
                to_device(host, t.device, t)
            self._note_blend(host[0])
            self.version += 1
            self.token = object()

    def _note_blend(self, blend: torch.Tensor) -> None:
        """Bump blend_version and list the live slots when the blend row [L, S] changed."""
        if self._blend is not None and self._blend.shape == blend.shape and torch.equal(self._blend, blend):
            return
        self._blend = blend
        self.blend_version += 1
        self.live = tuple(torch.nonzero((blend != 0).reshape(-1, blend.shape[-1]).any(0)).flatten().tolist())

    def resize(self, layers: int, slots: int) -> None:
        L0, S0 = min(layers, self.shape[0]), min(slots, self.shape[1])  # (smaller: a failed wrap or grow undone)
        with lasting():
            scaling = torch.zeros(layers, slots)
            scaling[:L0, :S0] = self.scaling[:L0, :S0]
            if self.weights.dim() == 1:
                weights = torch.zeros(slots)
                weights[:S0] = self.weights[:S0]
            else:
                weights = torch.zeros(layers, slots)
                weights[:L0, :S0] = self.weights[:L0, :S0]
        self.scaling, self.weights = scaling, weights
        self._device = {d: to_device(self.host(), d) for d in self._device}
        self._blend = None
        self._note_blend(self.host()[0])
        self.version += 1
        self.token = object()


# attributes whose writes change no output
_BOOKKEEPING = frozenset({"fast_pass", "merge_tables", "members", "_members", "_tokens", "_sample_host"})
_VALUES = (bool, int, float, str, type(None), enum.Enum)  # compared by value in a state's token key, others by identity
_TOKENS_KEPT = 8


class LayerDict(dict):
    """A dict of fused layers that can be referenced weakly (ModelState.members)."""


class ModelState:
    """Everything the fused layers of one model share. Layers read it; the handle writes it."""

    def __init__(self, layers: int, slots: int) -> None:
        self.slots = SlotTable(slots)
        self.table = ScaleTable(layers, slots)
        self.mode = Mode.BLEND
        self.enabled = True
        self.active: dict[str, float] = {}
        self.static = False  # True once frozen for torch.compile / CUDA graphs: no host-side shortcuts
        self.layout_version = 0  # bumped when tables reallocate; layers re-point their views
        self._group_weight: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._row_slot: dict[torch.device, torch.Tensor] = {}
        self._rows_host: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}  # batch -> sample_rows' host form
        self._rows_dev: dict[tuple[int, torch.device], tuple] = {}
        self._ones: dict[torch.device, torch.Tensor] = {}
        self._blend_rows: dict[tuple, torch.Tensor] = {}  # (rows, device, slot) -> row slots of blend_rows
        self._row_onehot: dict[torch.device, tuple] = {}  # device -> (row slots, their version, S, [M, S] weights)
        self.groups: dict[int, SampleGroups] = {}  # batch size -> how its samples group by blend (per-sample mode)
        self.members = LayerDict()  # path -> fused layer: the handle's own dict (the cache re-merges them all)
        self.merge_tables: dict = {}  # (device, dtype, S, R) -> kept table of fdlora.layers.fastpath.remerge
        self.epoch = 0  # bumped by the handle whenever layers or banks change (wrap, load, delete, resize)
        self.fast_pass = None  # the last full refresh, replayed while only blend weights change (remerge)

    @property
    def members(self) -> dict:
        """The handle's layers (path -> fused layer), held weakly: the layers hold this state, so a strong reference
        back would make a cycle that only a garbage collection frees (with the model's weights and merged copies)."""
        got = self.__dict__["_members"]()
        return {} if got is None else got

    @members.setter
    def members(self, layers: LayerDict) -> None:
        self.__dict__["_members"] = weakref.ref(layers)

    def __getstate__(self) -> dict:  # copies and pickles carry the layers dict itself, held weakly on the other side
        return {**self.__dict__, "_members": self.__dict__["_members"]()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.members = state["_members"] if state["_members"] is not None else LayerDict()

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name not in _BOOKKEEPING:
            self._retoken()

    def _retoken(self) -> None:
        """The token layers' hot paths (fdlora.layers.fastpath.hot) key on, after an attribute write: the token this
        exact state had before when it is one of the last few (the same values and the same objects: a per-call
        `adapter_names` spec entered and left every step, identical specs reusing their objects, set_sample_weights),
        else a new one. The entries hold the objects they name, so no id is reused while it is remembered."""
        d = self.__dict__
        table = d.get("table")
        if table is None:
            return
        key = (table.version, *((k, v if isinstance(v, _VALUES) else id(v)) for k, v in d.items()
                                if k not in _BOOKKEEPING))
        seen = d.setdefault("_tokens", [])
        for entry in seen:
            if entry[0] == key:
                table.token = entry[2]
                return
        table.token = object()
        seen.append((key, [v for k, v in d.items() if k not in _BOOKKEEPING], table.token))
        del seen[:-_TOKENS_KEPT]

    def touch(self) -> None:
        """Every layer's hot path is invalid from now on, and no earlier token comes back: for in-place edits of
        the state's dicts and tensors (attribute writes go through __setattr__)."""
        self.__dict__["_tokens"] = []
        table = self.__dict__.get("table")
        if table is not None:
            table.token = object()

    def any_active(self) -> bool:
        return bool(self.active)

    def ones(self, device: torch.device) -> torch.Tensor:
        """[1, S] group weight for blend mode."""
        t = self._ones.get(device)
        if t is None or t.shape[1] != self.slots.capacity:
            with lasting():
                t = self._ones[device] = torch.ones(1, self.slots.capacity, device=device)
        return t

    def set_sample_weights(self, by_batch: dict[int, torch.Tensor]) -> None:
        """Per-sample weights for the next calls: batch size -> [G, S] (G samples, rows of each contiguous).

        A layer whose input has batch size B uses the entry for B; several entries let one call serve
        the differently sized batches of one pipeline run (prompts, images per prompt, CFG halves).
        Same-shaped entries are rewritten in place, so compiled graphs stay valid. The same weights as the current
        ones change nothing (a per-call spec repeated every step keeps the layers' hot paths:
        fdlora.layers.fastpath.hot).
        """
        host = {b: gw.detach().to("cpu", torch.float32, copy=True) for b, gw in by_batch.items()}
        last = self.__dict__.get("_sample_host")
        if (last is not None and last.keys() == host.keys()
                and all(last[b].shape == h.shape and torch.equal(last[b], h) for b, h in host.items())):
            return
        self.__dict__["_sample_host"] = host
        # every device the layers run on (the scale table's copies), created now rather than at a layer's first call:
        # a captured step keys on these tensors, and one made during the first capture would make the second call of
        # the same layout capture again (fdlora.layers.fastpath.captured)
        devices = ({d for (_, d) in self._group_weight} | set(self.table._device)
                   or {next(iter(by_batch.values())).device})
        fresh = {}
        for b, gw in by_batch.items():
            for d in devices:
                t = self._group_weight.get((b, d))
                if t is not None and t.shape == gw.shape:
                    fresh[(b, d)] = to_device(gw, d, t)
                else:
                    fresh[(b, d)] = to_device(gw.to(torch.float32), d)
        self._group_weight = fresh
        self._rows_host = {b: as_rows(gw.cpu()) for b, gw in by_batch.items()}
        self._rows_dev = {}
        groups = {}
        for b, gw in by_batch.items():  # the same grouping object while the specs repeat (layers key on it)
            rows, old = gw.tolist(), self.groups.get(b)
            groups[b] = old if old is not None and old.rows == rows else SampleGroups.of(rows)
        self.groups = groups

    def group_weight(self, batch: int, rows: int, device: torch.device) -> torch.Tensor | None:
        """The [G, S] weights for an input of `batch` samples and `rows` flattened rows, or None."""
        t = self._group_weight.get((batch, device))
        if t is None:
            keys = {b for (b, _) in self._group_weight}
            if batch not in keys and batch not in (1, rows) and any(rows == batch * k for k in keys):
                raise FdLoraError(  # e.g. ERNIE-Image's MLP on [S, B, H]: contiguous rows are not one sample's
                    f"per-sample adapters for batch sizes {sorted(keys)} reached a layer whose input is not "
                    f"batch-first ({batch} x {rows // batch} rows: the batch is not its first dimension), so its rows "
                    "do not group by sample. This model cannot take per-prompt adapters; use a blend (set_adapters) "
                    "for the whole batch, or one prompt per adapter.")
            if batch not in keys and len(keys) == 1 and rows % next(iter(keys)) == 0:
                batch = next(iter(keys))  # flattened [M, K] (or packed [1, M, K]) input whose rows group by sample
            elif batch not in keys:
                return None
            src = next(v for (b, _), v in self._group_weight.items() if b == batch)
            t = self._group_weight[(batch, device)] = to_device(src, device)
        return t

    def blend_rows(self, rows: int, device: torch.device) -> torch.Tensor | None:
        """[rows] int32, every row on the one active adapter's slot, when blend mode has exactly one adapter
        active (eager decode without the merged-weight cache runs it as per-row: fdlora.layers.fastpath.decode); else
        None."""
        if len(self.active) != 1 or not self.enabled:
            return None
        slot = self.slots.by_name[next(iter(self.active))]
        key = (rows, device, slot)
        t = self._blend_rows.get(key)
        if t is None:
            with lasting():
                t = self._blend_rows[key] = torch.full((rows,), slot, dtype=torch.int32, device=device)
        return t

    def set_row_slot(self, rs: torch.Tensor) -> None:
        for d in list(self._row_slot) or [rs.device]:
            t = self._row_slot.get(d)
            if t is None or t.shape != rs.shape:
                self._row_slot[d] = to_device(rs.to(torch.int32), d)
                self.touch()  # (a new tensor: kept launches bound the old one; in place, they read the new slots)
            else:
                to_device(rs, d, t)

    def row_slot(self, device: torch.device) -> torch.Tensor:
        t = self._row_slot.get(device)
        if t is None:
            src = next(iter(self._row_slot.values()))
            t = self._row_slot[device] = to_device(src, device)
        return t

    def row_onehot(self, device: torch.device, slots: int) -> torch.Tensor:
        """[M, slots] fp32, 1 where row m's adapter is slot s: the per-row weights every member of a ShrinkGroup
        (fdlora.layers.modules.shared_shrink) expands with. Built once for as long as the row slots stay what they are
        (the same tensor, by identity, at the same version: set_row_slot writes in place or makes a new one), not once
        per group and step: two launches fewer per group (Llama-3-8B has 64 groups, q/k/v and gate/up in 32 layers).
        Eager only (ShrinkGroup never runs compiled): the version check reads a tensor's version counter."""
        rs = self.row_slot(device)
        got = self._row_onehot.get(device)
        if got is None or got[0] is not rs or got[1] != rs._version or got[2] != slots:
            w = (rs[:, None] == torch.arange(slots, dtype=rs.dtype, device=device)).float()
            got = self._row_onehot[device] = (rs, rs._version, slots, w)
        return got[3]

    def token_weights(self, rows: int, device: torch.device) -> torch.Tensor | None:
        """[rows, S] fp32 slot weights of each of `rows` batch-major token rows in the per-row (one-hot of its slot)
        and per-sample (its sample's weights) modes, None in the other modes (every row alike). What follows the
        tokens through a MoE layer's routing (fdlora.layers.modules.moe_experts, fdlora.layers.modules.moe_routed)."""
        if self.mode is Mode.ROWS:
            rs = self.row_slot(device)
            if rs.shape[0] != rows:
                raise FdLoraError(f"{rs.shape[0]} per-row adapters given for {rows} token rows.")
            return (rs.long()[:, None] == torch.arange(self.slots.capacity, device=device)).float()
        if self.mode is Mode.SAMPLES:
            gw = self.group_weight(rows, rows, device)
            if gw is None or rows % gw.shape[0]:
                given = sorted({b for (b, _) in self._group_weight})
                raise FdLoraError(f"per-sample adapters were given for batch sizes {given}, but a MoE layer got {rows} "
                                  "token rows; give one entry per sample of the batch.")
            return gw.float().repeat_interleave(rows // gw.shape[0], dim=0)
        return None

    @contextlib.contextmanager
    def gathered(self, weights: torch.Tensor | None) -> Iterator[None]:
        """Within the block, layers see inputs whose rows are the tokens with slot weights `weights` [n, S] (a
        routed expert's token group: fdlora.layers.modules.moe_routed), as per-sample weights with one sample per row.
        None (blend / off) changes nothing."""
        if weights is None:
            yield
            return
        kept = (self.mode, self._group_weight, self._rows_host, self._rows_dev, self.groups)
        self.mode = Mode.SAMPLES
        self._group_weight = {(weights.shape[0], weights.device): weights}
        self._rows_host, self._rows_dev, self.groups = {}, {}, {}
        try:
            yield
        finally:
            self.mode, self._group_weight, self._rows_host, self._rows_dev, self.groups = kept

    def sample_rows(self, batch: int, device: torch.device) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The per-sample weights of `batch` samples as per-row slots, when every sample has at most one
        adapter and every adapter one weight (PEFT's adapter_names): (row_slot [G] int32, per layer its [S]
        fp32 scales alpha/r * weight), on `device`; made once per set_sample_weights and table version.
        None for specs with blends or one adapter at several weights."""
        host = self._rows_host.get(batch)
        if host is None or host[1].shape[0] != self.table.shape[1]:  # (a grow since: the regular path)
            return None
        got = self._rows_dev.get((batch, device))
        if got is None or got[0] != self.table.version:
            rs, w = host
            scales = to_device(self.table.scaling * self.table.multiplier * w, device)  # [L, S]
            got = self._rows_dev[(batch, device)] = (self.table.version, to_device(rs, device), scales.unbind(0))
        return got[1], got[2]


def as_rows(gw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[G, S] per-sample weights -> (slot of each sample [G] int32, -1 for none; weight of each slot [S]), or
    None when a sample blends adapters or an adapter has different weights in different samples."""
    on = gw != 0
    if gw.shape[0] == 0 or bool((on.sum(1) > 1).any()):
        return None
    w = gw[on.int().argmax(0), torch.arange(gw.shape[1])] * on.any(0)  # each slot's weight in its first sample
    if not bool(torch.where(on, gw == w, True).all()):
        return None
    return torch.where(on.any(1), on.int().argmax(1), -1).to(torch.int32), w


class SampleGroups:
    """How the samples of a per-sample batch group by blend, for running each group on its own merged weight
    (fdlora.layers.fastpath.remerge.refresh_groups): the distinct blends, each sample's blend, the runs of consecutive
    samples that share one, and the shortest period of that sequence (diffusers' CFG batches [uncond..., cond...]
    repeat the prompts' blends: one strided batched GEMM per prompt position then serves both halves)."""

    __slots__ = ("rows", "blends", "of_sample", "runs", "period")

    def __init__(self, rows: list[list[float]], blends: list[tuple], of_sample: list[int]) -> None:
        self.rows, self.blends, self.of_sample = rows, blends, of_sample
        G = len(of_sample)
        self.runs = [(i, j, of_sample[i]) for i, j in _runs(of_sample)]
        self.period = next(p for p in range(1, G + 1) if G % p == 0 and of_sample == of_sample[:p] * (G // p))

    def jobs(self, rows: int) -> list[tuple[int, int, int, int, int]]:
        """The GEMMs of a batch with `rows` rows per sample, as (blend, first row, rows, count, stride): `count`
        blocks of `rows` rows, `stride` rows apart, all on one blend's weight. A periodic batch (CFG) gives one job
        per position of the period (its blocks in every period); any other, one job per run of samples."""
        G, P = len(self.of_sample), self.period
        if P < len(self.runs):
            return [(self.of_sample[p], p * rows, rows, G // P, P * rows) for p in range(P)]
        return [(g, s0 * rows, (s1 - s0) * rows, 1, 0) for s0, s1, g in self.runs]

    @classmethod
    def of(cls, rows: list[list[float]]) -> SampleGroups:
        blends = list(dict.fromkeys(tuple(r) for r in rows))
        return cls(rows, blends, [blends.index(tuple(r)) for r in rows])


def _runs(seq: list[int]) -> list[tuple[int, int]]:
    starts = [i for i in range(len(seq)) if i == 0 or seq[i] != seq[i - 1]]
    return list(zip(starts, starts[1:] + [len(seq)]))
