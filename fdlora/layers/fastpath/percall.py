"""Per-call LoRA in cuBLAS GEMMs: no merged copy kept, no Triton launch, two to four torch ops per layer.

Eager steps of full-size models are host-bound on the H200 host (an SDXL UNet base step spends more host time
than GPU time), so a LoRA layer's cost is mostly the host time of what it launches. A torch op costs a few
microseconds of host time; a Triton launch derived in Python costs several times that. So on a GPU the dispatcher
is conservative on (fdlora.kernels.costmodel.profile; `FDLORA_DISPATCH=cublas` asks for these forms on every GPU),
eager calls of a plain nn.Linear compute the LoRA with cuBLAS alone, in one of two forms:

- scratch: W'_g = W + B diag(s_g) A for each of the G weight sets (one addmm, or one baddbmm for per-sample
  blends), then the base GEMM on W' (F.linear, or one batched GEMM over the samples). Extra memory traffic
  ~4·G·N·K bytes whatever the rows; the temporary lives for the call (the caching allocator reuses it).
- delta: y = x W^T + b, h = x A^T over the selected slots, h scaled per row (per-row / per-sample modes:
  one broadcast multiply by each row's slot weights), y += h B^T. Extra traffic ~2·M·K + 4·M·N bytes.

The form is the one with less extra traffic (`scratch_wins`): scratch for diffusion's many rows, delta for decode
and short text inputs. Both run every row of every mode (blend, per-sample, per-row) in at most four launches,
and depend on nothing but the shapes and the model state (never on what ran before). The factors (the selected
slots of A and of B scaled by each slot's alpha/r and weight) are made once per model state and bank version and
kept as the layer's hot path (fdlora.layers.fastpath.hot) with every operand bound. Where the CUDA extension is
built, the scratch forms are bound in C++ (BoundScratch, BoundSamples: one pybind call per layer, the ATen ops
issued from C++), and the delta forms are the extension's own (BoundLinear, BoundRows).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from fdlora import env
from fdlora.kernels.costmodel import profile
from fdlora.layers.fastpath import hot
from fdlora.layers.state import Mode


@functools.cache
def _conservative(device_index: int) -> bool:
    name, calibrated = profile(torch.cuda.get_device_name(device_index))
    return not calibrated


def wanted(x: torch.Tensor) -> bool:
    """These forms serve this eager call: FDLORA_DISPATCH=cublas (any device), or auto on an uncalibrated GPU."""
    mode = env.dispatch_mode()
    return mode == "cublas" or (mode == "auto" and x.is_cuda and _conservative(x.get_device()))


def scratch_wins(M: int, K: int, N: int, G: int) -> bool:
    """The scratch form moves fewer extra bytes than the delta form (G weight sets, M rows)."""
    return 2 * G * N * K < M * (K + 2 * N)


def forward(layer, x: torch.Tensor) -> torch.Tensor | None:
    """The layer's output by a cuBLAS form, kept as its hot path; None when this call does not take these forms
    (not an eager CUDA call on a plain nn.Linear without a LoRA bias in the bank's dtype, or not wanted here)."""
    st, base, bank = layer.state, layer.base, layer.bank
    W = base._parameters["weight"]
    if (not wanted(x) or st.static or type(base) is not nn.Linear or not layer._plain
            or layer.__dict__.get("offloaded") or bank._buffers["bias"] is not None or x.dtype is not W.dtype
            or (torch.is_grad_enabled() and (x.requires_grad or W.requires_grad))
            or torch.compiler.is_compiling() or (x.is_cuda and torch._C._cuda_isCurrentStreamCapturing())):
        return None
    K, N = layer.in_features, layer.out_features
    M = x.numel() // K
    ops = layer._ops
    bound = hasattr(ops, "prepare_linear_rows")  # the CUDA extension: its delta forms are bound in C++ already
    if st.mode is Mode.BLEND:
        if bound and not scratch_wins(M, K, N, 1):
            return None  # BoundLinear / BoundRows (fdlora.layers.modules.fused, fdlora.layers.fastpath.decode)
        fn, path = _blend(layer, W, base.bias, M, K, N)
    elif st.mode is Mode.SAMPLES:
        got = _samples(layer, x, W, base.bias, M, K, N, bound)
        if got is None:
            return None
        fn, path = got
    elif st.mode is Mode.ROWS and not bound:
        if st.row_slot(x.device).shape[0] != M:
            return None  # the regular path raises the clear error
        fn, path = _rows(layer, W, base.bias, K, N)
    else:
        return None
    hot.keep(layer, x, fn)
    layer._took(path, x)
    return fn(x)


def _factors(layer, slots: list[int], scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [n·R, K], B·s [N, n·R]) of `slots` at their live rank R, B's columns scaled by `scale` [n]."""
    b = layer.bank
    R = b.extent()[1]
    K = b.A.shape[-1]
    if len(slots) == 1:  # A: a view; B·s: [N, R]
        s = slots[0]
        return b.A[s, :R], b.B[:, s, :R] * scale.to(b.B.dtype)
    idx = torch.tensor(slots, device=b.A.device)
    A = b.A[idx, :R].reshape(-1, K)
    Bs = (b.B[:, idx, :R] * scale.to(b.B.dtype)[None, :, None]).reshape(b.B.shape[0], -1)
    return A, Bs


def _blend(layer, W: torch.Tensor, bias: torch.Tensor | None, M: int, K: int, N: int):
    st = layer.state
    slots = sorted(s for s in (st.slots.by_name[n] for n in st.active) if layer.bank.used[s])
    if not slots:  # no active adapter targets this layer
        return functools.partial(F.linear, weight=W, bias=bias), "base only"
    A, Bs = _factors(layer, slots, layer.scale_blend[slots])
    if scratch_wins(M, K, N, 1):
        prepare = getattr(layer._ops, "prepare_scratch", None)
        run = prepare(W, bias, A, Bs) if prepare is not None else None
        if run is not None:
            return run, "cublas scratch (C++)"
        return (lambda x: F.linear(x, torch.addmm(W, Bs, A), bias)), "cublas scratch"
    At, Bt = A.t(), Bs.t()

    def delta(x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, W, bias)
        y.view(-1, N).addmm_(x.reshape(-1, K) @ At, Bt)
        return y

    return delta, "cublas delta"


def _samples(layer, x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, M: int, K: int, N: int,
             bound: bool):
    """Per-sample blends: one merged temporary per sample (baddbmm) and one batched GEMM over the samples for
    many rows per sample; else the delta with each sample's weights on its rows (None where the backend binds its
    own delta forms in C++)."""
    st = layer.state
    gw = st.group_weight(x.shape[0], M, x.device)  # [G, S]
    if gw is None or M % gw.shape[0]:
        return None  # the regular path raises the clear error
    G = gw.shape[0]
    rows = M // G
    slots = [s for s, u in enumerate(layer.bank.used) if u]
    if not slots or max(slots) >= gw.shape[1]:
        return None
    idx = torch.tensor(slots, device=x.device)
    unit = layer.scale_unit[idx]
    if scratch_wins(M, K, N, G) and x.dim() >= 2 and x.shape[0] == G:
        A, B1 = _factors(layer, slots, unit)  # [n·R, K], [N, n·R]
        n = len(slots)
        Bg = (B1.view(N, n, -1)[None] * gw[:, idx].to(B1.dtype)[:, None, :, None]).reshape(G, N, -1)
        Ag, Wg = A.expand(G, *A.shape), W.expand(G, N, K)
        prepare = getattr(layer._ops, "prepare_samples", None)
        run = prepare(W, bias, Ag, Bg, rows) if prepare is not None else None
        if run is not None:
            return run, "cublas per-sample scratch (C++)"

        def per_sample(x: torch.Tensor) -> torch.Tensor:
            Wp = torch.baddbmm(Wg, Bg, Ag)  # [G, N, K]: each sample's W'
            x3 = x.reshape(G, rows, K)
            y = torch.bmm(x3, Wp.transpose(1, 2)) if bias is None else torch.baddbmm(bias, x3, Wp.transpose(1, 2))
            return y.view(*x.shape[:-1], N)

        return per_sample, "cublas per-sample scratch"
    if bound:
        return None
    A, Bs = _factors(layer, slots, unit)
    At, Bt, R = A.t(), Bs.t(), A.shape[0] // len(slots)
    wsel = gw[:, idx]  # [G, n] (a gather: set_sample_weights gives a new spec a new state token)
    w4 = wsel.to(W.dtype)[:, None, :, None]

    def delta(x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, W, bias)
        h = x.reshape(-1, K) @ At
        h.view(G, rows, -1, R).mul_(w4)
        y.view(-1, N).addmm_(h, Bt)
        return y

    return delta, "cublas per-sample delta"


def _rows(layer, W: torch.Tensor, bias: torch.Tensor | None, K: int, N: int):
    """Per-row adapters: h over every used slot, each row's slot kept by a one-hot read per call from the row slots
    (set_row_slot rewrites them in place), y += h (B scaled by alpha/r)^T."""
    st, b = layer.state, layer.bank
    S = b.extent()[0]
    slots = list(range(S))
    A, Bs = _factors(layer, slots, layer.scale_unit[:S])
    At, Bt, R = A.t(), Bs.t(), A.shape[0] // max(S, 1)

    def delta(x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, W, bias)
        onehot = st.row_onehot(x.device, S)  # [M, S], cached while the row slots are unchanged
        h = x.reshape(-1, K) @ At
        h.view(h.shape[0], S, R).mul_(onehot[:, :, None])
        y.view(-1, N).addmm_(h, Bt)
        return y

    return delta, "cublas per-row delta"
