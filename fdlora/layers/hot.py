"""The hot path: an eager layer call that repeats the previous one costs a few identity compares and one call.

Why: eager steps of full-size models are host-bound (an SDXL UNet step issues 722 LoRA layers, a Llama-3-8B decode
step 224), so every microsecond a fused layer spends deciding what to run is paid hundreds of times per step. The
full decision (fdlora.layers.fused: offload hooks, a weight replaced under the layer, autograd, DoRA, mode, the
merged-weight cache's key, the decode launch's key) costs 10-15 us of Python per call on an H100 host; an
nn.Linear's own forward costs ~1. So a call that got to its final computation through the full decision keeps it
here, and the next call runs it again after checking only what the decision read that the model state cannot
vouch for:

- the state token (ScaleTable.token): replaced by every write to the model's state (mode, active adapters, blend
  weights, per-sample and per-row specs, frozen / enabled flags, loads and deletes; fdlora.layers.state), so a
  switch, a slider move or a new per-prompt spec sends every layer through the full decision once;
- the input: same shape, dtype and device as when kept, and the same current stream (bound launches may hold it);
- the merge budget's generation (a copy released anywhere: a kept call may hold per-prompt copies);
- the base weight: the same object, dtype and version counter (quantized, recast or edited in place under the
  layer), and the same offload hooks on the base module;
- the bank's version (a load or an in-place write to this layer's bank);
- the call itself: not traced by torch.compile, no autograd through it, the stream not being captured (compiled,
  trained and captured calls always take the full decision, which has paths for them).

What is kept (`keep`): a callable of x alone, with every other operand bound: F.linear on the merged weight W'
(the merged-weight cache: the copy's release drops the hot entry with it, MergedWeight.hot), or the CUDA backend's
bound GEMM + per-row LoRA launch (fdlora.layers.decode).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .merged import BUDGET, _version


def keep(layer, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor],
         merged: torch.Tensor | None = None) -> None:
    """Remember `fn` (x -> the layer's output) for calls like this one until the state token or a checked input
    changes. Call only where the full decision chose `fn` for an eager call without autograd or capture. `merged`:
    the layer's merged-weight buffer when fn is the base computation on it (`rearm` may renew such an entry)."""
    base = layer.base
    w = base._parameters.get("weight")
    if w is None or torch.compiler.is_compiling():
        return
    bd, dev = base.__dict__, x.get_device()
    stream = torch._C._cuda_getCurrentRawStream(dev) if dev >= 0 else 0
    layer.merged.hot = (layer.state.table.token, x.shape, x.dtype, dev, w, w.dtype, _version(w), layer.bank.version,
                        bd.get("_hf_hook"), bd.get("_diffusers_hook"), stream, BUDGET.generation, fn, merged)


def get(layer, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The kept callable if this call may run it straight away, else None (then the full decision runs)."""
    hot = layer.merged.hot
    if hot is None or hot[0] is not layer.state.table.token or torch.compiler.is_compiling():
        return None
    w = layer.base._parameters.get("weight")
    if (x.shape != hot[1] or x.dtype is not hot[2] or w is not hot[4] or w.dtype is not hot[5]
            or (hot[6] >= 0 and w._version != hot[6]) or layer.bank.version != hot[7]
            or x.get_device() != hot[3] or BUDGET.generation != hot[11]):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return None
    if hot[3] >= 0 and (torch._C._cuda_getCurrentRawStream(hot[3]) != hot[10]
                        or torch._C._cuda_isCurrentStreamCapturing()):
        return None
    bd = layer.base.__dict__
    if bd.get("_hf_hook") is not hot[8] or bd.get("_diffusers_hook") is not hot[9]:
        return None
    return hot[12]


def rearm(st, layers) -> None:
    """After a blend-weight change re-merged these layers' buffers in place (fdlora.layers.remerge's replay: the
    slider path), their entries that compute on those buffers are valid again under the new token: a slider moved
    every step then costs each layer no full decision."""
    token = st.table.token
    for m in layers:
        h = m.hot
        if h is not None and h[13] is not None and h[13] is m.buf:
            m.hot = (token, *h[1:])
