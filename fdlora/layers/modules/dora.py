"""DoRA (weight-decomposed LoRA) in the fused layers, exactly as PEFT computes it.

For an adapter s with delta ΔW_s = B_s A_s, scale c_s (its weight times alpha / r) and magnitude m_s [N]:

    g_s = m_s / (‖W + c_s ΔW_s‖_row + eps_s)        norm over each output row of W (PEFT's "column norm" of Wᵀ),
                                                    a constant at inference (PEFT detaches it); eps_s = 0 for PEFT
                                                    files, the file dtype's eps for LyCORIS / kohya dora_scale
    y   = base(x) + (g_s − 1) ⊙ (x Wᵀ) + g_s ⊙ c_s (x A_sᵀ) B_sᵀ        ( = bias + g_s ⊙ x (W + c_s ΔW_s)ᵀ )

Blends follow PEFT's rule (what diffusers' set_adapters gets through PEFT): the active adapters apply in turn, in
the order `set_adapters` names them; with z the output so far less the base bias, a DoRA adapter makes it
g_s ⊙ (z + c_s (x A_sᵀ) B_sᵀ) — so it also rescales the adapters applied before it — and a plain LoRA adapter adds
c_s (x A_sᵀ) B_sᵀ. A DoRA adapter's norm is of W plus *its own* scaled delta, and its blend weight sits inside c_s,
so inside the norm. Per-sample and per-row batches (PEFT refuses ``adapter_names`` with DoRA) give each sample
what its adapters give as a blend alone, applied in slot order (the order they were loaded in, unless a delete
freed an earlier slot).

g_s is computed once per (slot, c_s, bank write, weight edit) and kept. In eager blend mode on a plain nn.Linear /
nn.Conv2d base with room in the merged-weight cache (fdlora.layers.fastpath.merged: its budget, its key), a call is one
base GEMM on W' = W + `delta_weight` (what fusing adds), re-merged here in torch when the blend, the bank or W changes:
DoRA at merged speed. Every other call (per-sample and per-row batches, no room, a lora bias, compiled or frozen
models, autograd) costs the base GEMM plus the low-rank products of the active slots, eagerly in fp32 (no kernels).
Layers with a DoRA slot never join the kernels' model-wide re-merge (fdlora.layers.fastpath.remerge.cacheable).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fdlora.errors import FdLoraError
from fdlora.layers.fastpath import remerge
from fdlora.layers.fastpath.merged import merged_key
from fdlora.layers.quant import quantized
from fdlora.layers.state import Mode

MAX_KEPT = 64  # gains kept per layer (slot x weight pairs); beyond that the oldest go


def active(layer) -> bool:
    """Whether the layer holds a DoRA slot (and so takes this path)."""
    return layer.bank._buffers["magnitude"] is not None


def _rows_of(layer) -> torch.Tensor:
    """The base weight as [N, K'] rows (Linear; transformers Conv1D transposed; Conv2d flattened)."""
    w = getattr(layer.base, "weight", None)
    q = quantized.kind(layer.base)
    if (not isinstance(w, torch.Tensor) or not w.is_floating_point()
            or (q is not None and type(w) not in (torch.nn.Parameter, torch.Tensor))):  # torchao: a float dtype
        raise FdLoraError(f"{layer.path}: DoRA needs the base weight's norm, and {type(layer.base).__name__} has no "
                          f"float weight (a quantized base: {q or 'opaque'}); load a plain LoRA, or this adapter on a "
                          "float base.")
    if layer.kind == "linear" and w.shape[0] != layer.out_features:  # Conv1D [K, N]
        w = w.t()
    return w.reshape(layer.out_features, -1)


def _delta(layer, s: int) -> torch.Tensor:
    """B_s A_s [N, K'] in fp32."""
    b, r = layer.bank, layer.bank.host_ranks[s]
    return b.B[:, s, :r].float() @ b.A[s, :r].reshape(r, -1).float()


def gain(layer, s: int, c: float) -> torch.Tensor:
    """g_s [N] fp32 for slot `s` at scale `c`."""
    W = layer.base.weight
    key = (s, c, layer.bank.version, W.data_ptr(), getattr(W, "_version", -1))
    kept = layer.__dict__.setdefault("_dora_gains", {})
    g = kept.get(key)
    if g is None:
        with torch.no_grad():
            norm = (_rows_of(layer).float() + c * _delta(layer, s)).norm(dim=1) + layer.bank.dora_eps[s]
            g = layer.bank.magnitude[s] / norm
        if len(kept) >= MAX_KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = g
    return g


def _lora(layer, x: torch.Tensor, s: int) -> torch.Tensor:
    """(x A_sᵀ) B_sᵀ in fp32: [M, N] for linear rows, [B, N, H, W] for convs."""
    b, r = layer.bank, layer.bank.host_ranks[s]
    A, B = b.A[s, :r].float(), b.B[:, s, :r].float()
    if layer.kind == "linear":
        return (x @ A.t()) @ B.t()
    base = layer.base
    h = F.conv2d(x, A, None, base.stride, base.padding, base.dilation)
    return F.conv2d(h, B[:, :, None, None])


def order(layer) -> list[int]:
    """Slots in the order adapters apply: blends in the active set's order (set_adapters), then by slot; per-sample
    and per-row calls by slot."""
    st = layer.state
    if st.mode is not Mode.BLEND:
        return list(range(layer.bank.slots))
    first = [st.slots.by_name[n] for n in st.active if n in st.slots.by_name]
    return first + [s for s in range(layer.bank.slots) if s not in first]


def _apply(layer, y: torch.Tensor, x: torch.Tensor, ynb: torch.Tensor, c: list[float]) -> torch.Tensor:
    """y (fp32, base output of these rows; ynb: the same less the base bias) after every slot's term at scales
    `c` [S], applied in `order`."""
    b = layer.bank
    chan = (None, slice(None), None, None) if layer.kind == "conv2d" else (None, slice(None))
    for s in order(layer):
        cs = c[s]
        if cs == 0 or not b.used[s]:
            continue
        d = _lora(layer, x, s) * cs
        if b.dora_eps[s] is not None:  # z <- g (z + d): the outputs so far are rescaled too (PEFT)
            g = gain(layer, s, cs)[chan]
            z = g * (ynb + d)
            y, ynb = y + (z - ynb), z
        else:
            if b.bias is not None:
                d = d + cs * b.bias[s].float()[chan]
            y, ynb = y + d, ynb + d
    return y


def merged_weight(layer, x: torch.Tensor) -> torch.Tensor | None:
    """W' = W + delta_weight for this eager blend call, from the layer's merged-weight buffer (merged again when the
    key moved), or None when the call may not use one."""
    base = layer.base
    if (layer.state.static or torch.compiler.is_compiling() or type(base) not in (nn.Linear, nn.Conv2d)
            or not remerge.mergeable(layer, layer.bank.A.device)):
        return None
    W = base._parameters["weight"]
    if ((torch.is_grad_enabled() and (W.requires_grad or x.requires_grad))
            or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
        return None
    m, key = layer.merged, merged_key(layer, W)
    if m.buf is not None and m.key == key:
        return m.buf
    buf = m._buffer(W)
    if buf is None:
        return None
    m._mark_stale()  # the kernels' device stamp no longer describes the buffer
    scale, gw = layer._weights(x, 1)
    S = layer.bank.slots
    with torch.no_grad():
        buf.copy_(W.float() + delta_weight(layer, gw[0, :S] * scale[:S]))
    m.key = key
    return buf


def forward(layer, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """The layer's output for every mode (blend, per-sample, per-row), DoRA slots included."""
    if not (args or kwargs or layer._skip()):
        w = merged_weight(layer, x)
        if w is not None:
            return layer._weight_fn(w, layer.base._parameters["bias"])(x)
    y = layer.base(x, *args, **kwargs)
    if layer._skip():
        return y
    st, conv = layer.state, layer.kind == "conv2d"
    bias = layer.bias
    yf = y.float()
    if conv:
        xf = x.float()
        ynb = yf if bias is None else yf - bias.float()[None, :, None, None]
    else:
        xf = x.reshape(-1, x.shape[-1]).float()
        yf = yf.reshape(-1, layer.out_features)
        ynb = yf if bias is None else yf - bias.float()
    S = layer.bank.slots
    if st.mode is Mode.ROWS:
        if conv:
            raise FdLoraError(f"{layer.path}: per-row adapters apply to linear layers; use per-sample adapters for "
                              "convs.")
        row_slot = st.row_slot(x.device)
        if row_slot.shape[0] != xf.shape[0]:
            raise FdLoraError(f"{layer.path}: {row_slot.shape[0]} per-row adapters given for {xf.shape[0]} rows.")
        unit = layer.scale_unit[:S].tolist()
        out = yf.clone()
        for s in sorted(set(row_slot.tolist()) - {-1}):
            rows = (row_slot == s).nonzero().flatten()
            c = [unit[s] if i == s else 0.0 for i in range(S)]
            out[rows] = _apply(layer, yf[rows], xf[rows], ynb[rows], c)
    else:
        scale, gw = layer._weights(x, xf.shape[0])
        c = (gw[:, :S] * scale[:S]).tolist()  # [G, S]
        G = len(c)
        n = xf.shape[0] // G  # rows (linear) or samples (conv) per group, contiguous
        parts = [_apply(layer, yf[g * n:(g + 1) * n], xf[g * n:(g + 1) * n], ynb[g * n:(g + 1) * n], c[g])
                 for g in range(G)]
        out = parts[0] if G == 1 else torch.cat(parts)
    return out.to(y.dtype).view(y.shape)


def delta_weight(layer, slot_weights: torch.Tensor) -> torch.Tensor:
    """W' − W in fp32, shaped like the base weight, for W' from W by the slots in `order` (DoRA: W' <- g_s (W' +
    c_s ΔW_s); plain: W' += c_s ΔW_s): what fusing adds. `slot_weights` [S] holds c_s."""
    b = layer.bank
    W = _rows_of(layer).float()
    merged = W.clone()
    c = slot_weights.tolist()
    for s in order(layer):
        cs = c[s] if s < len(c) else 0.0
        if cs == 0 or not b.used[s]:
            continue
        merged += cs * _delta(layer, s)
        if b.dora_eps[s] is not None:
            merged *= gain(layer, s, cs)[:, None]
    total = merged - W
    w = layer.base.weight
    if layer.kind == "linear" and w.shape[0] != layer.out_features:
        return total.t()
    return total.view(w.shape)


def bias_delta(layer, slot_weights: torch.Tensor) -> torch.Tensor | None:
    """Σ_s c_s bias_s [N] fp32 of the slots with a lora bias (LyCORIS diff_b, PEFT lora_bias), or None."""
    b = layer.bank
    if b.bias is None:
        return None
    c = slot_weights[:b.slots].float().to(b.bias.device)
    return c @ b.bias.float()
