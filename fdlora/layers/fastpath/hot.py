"""The hot path: an eager layer call that repeats the previous one costs a few identity compares and one call.

Why: eager steps of full-size models are host-bound (an SDXL UNet step issues 722 LoRA layers, a Llama-3-8B decode
step 224), so every microsecond a fused layer spends deciding what to run is paid hundreds of times per step. The
full decision (fdlora.layers.modules.fused: offload hooks, a weight replaced under the layer, autograd, DoRA, mode, the
merged-weight cache's key, the decode launch's key) costs 10-15 us of Python per call on an H100 host; an
nn.Linear's own forward costs ~1. So a call that got to its final computation through the full decision keeps it
here, and the next call runs it again after checking only what the decision read that the model state cannot
vouch for:

- the state token (ScaleTable.token): replaced by every write to the model's state (mode, active adapters, blend
  weights, per-sample and per-row specs, frozen / enabled flags, loads and deletes; fdlora.layers.state), so a
  switch, a slider move or a new per-prompt spec sends every layer through the full decision once;
- the input: same dtype and device as when kept; for a bound launch also the same shape and current stream, and the
  merge budget's generation (a copy released anywhere: a kept per-prompt call may hold copies); an entry on the
  merged weight holds for any shape and stream (its buffer belongs to the cache, whose release drops the entry);
- the base weight: the same object, dtype and version counter (quantized, recast or edited in place under the
  layer), and the same offload hooks on the base module;
- the bank's version (a load or an in-place write to this layer's bank);
- the call itself: not traced by torch.compile, no autograd through it, the stream not being captured (compiled,
  trained and captured calls always take the full decision, which has paths for them). PyTorch captures CUDA graphs
  on side streams only, so a call on the default stream skips that driver query (0.7 us of the H100 host's 4.6 us
  for these checks).

What is kept (`keep`): a callable of x alone, with every other operand bound: F.linear on the merged weight W'
(the merged-weight cache: the copy's release drops the hot entry with it, MergedWeight.hot), or the CUDA backend's
bound GEMM + per-row LoRA launch (fdlora.layers.fastpath.decode).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fdlora.layers.fastpath.merged import BUDGET, _version, blend_key
from fdlora.steps import Steps, drain

# what a kept entry holds, by position (one tuple: the hot path reads it with a few indexings)
TOKEN, FN, TABLE, DTYPE, DEV, PARAMS, W, WDTYPE, WVERSION, BANK, BVERSION, BASEDICT, HF, DH, DEFAULT, \
    SHAPE, STREAM, GENERATION, MERGED = range(19)


def keep(layer, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor],
         merged: torch.Tensor | None = None) -> None:
    """Remember `fn` (x -> the layer's output) for calls like this one until the state token or a checked input
    changes. Call only where the full decision chose `fn` for an eager call without autograd or capture. `merged`:
    the layer's merged-weight buffer when fn is the base computation on it (`rearm` may renew such an entry); such
    an entry holds for any input shape and stream (F.linear on a buffer the cache owns: its release drops the entry),
    where a bound launch (merged None) holds for the shape, stream and budget generation it was kept under."""
    base = layer.base
    params = base._parameters
    w = params.get("weight")
    if w is None or torch.compiler.is_compiling():
        return
    bd, dev, bank, table = base.__dict__, x.get_device(), layer.bank, layer.state.table
    stream = torch._C._cuda_getCurrentRawStream(dev) if dev >= 0 else 0
    default = torch.cuda.default_stream(dev).cuda_stream if dev >= 0 else 0
    bound = merged is None
    layer.merged.hot = (table.token, fn, table, x.dtype, dev, params, w, w.dtype, _version(w), bank, bank.version, bd,
                        bd.get("_hf_hook"), bd.get("_diffusers_hook"), default, x.shape if bound else None,
                        stream if bound else None, BUDGET.generation if bound else None, merged)


def get(layer, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The kept callable if this call may run it straight away, else None (then the full decision runs)."""
    if torch.compiler.is_compiling():  # first: a traced call must not guard on the kept entry or the state token
        return None
    h = layer.merged.hot
    if h is None or h[TOKEN] is not h[TABLE].token:
        return None
    w = h[PARAMS].get("weight")
    if (x.dtype is not h[DTYPE] or w is not h[W] or w.dtype is not h[WDTYPE]
            or (h[WVERSION] >= 0 and w._version != h[WVERSION]) or h[BANK].version != h[BVERSION]):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return None
    dev = h[DEV]
    if x.get_device() != dev:
        return None
    if dev >= 0:
        s = torch._C._cuda_getCurrentRawStream(dev)
        # PyTorch captures CUDA graphs on side streams only, so on the default stream there is nothing to ask
        if s != h[DEFAULT] and torch._C._cuda_isCurrentStreamCapturing():
            return None
        if h[SHAPE] is not None and (s != h[STREAM] or x.shape != h[SHAPE] or BUDGET.generation != h[GENERATION]):
            return None
    elif h[SHAPE] is not None and (x.shape != h[SHAPE] or BUDGET.generation != h[GENERATION]):
        return None
    bd = h[BASEDICT]
    if bd.get("_hf_hook") is not h[HF] or bd.get("_diffusers_hook") is not h[DH]:
        return None
    return h[FN]


def rearm(st, layers) -> None:
    """After a blend-weight change re-merged these layers' buffers in place (fdlora.layers.fastpath.remerge's replay:
    the slider path), their entries that compute on those buffers are valid again under the new token: a slider moved
    every step then costs each layer no full decision."""
    token = st.table.token
    for m in layers:
        h = m.hot
        if h is not None and h[MERGED] is not None and h[MERGED] is m.buf:
            m.hot = (token, *h[1:])


def rekey(st, layers, ahead: tuple[int, list] | None = None) -> None:
    """After a write that leaves the blend's merged copies valid (a load into a slot the blend does not weigh: a
    prefetch's publication), entries that compute on a copy whose key still holds take the new token and bank
    version, so the next step pays no full decision per layer (SDXL: 722 of them, ~10 ms on an H100 host) for
    this check (~2 us per layer, ~4 on a slow host) under the load's lock. `ahead`: that check made before the write
    (`rekey_steps`, in a publication's pieces), for a table whose version is still the one it was made under (the
    caller compares); without it the check runs now. Each entry is re-armed if it is still the very entry checked,
    over the same copy and W."""
    token = st.table.token
    for layer, m, h, key, wv in (ahead if ahead is not None else drain(rekey_steps(st, layers)))[1]:
        if m.hot is h and m.key is key and h[MERGED] is m.buf and h[PARAMS].get("weight") is h[W] \
                and _version(h[W]) == wv:
            m.hot = (token, *h[TOKEN + 1:BVERSION], layer.bank.version, *h[BVERSION + 1:])


def rekey_steps(st, layers, every: int = 0) -> Steps[tuple[int, list]]:
    """`rekey`'s check before the write, stopping every `every` layers (fdlora.steps): (the scale table's
    version, the entries that pass with what must not change until the re-arm)."""
    out = []
    for i, layer in enumerate(layers):
        if every and i and not i % every:
            yield
        m = layer.merged
        h = m.hot
        if h is None or h[MERGED] is None or h[MERGED] is not m.buf:
            continue
        w = h[PARAMS].get("weight")
        if w is h[W] and m.key is not None and m.key == blend_key(layer, w):
            out.append((layer, m, h, m.key, _version(w)))
    return st.table.version, out
