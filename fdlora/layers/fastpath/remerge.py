"""Re-merge every stale cached layer of a model at once: the eager merged-weight cache's refresh.

Why: a switch or a slider move makes every cached layer stale together. Re-merged lazily one layer at a time,
each layer paid a launch and its host work inside the step (SDXL: 722 launches; a slider moved every step cost
2.8x the base step). Here the first layer that finds its copy stale refreshes the whole model: it lists the
stale layers (one host key compare each), gives buffers to layers that have none — most saved per byte of copy
first (`benefit`), so a budget that cannot hold every layer goes where a copy saves the most — and merges them with one
lora_merge_many launch per (device, dtype, bank shape), from W, never from W' (nothing drifts). Layers whose
backend has no lora_merge_many (the torch reference, conv layers) merge one by one.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from fdlora.layers.fastpath import hot
from fdlora.layers.fastpath.merged import (
    BUDGET,
    PASS_HOLDERS,
    MergedWeight,
    _version,
    blend_key,
    blend_key_of,
    merged_key,
)
from fdlora.layers.state import Mode, to_device
from fdlora.layers.storage import offload


def mergeable(layer, device: torch.device) -> bool:
    """Whether a merged copy of W may serve this layer now, whoever merges it: blend mode, a plain base in the
    bank's dtype on `device`, something loaded, no lora bias (the cached GEMM adds none), not offloaded."""
    bank = layer.bank
    return (layer.plain_now() and bank.A.device == device and bank._buffers["bias"] is None and True in bank.used
            and layer.state.mode is Mode.BLEND
            and offload.current(layer))  # not offloaded behind the layer's back (fdlora.layers.storage.offload)


def cacheable(layer, device: torch.device) -> bool:
    """Whether the eager cache of the kernels' merge (W + Σ s B A) serves this layer now: `mergeable` and no DoRA
    slot (fdlora.layers.modules.dora merges its own W')."""
    return mergeable(layer, device) and layer.bank._buffers["magnitude"] is None


