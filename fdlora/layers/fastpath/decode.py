"""Eager decode: per-row and per-sample adapters through one kept-ready Triton launch per layer.

Why: an eager decode step is host-bound (a 4-layer Llama-3-8B step spends ~10 ms of host time on
~6 ms of GPU work), so what a LoRA layer adds is its host time. Deriving a Triton launch (operand
checks, tuning key, specialization, grid: ~60-90 us) costs more than the launch itself, and the
cuBLAS forms are no cheaper: on the H100 host an mm with an fp32 output costs ~45 us of host time,
and scale + cast + addmm_ add three more ops (measured: benchmarks/bench_llm.py --profile).
So the layer keeps the whole call bound in C++ where the backend can (the CUDA extension's prepare_linear_rows:
cuBLAS GEMM + the per-row kernel, one pybind call) and replays it from its hot path (fdlora.layers.fastpath.hot: a few
compares per call while the model state is unchanged); else it keeps the per-row kernel's launch ready
(fdlora.kernels.triton.config.Prepared): base GEMM + one launch whose only new arguments are y, x, the scales and
the row slots.

When (`forward`, from FusedLoraLinear.forward): eager (not compiling, not frozen: frozen models are
captured or compiled and keep the traced ops), CUDA, a backend with `prepare_delta_rows`, and
- per-row mode (fdlora.per_row), or
- blend mode with exactly one adapter active and at most BLEND_ROWS rows, when the merged-weight cache does not
  serve the layer (turned off, or no room): every row on that adapter's slot at its blend scale, or
- per-sample mode with one row per sample (a decode step) where every sample has at most one adapter
  and every adapter one weight (PEFT's adapter_names; ModelState.sample_rows), which is per-row mode
  with per-layer scales alpha/r * weight.
A per-row call of more than shared.FEW_ROWS rows on a layer in a shrink group (q/k/v, gate/up: per-row prefill)
runs its base and then the group's delta (fdlora.layers.modules.shared_shrink: x read once for the group) when the group
may serve it, the kept launch otherwise.
Anything else (blends per sample, prefill) takes the regular paths; where no launch can be kept (autograd,
tracing modes) or the inputs' alignment keeps changing, the per-row op runs as a plain call after RETRIES.
"""

from __future__ import annotations

import torch
from torch import nn

from fdlora.layers.fastpath import hot
from fdlora.layers.state import Mode

RETRIES = 3  # calls that may try to keep a launch ready (the first launch of a shape goes through the autotuner)
BLEND_ROWS = 256  # blend mode with one active adapter takes this path up to this many rows (decode, short
# text inputs such as cross-attention's 77 tokens, without the cache; the dispatch's few-rows range)


def forward(layer, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The layer's output through the per-row kernel, or None when this call does not take this path."""
    st = layer.state
    prepare = getattr(layer._ops, "prepare_delta_rows", None)
    if prepare is None or not x.is_cuda or st.static or torch.compiler.is_compiling():
        return None
    K = layer.in_features
    M = x.numel() // K if K else 0
    if st.mode is Mode.ROWS:
        row_slot = st.row_slot(x.device)
        if row_slot.shape[0] != M:
            return None  # the regular path raises the clear error
        scale = layer.scale_unit
    elif st.mode is Mode.BLEND:
        row_slot = st.blend_rows(M, x.device) if M <= BLEND_ROWS else None
        if row_slot is None:
            return None
        scale = layer.scale_blend
    else:
        got = st.sample_rows(M, x.device) if x.shape[0] == M else None  # one row per sample only
        if got is None:
            return None
        row_slot, scales = got
        scale = scales[layer.index]
    bank = layer.bank
    A, B, ranks = bank._buffers["A"], bank._buffers["B"], bank._buffers["ranks"]
    # per-row prefill: one shrink for q/k/v (fdlora.layers.modules.shared_shrink)
    group = layer.__dict__.get("shrink_group")
    if group is not None and not (st.mode is Mode.ROWS and group.takes_rows(layer, x, M)):
        group = None
    if group is None and not (args or kwargs or torch._C._cuda_isCurrentStreamCapturing()):
        y = _bound(layer, x, A, B, scale, row_slot, ranks)
        if y is not None:
            return y
    if layer._plain and not (args or kwargs):  # nn.Linear / Conv1D: the GEMM without the module call
        p = layer.base._parameters
        y = layer._with_weight(x, p["weight"], p["bias"])
    else:
        y = layer.base(x, *args, **kwargs).contiguous()
    x2, y2 = x.reshape(M, K).to(A.dtype), y.view(M, layer.out_features)
    if group is not None and group.delta(layer, x, y2):  # (it adds a LoRA bias itself)
        return y
    key = (M, x2.stride(0), x2.stride(1), x2.dtype, y2.dtype, bank.version, A.data_ptr())
    kept = layer.__dict__.get("_decode")
    ready, tries = kept[1:] if kept is not None and kept[0] == key else (None, 0)
    if ready is not None and ready(y2, x2, scale, row_slot):
        pass
    elif tries >= RETRIES:  # no launch to keep (traced ops, interpreter) or alignment keeps changing
        layer._ops.lora_delta_rows(y2, x2, A, B, scale, row_slot, ranks)
    else:
        layer.__dict__["_decode"] = (key, prepare(y2, x2, A, B, scale, row_slot, ranks), tries + 1)
    if bank._buffers["bias"] is not None:
        layer._add_bias(y2, scale, layer.blend_weight, row_slot)
    return y


def _bound(layer, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, row_slot: torch.Tensor,
           ranks: torch.Tensor) -> torch.Tensor | None:
    """The whole call as one C++ call with every operand but x bound (the backend's prepare_linear_rows: base GEMM
    + per-row kernel), kept as the layer's hot path (fdlora.layers.fastpath.hot) so that the next decode steps issue it
    straight away; None where the backend has no such form or the layer is not a plain nn.Linear in the bank's
    dtype without a LoRA bias."""
    prepare = getattr(layer._ops, "prepare_linear_rows", None)
    base = layer.base
    if (prepare is None or type(base) is not nn.Linear or not layer._plain or layer.offloaded
            or layer.bank._buffers["bias"] is not None or x.dtype != A.dtype):
        return None
    p = base._parameters
    run = prepare(x, p["weight"], p["bias"], A, B, scale, row_slot, ranks)
    if run is None:
        return None
    y = run(x)
    hot.keep(layer, x, run)
    return y
