"""Re-merge every stale cached layer of a model at once: the eager merged-weight cache's refresh.

Why: a switch or a slider move makes every cached layer stale together. Re-merged lazily one layer at a time,
each layer paid a launch and its host work inside the step (SDXL: 722 launches; a slider moved every step cost
2.8x the base step). Here the first layer that finds its copy stale refreshes the whole model: it lists the
stale layers (one host key compare each), gives buffers to layers that have none — smallest weights first, so a
budget that cannot hold every layer goes to the layers where a copy saves the most per byte (the per-call cost
is a fixed host cost plus M(K + N) bytes, against N*K bytes of copy) — and merges them with one
lora_merge_many launch per (device, dtype, bank shape), from W, never from W' (nothing drifts). Layers whose
backend has no lora_merge_many (the torch reference, conv layers) merge one by one.
"""

from __future__ import annotations

import torch

from .merged import merged_key
from .state import Mode


def cacheable(layer, device: torch.device) -> bool:
    """Whether the eager cache serves this layer now: blend mode, a plain base in the bank's dtype on `device`,
    something loaded, no lora bias (the cached GEMM adds none)."""
    bank = layer.bank
    return (layer._plain and bank.A.device == device and bank._buffers["bias"] is None and True in bank.used
            and layer.state.mode is Mode.BLEND)


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


def refresh(layer, W: torch.Tensor) -> torch.Tensor | None:
    """W' of `layer` for the current blend, after re-merging every stale cached layer of its model; None when the
    budget gives `layer` no buffer."""
    st = layer.state
    device = layer.bank.A.device
    stale, homeless = [], []
    for lay in list(st.members.values()):
        if not cacheable(lay, device):
            continue
        w = lay.base._parameters["weight"]
        key = merged_key(lay, w)
        m = lay.merged
        if m.buf is None:
            homeless.append((lay, w, key))
        elif m.key != key:
            stale.append((lay, w, key))
    homeless.sort(key=lambda e: e[1].numel())
    stale += [e for e in homeless if e[0].merged._buffer(e[1]) is not None]
    batches: dict[tuple, list] = {}
    for lay, w, key in stale:
        lay.merged._mark_stale()  # the device stamp no longer vouches for the buffer either
        e = entry(lay, lay.merged.buf, w, lay.scale_blend[:lay.bank.slots])
        many = getattr(lay._ops, "lora_merge_many", None) if lay.kind == "linear" else None
        if many is None:
            lay._ops.lora_merge(*e)
        else:
            batches.setdefault((device, w.dtype, *e[2].shape[:2]), (lay._ops, []))[1].append(e)
        lay.merged.key = key
    for shape, (ops, entries) in batches.items():
        table = st.merge_tables.get(shape)
        if table is None:
            table = st.merge_tables[shape] = ops.merge_table()
        ops.lora_merge_many(entries, table)
    m = layer.merged
    return m.buf if m.buf is not None and m.key == merged_key(layer, W) else None