def entry(layer, out: torch.Tensor, W: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(W' [N, K], W [N, K], A [S, R, K], B [N, S, R], scale [S], ranks [S]) as 2-D / 3-D views of the layer's
    weight layout (Linear [N, K]; transformers Conv1D [K, N], merged through its transpose; Conv2d flattened)."""
    b = layer.bank
    A, N = b.A, layer.out_features
    if layer.kind == "conv2d":
        return out.view(N, -1), W.reshape(N, -1), A.reshape(A.shape[0], A.shape[1], -1), b.B, scale, b.ranks
    if W.shape[0] != N:  # Conv1D
        return out.t(), W.t(), A, b.B, scale, b.ranks
    return out, W, A, b.B, scale, b.ranks


# What a per-call layer pays besides its GEMM, beyond the bytes: its shrink and expand launches with their host work,
# as the CUDA backend's cost model counts them (10e6 bytes-equivalent a launch, H100 host; csrc/ops.cpp merged_wins).
PER_CALL_FIXED_BYTES = 20e6


def note_rows(layer, x: torch.Tensor) -> None:
    """Remember the rows per sample of this call (tokens of a [B, T, K] input, pixels of an NCHW one, 1 for a 2-D
    input), which `benefit` weighs copies by: within one model, the layers' relative row counts (Flux-dev's text
    stream runs 512 tokens per sample beside the image stream's 4096) hold across batch sizes."""
    shape = x.shape
    if len(shape) > 2:
        layer.merged.rows = x.numel() // (shape[0] * (shape[1] if layer.kind == "conv2d" else shape[-1]))


def benefit(layer, W: torch.Tensor) -> float:
    """Bytes a merged copy of W saves per call, per byte of the copy: a per-call layer pays a fixed launch and host
    cost plus M (K + 2N) elements (x read, y read and written by the expand), the copy N K elements. Rows not seen
    yet count as 0 (then the smallest weights come first, as the fixed cost dominates)."""
    N = layer.out_features
    K = W.numel() // N
    return (PER_CALL_FIXED_BYTES / W.element_size() + layer.merged.rows * (K + 2 * N)) / (N * K)


def refresh(layer, W: torch.Tensor) -> torch.Tensor | None:
    """W' of `layer` for the current blend, after re-merging every stale cached layer of its model; None when the
    budget gives `layer` no buffer."""
    device = layer.bank.A.device
    st = layer.state
    if not _replay(st, device):
        _full(layer, device)
    m = layer.merged
    return m.buf if m.buf is not None and m.key == blend_key(layer, W) else None


def _replay(st, device: torch.device) -> bool:
    """The slider's fast path: while no layer, bank, buffer or budget changed since the last full refresh, only the
    blend weights can have, so every layer of that refresh re-merges with the same launches; each layer's check is
    a few attribute reads (the full pass lists, keys and batches every layer again). False if anything else moved."""
    kept = st.fast_pass
    if kept is None or kept[0] != (st.epoch, device, BUDGET.generation, st.mode):
        return False
    # Launched before the per-layer checks, so the GPU merges while the host checks: launched after them, the GPU
    # idled through the loop (Flux-dev, 418 layers: the slider step paid ~5 ms more than its merge on the
    # H100). Safe whatever the checks find: the calls hold every tensor they read or write (a weight replaced
    # under a layer is still the old one there; the kernels take addresses afresh on each launch), and a failed
    # check leaves the keys stale, so the full pass merges those layers again.
    for call in kept[2]:
        call()
    items = kept[1]
    table = st.table
    # One pass: each layer that passes its check holds the new blend (its merge ran on these tensors) and takes the
    # new key; at the first failure the rest keep their old keys, so the full pass merges them again.
    for ref, m, w, ptr, bank in items:
        lay = ref()
        if (lay is None or m.buf is None or lay.base._parameters["weight"] is not w or w.data_ptr() != ptr
                or lay.bank is not bank):
            return False
        if m.stamp is not None:
            m._mark_stale()
        m.key = blend_key_of(table, bank, ptr, _version(w))
    hot.rearm(st, [m for _, m, *_ in items])
    return True


def _full(layer, device: torch.device) -> None:
    """List every cacheable layer, give buffers to those without (most `benefit` first), merge the stale ones, and
    keep the pass for _replay."""
    st = layer.state
    stale, homeless = [], []
    for lay in list(layer.state.members.values()):
        if not cacheable(lay, device):
            continue
        w = lay.base._parameters["weight"]
        key = blend_key(lay, w)
        m = lay.merged
        if m.buf is None:
            homeless.append((lay, m, w, key, lay.scale_blend))
        elif m.key != key:
            stale.append((lay, m, w, key, lay.scale_blend))
    homeless.sort(key=lambda e: -benefit(e[0], e[2]))
    dropped = False  # every layer's per-prompt copies, released once in this pass
    for lay, m, w, _, _ in homeless:
        # per-prompt copies are regenerable and the blend serves every call: it goes first, taking this layer's
        # copies, then every layer's (other layers' copies may hold the room: on Llama-3-8B, after mixed-
        # adapter steps the large MLP layers found none and merged into scratch on every prefill call)
        if m._buffer(w) is None and lay.merged.groups:
            m.release_groups()
            m.denied = -1
            m._buffer(w)
        if m.buf is None and not dropped:
            for other in st.members.values():
                other.merged.release_groups()
            dropped, m.denied = True, -1
            m._buffer(w)
    _merge(st, stale + [e for e in homeless if e[1].buf is not None])
    items, entries = [], []
    for lay in st.members.values():  # every layer the cache now serves: what a slider move re-merges
        m = lay.merged
        if m.buf is not None and cacheable(lay, device):
            w = lay.base._parameters["weight"]
            items.append((weakref.ref(lay), m, w, w.data_ptr(), lay.bank))  # (weak: the layer holds the state)
            entries.append((lay, m, w, None, lay.scale_blend))
    st.fast_pass = ((st.epoch, device, BUDGET.generation, st.mode), items, _calls(st, entries, kept=True))
    PASS_HOLDERS.add(st)


MAX_GROUP_COPIES = 4  # per-sample blends a layer keeps a copy of (beyond that, least recently used go first)


def groupable(layer, device: torch.device) -> bool:
    """Whether per-sample calls of this layer may run on per-blend copies (an nn.Linear base, as `cacheable`)."""
    bank = layer.bank
    return (type(layer.base) is nn.Linear and layer.plain_now() and bank.A.device == device
            and bank._buffers["bias"] is None and True in bank.used
            and bank._buffers["magnitude"] is None)


def refresh_groups(layer, W: torch.Tensor, blends: list[tuple[float, ...]]) -> list[torch.Tensor] | None:
    """W'_b of `layer` for each per-sample blend b (weights per slot; W itself for an all-zero blend), after merging
    every missing or stale copy of those blends in every groupable layer of its model; None when the budget gives
    `layer` no copy of one of them. Copies go to the layers of most `benefit` first (Flux-dev's text-stream layers,
    512 tokens a sample, after the image stream's: at the default budget a per-prompt step ran at 1.057x base with
    copies given smallest first, 1.023x in this order; bench_fullsize). When room runs out, a layer's copies of other
    blends go first, then every layer's blend copy (idle while per-sample batches run, and regenerable: the mirror of
    `_full`, where the blend takes the per-prompt copies' room). Flux-dev, H100, default budget: after a blend step
    its copies held 16 of the 20 GiB, and a per-prompt step ran at 1.12x base; with that room, 1.06x
    (benchmarks/probes/probe_per_prompt.py)."""
    st = layer.state
    device = layer.bank.A.device
    live = [b for b in dict.fromkeys(blends) if any(b)]
    unit = st.table.on(device)[1]  # [L, S] alpha / r (times the multiplier)
    scales = {b: unit * to_device(torch.tensor(b), device) for b in live}  # [L, S] per blend
    stale, homeless = [], []
    for lay in list(st.members.values()):
        if not groupable(lay, device):
            continue
        w = lay.base._parameters["weight"]
        key = merged_key(lay, w)
        copies = lay.merged.groups
        for b in live:
            m = copies.pop(b, None) or MergedWeight()
            copies[b] = m  # most recently used last
            e = (lay, m, w, key, scales[b][lay.index, :lay.bank.slots])
            if m.buf is None:
                homeless.append(e)
            elif m.key != key:
                stale.append(e)
    homeless.sort(key=lambda e: -benefit(e[0], e[2]))
    dropped = False  # every layer's blend copy, released once in this pass
    for e in homeless:
        lay, m, w = e[:3]
        if m._buffer(w) is None:
            for b in [b for b in lay.merged.groups if b not in scales]:
                lay.merged.groups.pop(b).release()
            m.denied = -1
            if m._buffer(w) is None and not dropped:
                for other in st.members.values():
                    other.merged.release(groups=False)
                dropped, m.denied = True, -1
                m._buffer(w)
            if m.buf is None:
                continue
        stale.append(e)
    for lay in st.members.values():
        copies = lay.merged.groups
        while len(copies) > max(MAX_GROUP_COPIES, len(live)):
            copies.pop(next(iter(copies))).release()
    _merge(st, stale)
    key = merged_key(layer, W)
    out = []
    for b in blends:
        m = layer.merged.groups.get(b) if any(b) else None
        if any(b) and (m is None or m.buf is None or m.key != key):
            return None
        out.append(W if m is None else m.buf)
    return out


def _merge(st, todo: list[tuple]) -> None:
    """Merge (layer, copy, W, key, scale) entries, then each copy holds `key`."""
    for _, m, _, key, _ in todo:
        m._mark_stale()  # the device stamp no longer vouches for the buffer either
        m.key = key
    for call in _calls(st, todo):
        call()


def _calls(st, todo: list[tuple], kept: bool = False) -> list:
    """The launches that merge (layer, copy, W, key, scale) entries: one lora_merge_many per (device, dtype, bank
    shape) where the backend has it, one lora_merge per layer elsewhere (the torch reference, convs). kept: the
    slider replay's, relaunched while its key holds (the backend's prepare_merge_many, where it has one, then
    checks only the weights' addresses per relaunch)."""
    calls, batches = [], {}
    for lay, m, w, _, scale in todo:
        e = entry(lay, m.buf, w, scale)
        if any(t.device != w.device for t in e if t is not None):  # a raw pointer off the device faults the context
            raise RuntimeError(f"fd-lora: {lay.path}: merge operands on {sorted({str(t.device) for t in e})}; "
                               "this is a bug (a tensor moved behind the layer's back), please report it")
        if lay.kind == "linear" and hasattr(lay._ops, "lora_merge_many"):
            batches.setdefault((w.device, w.dtype, *e[2].shape[:2]), (lay._ops, []))[1].append(e)
        else:
            calls.append(functools.partial(lay._ops.lora_merge, *e))
    for shape, (ops, entries) in batches.items():
        table = st.merge_tables.get(shape)
        if table is None:
            table = st.merge_tables[shape] = ops.merge_table()
        prepare = getattr(ops, "prepare_merge_many", None) if kept else None
        calls.append(prepare(entries, table) if prepare is not None else
                     functools.partial(ops.lora_merge_many, entries, table))
    return calls
