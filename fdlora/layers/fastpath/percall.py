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
kept as the layer's hot path (fdlora.layers.fastpath.hot) with every operand bound.

Per-sample scratch runs one baddbmm and one batched GEMM over the samples where the host is the limit, and one addmm
per distinct blend plus one GEMM per run of rows (SampleGroups.jobs) where the GEMM keeps the GPU busier than its
host work (`gpu_bound`: cuBLAS's batched GEMM runs Flux-size products slower than its plain one).

Where the CUDA extension is built (the triton+cuda and cuda backends), its C++-bound calls cost less host time than
these forms and take the layers the host limits: BoundLinear (blend), BoundRows (per-row, and decode steps of
per-sample batches), BoundSamples (per-sample scratch: every blend merged into scratch, by one merge-kernel launch or
one cuBLASLt matmul per blend, then the batch's GEMMs) and its lora_linear (per-sample delta), the two per-sample
forms weighed by bytes and launches (`bound_scratch_wins`). The extension's merge kernel runs at about twice a copy
of the weight, ahead of cuBLAS's addmm (2.6-2.8x on Flux's and Llama's largest weights), so these forms keep no blend
layer there.
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


GPU_BOUND_FLOPS = 5e10  # ~80 us of fp16 GEMM on an H100/H200: longer than any layer's host work


def gpu_bound(M: int, K: int, N: int) -> bool:
    """The layer's GEMM keeps the GPU busier than the host work of launching it."""
    return 2 * M * K * N >= GPU_BOUND_FLOPS


SMALL_MERGE = 1 << 23  # elements: weights the extension's merge kernel merges, every blend in one launch (SDXL's up
# to 1280 x 5120); larger ones are merged by one cuBLASLt matmul per blend (Flux's), faster on weights this large
SMALL_ROWS = 32  # the extension's delta for this many rows or fewer is one kernel after the GEMM (csrc/ops.cpp SMALL_M)
LAUNCH_BYTES = 10e6  # a launch with its host work, as bytes of memory traffic (csrc/ops.cpp merged_wins)


def bound_scratch_wins(M: int, K: int, N: int, blends: int, elt: int) -> bool:
    """The extension's per-sample scratch form costs less than its delta, counting bytes moved and launches at
    LAUNCH_BYTES each. Scratch: each distinct blend's W read and W' written (the GEMMs then read W' instead of W), one
    merge launch for all blends (SMALL_MERGE) or one per blend, and the GEMMs. Delta: x re-read, y read and written;
    the GEMM then the bank's masking, shrink, weighting and expand, or one kernel for SMALL_ROWS rows or fewer. So the
    host-limited layers of a per-prompt SDXL step (its cross-attention keys and values: 77 rows a sample) take two
    launches where the delta takes five."""
    merges = 1 if N * K <= SMALL_MERGE else blends
    scratch = 2 * blends * N * K * elt + (merges + 1) * LAUNCH_BYTES
    delta = M * (K + 2 * N) * elt + (2 if M <= SMALL_ROWS else 5) * LAUNCH_BYTES
    return scratch < delta


def forward(layer, x: torch.Tensor) -> torch.Tensor | None:
    """The layer's output by a cuBLAS form, kept as its hot path; None when this call does not take these forms
    (not an eager call on a plain nn.Linear without a LoRA bias in the bank's dtype, not wanted here, or a call the
    CUDA extension's bound forms serve)."""
    st, base, bank = layer.state, layer.base, layer.bank
    if st.static or torch.compiler.is_compiling() or type(base) is not nn.Linear or not layer._plain or not wanted(x):
        return None
    W = base._parameters["weight"]
    if (layer.__dict__.get("offloaded") or bank._buffers["bias"] is not None or x.dtype is not W.dtype
            or (torch.is_grad_enabled() and (x.requires_grad or W.requires_grad))
            or (x.is_cuda and torch._C._cuda_isCurrentStreamCapturing())):
        return None
    K, N = layer.in_features, layer.out_features
    M = x.numel() // K
    bound = hasattr(layer._ops, "prepare_linear_rows")  # the CUDA extension (see the module docstring)
    if st.mode is Mode.BLEND:
        if bound:
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
        return (lambda x: F.linear(x, torch.addmm(W, Bs, A), bias)), "cublas scratch"
    At, Bt = A.t(), Bs.t()

    def delta(x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, W, bias)
        y.view(-1, N).addmm_(x.reshape(-1, K) @ At, Bt)
        return y

    return delta, "cublas delta"


def _samples(layer, x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, M: int, K: int, N: int,
             bound: bool):
    """Per-sample blends: merged temporaries and batched or grouped GEMMs for many rows per sample; else the delta
    with each sample's weights on its rows. None for a decode step where the CUDA extension binds BoundRows."""
    st = layer.state
    gw = st.group_weight(x.shape[0], M, x.device)  # [G, S]
    if gw is None or M % gw.shape[0]:
        return None  # the regular path raises the clear error
    G = gw.shape[0]
    rows = M // G
    slots = [s for s, u in enumerate(layer.bank.used) if u]
    if not slots or max(slots) >= gw.shape[1] or (bound and rows == 1):
        return None
    unit = layer.scale_unit
    samples = bound and x.is_cuda and hasattr(layer._ops, "prepare_samples")  # the extension's per-sample forms
    groups = st.groups.get(x.shape[0])
    if samples and groups is not None:  # its scratch merges each distinct blend once, whatever the sample count
        live = [b for b, blend in enumerate(groups.blends) if any(blend[s] for s in slots)]
        if live and bound_scratch_wins(M, K, N, len(live), x.element_size()):
            run = _bound_samples(layer, x, W, bias, groups, live, slots, unit, rows, M, K, N)
            if run is not None:
                return run, "bound per-sample scratch"
    if scratch_wins(M, K, N, G):
        if groups is not None and (gpu_bound(M, K, N) or x.shape[0] != G):
            return _grouped(layer, W, bias, groups, rows, M, K, N), "cublas per-blend scratch"
        if x.dim() >= 2 and x.shape[0] == G:
            return _batched(layer, W, bias, gw, slots, unit, G, rows, K, N), "cublas per-sample scratch"
    if samples:
        return _bound_delta(layer, W, bias, gw, K, N), "bound per-sample delta"
    idx = torch.tensor(slots, device=x.device)
    A, Bs = _factors(layer, slots, unit[idx])
    At, Bt, R = A.t(), Bs.t(), A.shape[0] // len(slots)
    w4 = gw[:, idx].to(W.dtype)[:, None, :, None]  # [G, 1, n, 1] (a new spec gets a new state token)

    def delta(x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, W, bias)
        h = x.reshape(-1, K) @ At
        h.view(G, rows, -1, R).mul_(w4)
        y.view(-1, N).addmm_(h, Bt)
        return y

    return delta, "cublas per-sample delta"


def _bound_samples(layer, x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, groups, live: list[int],
                   slots: list[int], unit: torch.Tensor, rows: int, M: int, K: int, N: int):
    """The CUDA extension's per-sample scratch in one C++ call (BoundSamples): W'_b = W + B diag(alpha/r · w_b) A for
    each distinct blend b in `live` (those with an adapter on this layer), then the batch's GEMMs
    (SampleGroups.jobs) on the copies, W itself for samples with none. Weights of at most SMALL_MERGE elements are
    merged from the bank by the extension's merge kernel, every blend in one launch; larger ones by one cuBLASLt
    matmul per blend that reads W in place. A batch whose runs are one per blend, of equal length, every sample with
    an adapter, is one strided-batched GEMM over the copies where the host is the limit (not `gpu_bound`). None
    where cuBLASLt has no plan for these shapes. On an H200 the cuBLASLt merges cut a per-prompt SDXL step's LoRA GPU
    time by a tenth to a quarter against the torch forms (benchmarks/probes/probe_per_prompt_forms.py)."""
    index = {b: i for i, b in enumerate(live)}
    jobs = [(index.get(g, len(live)), first, n_rows, count, stride, 0)
            for g, first, n_rows, count, stride in groups.jobs(rows)]
    size = jobs[0][2]
    if (1 < len(jobs) == len(live) and not gpu_bound(M, K, N)  # each job on its own copy, none on W
            and all(job == (i, i * size, size, 1, 0, 0) for i, job in enumerate(jobs))):
        jobs = [(0, 0, size, len(jobs), size, 1)]
    flat = [v for job in jobs for v in job]
    w = torch.tensor([[groups.blends[g][s] for s in slots] for g in live], device=W.device)  # [nb, n] fp32
    banked = getattr(layer._ops, "prepare_samples_banked", None)
    if banked is not None and N * K <= SMALL_MERGE:
        b = layer.bank
        S = b.A.shape[0]
        blends = torch.zeros(len(live), S, device=W.device)
        blends[:, slots] = w
        return banked(x, W, bias, b.A, b.B, unit[:S].contiguous(), b.ranks, blends, flat)
    idx = torch.tensor(slots, device=W.device)
    A, B1 = _factors(layer, slots, unit[idx])  # [n·R, K], [N, n·R]
    n, nR = len(slots), A.shape[0]
    Bg = (B1.view(N, n, nR // n)[None] * w.to(B1.dtype)[:, None, :, None]).reshape(len(live), N, nR)
    pad = -nR % 8  # cuBLASLt's 16-byte alignment of Bg's rows
    A, Bg = F.pad(A, (0, 0, 0, pad)).contiguous(), F.pad(Bg, (0, pad)).contiguous()
    return layer._ops.prepare_samples(x, W, bias, A, Bg, flat)


def _bound_delta(layer, W: torch.Tensor, bias: torch.Tensor | None, gw: torch.Tensor, K: int, N: int):
    """The per-sample delta as the CUDA extension's lora_linear (base GEMM, then each sample's weights on its rows)
    in one C++ call."""
    b, linear = layer.bank, layer._ops.lora_linear
    A, B, ranks, scale, g = b.A, b.B, b.ranks, layer.scale_unit[:b.slots], gw[:, :b.slots]

    def delta(x: torch.Tensor) -> torch.Tensor:
        return linear(x.reshape(-1, K), W, bias, A, B, scale, g, ranks).view(*x.shape[:-1], N)

    return delta


def _batched(layer, W, bias, gw, slots, unit, G: int, rows: int, K: int, N: int):
    """W'_g for every sample by one baddbmm, then one batched GEMM over the samples (x [G, rows, K])."""
    idx = torch.tensor(slots, device=W.device)
    A, B1 = _factors(layer, slots, unit[idx])  # [n·R, K], [N, n·R]
    n = len(slots)
    Bg = (B1.view(N, n, -1)[None] * gw[:, idx].to(B1.dtype)[:, None, :, None]).reshape(G, N, -1)
    Ag, Wg = A.expand(G, *A.shape), W.expand(G, N, K)

    def per_sample(x: torch.Tensor) -> torch.Tensor:
        Wt = torch.baddbmm(Wg, Bg, Ag).transpose(1, 2)  # [G, K, N]: each sample's W'^T
        x3 = x.reshape(G, rows, K)
        y = torch.bmm(x3, Wt) if bias is None else torch.baddbmm(bias, x3, Wt)
        return y.view(*x.shape[:-1], N)

    return per_sample


def _grouped(layer, W, bias, groups, rows: int, M: int, K: int, N: int):
    """One addmm per distinct blend (W itself for none), then one GEMM per run of samples on its blend (a strided
    batched one per position of a periodic batch: CFG), as SampleGroups.jobs lays them out."""
    unit = layer.scale_unit
    factors = []
    for blend in groups.blends:
        slots = [s for s, w in enumerate(blend) if w and layer.bank.used[s]]
        if not slots:
            factors.append(None)
            continue
        w = torch.tensor([blend[s] for s in slots], device=W.device)
        factors.append(_factors(layer, slots, unit[slots] * w))
    jobs = groups.jobs(rows)

    def run(x: torch.Tensor) -> torch.Tensor:
        weights = [W if f is None else torch.addmm(W, f[1], f[0]) for f in factors]
        x2 = x.reshape(M, K)
        y2 = torch.empty(M, N, dtype=W.dtype, device=W.device)
        for g, first, n, count, stride in jobs:
            if count == 1:
                xs, ys, wt = x2[first:first + n], y2[first:first + n], weights[g].t()
                if bias is None:
                    torch.mm(xs, wt, out=ys)
                else:
                    torch.addmm(bias, xs, wt, out=ys)
            else:
                xs, ys = x2.view(count, stride, K)[:, first:first + n], y2.view(count, stride, N)[:, first:first + n]
                wt = weights[g].t().expand(count, K, N)
                if bias is None:
                    torch.bmm(xs, wt, out=ys)
                else:
                    torch.baddbmm(bias, xs, wt, out=ys)
        return y2.view(*x.shape[:-1], N)

    return run


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
