"""lora_linear: the base GEMM and the LoRA delta in one kernel, y = x W^T (+ bias) + delta, no merge.

    w[m, s] = scale[s] * group_weight[m // (M / G), s]          (G = 1: blend, G = batch: per sample)
    y[m, n] = sum_k x[m, k] W[n, k] + bias[n] + sum_s w[m, s] sum_r (x[m] A_s^T)[r] B[n, s, r]

One program owns a BM x BN tile of y (grouped ordering, GROUP_M row blocks swept together so that
their x rows and W columns stay in L2; PERSISTENT programs loop over tiles). The slots live in its
rows (scale != 0, row weight != 0, rank > 0) are packed onto one rank axis (tiles.py), so a blend
is one rank-sum adapter and a per-sample tile that straddles a sample boundary gets each row's own
weights. The LoRA part takes one of two forms (constexpr PRE):

- in-loop (PRE=False, one launch): the K loop that feeds the GEMM with x tiles also multiplies
  them by the packed A columns, h [BM, RC] in fp32 beside the [BM, BN] accumulator; the redundant
  work is RC/BN of the GEMM (every N tile recomputes its rows' h). Live rank above RMAX columns
  is shrunk in extra passes after the loop (x re-read from L2).
- pre (PRE=True, two launches): lora_shrink writes h = x A^T [P, M, S*R] fp32 once (one extra read
  of x, ~r(K+N)/(KN) of the FLOPs), and the GEMM reads it in its epilogue. Cheaper than in-loop
  when N is wide (the x re-read is amortised over many output columns).

Either way the expand runs in the epilogue: acc += ((h * w) in the dot dtype) @ B^T on the fp32
accumulator, then bias, then one cast. The op `fdlora::lora_linear` runs one of five paths for a
shape, decided once in lora_linear_dispatch.py: the two fused forms above, cuBLAS + lora_delta,
merged (lora_merge.py + cuBLAS) or the torch reference. On an H100 the Triton GEMM here runs at
0.65-0.8 of cuBLAS, so the dispatch picks merged (many rows) or cuBLAS + delta (few rows) there.
A Hopper TMA rewrite was measured and not adopted (benchmarks/probes/probe_tma_gemm.py,
Triton 3.6, Flux shapes): persistent TMA tiles reach 0.84-0.94 of cuBLAS as a plain GEMM (best config per shape),
and the in-loop shrink (a second, N=16 wgmma per K step) drops that to 0.67-0.73.

Idea: epilogue fusion as in CUTLASS / Triton GEMM epilogues; the shrink fused into the main loop
as in LoRA-fused GEMMs of serving stacks (Punica/S-LoRA lineage), but packed per tile so that a
blend costs its live rank only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fdlora.kernels.ops import OPS
from fdlora.kernels.triton import config as C
from fdlora.kernels.triton.forward import lora_linear_dispatch as D
from fdlora.kernels.triton.forward.lora_shrink import launch_shrink
from fdlora.kernels.triton.merge.lora_merge import launch_merge
from fdlora.kernels.triton.tiles import mma, pack_block, packed_columns, rank_tiers, row_weights, shrink_tile


def _cfg(warps: int, stages: int, BM: int, BN: int, BK: int, group: int = 8, persistent: int = 0) -> triton.Config:
    return C.cfg(warps, stages, BM=BM, BN=BN, BK=BK, GROUP_M=group, PERSISTENT=persistent)


# Hopper: 2 warpgroups on a 128 x 256 tile is the cuBLAS-like shape; smem per stage is
# (BM + BN + RC) * BK * 2 bytes, so 3 stages of 128x256x64 fit in 227 KB with the A tile.
CONFIGS = {
    "many": [
        _cfg(8, 4, 128, 128, 64),  # first: the one config tests run with (AUTOTUNE off)
        _cfg(8, 3, 128, 256, 64),
        _cfg(8, 3, 256, 128, 64),
        _cfg(8, 3, 128, 128, 128),
        _cfg(8, 3, 128, 256, 64, persistent=1),
    ],
    "few": [
        _cfg(4, 4, 16, 64, 128, group=1),
        _cfg(4, 4, 32, 64, 128, group=1),
        _cfg(4, 3, 64, 128, 64, group=1),
    ],
    "interpret": [_cfg(4, 1, 16, 32, 32, group=2)],
}
for _set in CONFIGS.values():
    C.check_blocks(_set)
MAX_BK = 128  # EVEN_K holds for every config when K is a multiple of this


@triton.jit
def _expand(
    acc,  # [BM, BN] fp32
    h,  # [BM, RC] fp32, unscaled x A^T of the packed columns
    b_ptr, gw_ptr,
    rows, row_on,  # [BM]
    slot, r, ok, scj,  # [RC]
    cols,  # [BN] int64, in range
    rows_per_group, sbn, sbs, sbr, sgg, sgs,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """acc + ((h * w) cast to the dot dtype) @ B[cols, slot, r]^T, w = row weight * slot scale in fp32."""
    w = row_weights(gw_ptr, rows, row_on, slot, ok, rows_per_group, sgg, sgs)
    hs = (h * (w * scj[None, :])).to(b_ptr.dtype.element_ty)
    bt = tl.load(b_ptr + slot.to(tl.int64)[:, None] * sbs + r[:, None] * sbr + cols[None, :] * sbn,
                 mask=ok[:, None], other=0.0)  # [RC, BN]
    return mma(hs, bt, acc, UPCAST, IEEE)


@triton.jit
def _tile(
    y_ptr, x_ptr, w_ptr, bias_ptr, a_ptr, b_ptr, gw_ptr, h_ptr,
    pid_m, pid_n, row_on, end, width, rk, sc, total,
    M, K, N, R, P, rows_per_group,
    sym, syn, sxm, sxk, swn, swk, sas, sar, sak, sbn, sbs, sbr, sgg, sgs, shp, shm, shc,
    S_PAD: tl.constexpr, PRE: tl.constexpr, MORE: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RC: tl.constexpr, FITS: tl.constexpr,
):
    """One [BM, BN] tile of y: GEMM K loop (+ in-loop shrink), expand, bias, one cast. MORE (in-loop): live rank
    may exceed RC columns; FITS: it does not."""
    rows = pid_m * BM + tl.arange(0, BM)
    row_in = rows < M
    rows = rows.to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_in = cols < N
    cols_ld = (cols % N).to(tl.int64)  # edge tiles load in-range duplicates; the store masks them
    kk = tl.arange(0, BK)
    x_p = x_ptr + (rows % M)[:, None] * sxm + kk[None, :] * sxk  # [BM, BK]
    w_p = w_ptr + cols_ld[None, :] * swn + kk[:, None] * swk  # [BK, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if PRE:
        for k0 in range(0, K, BK):
            if EVEN_K:
                xt = tl.load(x_p)
                wt = tl.load(w_p)
            else:
                xt = tl.load(x_p, mask=(k0 + kk)[None, :] < K, other=0.0)
                wt = tl.load(w_p, mask=(k0 + kk)[:, None] < K, other=0.0)
            acc = mma(xt, wt, acc, UPCAST, IEEE)
            x_p += BK * sxk
            w_p += BK * swk
        for c0 in range(0, total, RC):
            slot, r, ok, scj = packed_columns(c0, end, width, rk, sc, S_PAD, RC)
            hp = h_ptr + rows[:, None] * shm + (slot * R + r).to(tl.int64)[None, :] * shc
            m = row_on[:, None] & ok[None, :]
            h = tl.zeros((BM, RC), dtype=tl.float32)
            for p in range(0, P):  # partial sums of a K-split shrink
                h += tl.load(hp + p * shp, mask=m, other=0.0)
            acc = _expand(acc, h, b_ptr, gw_ptr, rows, row_on, slot, r, ok, scj, cols_ld,
                          rows_per_group, sbn, sbs, sbr, sgg, sgs, UPCAST, IEEE)
    else:
        slot, r, ok, scj = packed_columns(0, end, width, rk, sc, S_PAD, RC)
        a_p = a_ptr + slot.to(tl.int64)[None, :] * sas + r[None, :] * sar + kk[:, None] * sak  # [BK, RC]
        h = tl.zeros((BM, RC), dtype=tl.float32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                xt = tl.load(x_p)
                wt = tl.load(w_p)
                at = tl.load(a_p, mask=ok[None, :], other=0.0)
            else:
                k_in = (k0 + kk) < K
                xt = tl.load(x_p, mask=k_in[None, :], other=0.0)
                wt = tl.load(w_p, mask=k_in[:, None], other=0.0)
                at = tl.load(a_p, mask=k_in[:, None] & ok[None, :], other=0.0)
            acc = mma(xt, wt, acc, UPCAST, IEEE)
            h = mma(xt, at, h, UPCAST, IEEE)
            x_p += BK * sxk
            w_p += BK * swk
            a_p += BK * sak
        acc = _expand(acc, h, b_ptr, gw_ptr, rows, row_on, slot, r, ok, scj, cols_ld,
                      rows_per_group, sbn, sbs, sbr, sgg, sgs, UPCAST, IEEE)
        if MORE and not FITS:  # live rank beyond RC columns: shrink again from x (L2-resident by now)
            for c0 in range(RC, total, RC):
                slot, r, ok, scj = packed_columns(c0, end, width, rk, sc, S_PAD, RC)
                h = shrink_tile(x_ptr, a_ptr, rows, row_on, slot, r, ok, 0, K, sxm, sxk, sas, sar, sak,
                                BM, RC, BK, UPCAST, IEEE, False)
                acc = _expand(acc, h, b_ptr, gw_ptr, rows, row_on, slot, r, ok, scj, cols_ld,
                              rows_per_group, sbn, sbs, sbr, sgg, sgs, UPCAST, IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_ld).to(tl.float32)[None, :]
    yp = y_ptr + rows[:, None] * sym + cols[None, :] * syn
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


@triton.jit
def _one_tile(
    t, y_ptr, x_ptr, w_ptr, bias_ptr, a_ptr, b_ptr, scale_ptr, gw_ptr, ranks_ptr, h_ptr,
    M, K, N, S, R, P, rows_per_group,
    sym, syn, sxm, sxk, swn, swk, sas, sar, sak, sbn, sbs, sbr, ssc, sgg, sgs, shp, shm, shc,
    S_PAD: tl.constexpr, RMAX: tl.constexpr, MORE: tl.constexpr, PRE: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Tile t in grouped order, its packed rank axis, and the narrowest rank tier that holds it."""
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP_M * n_n
    first_m = (t // per_group) * GROUP_M
    group_rows = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_rows
    pid_n = (t % per_group) // group_rows
    rows = pid_m * BM + tl.arange(0, BM)
    row_in = rows < M
    row_on, end, width, rk, sc, total = pack_block(
        scale_ptr, gw_ptr, ranks_ptr, rows.to(tl.int64), row_in, S, R, rows_per_group, ssc, sgg, sgs, True, S_PAD)
    # (the operands go inline: a tuple assigned to a name would turn its constexprs into tensors)
    if PRE:  # h comes precomputed, all RMAX columns of it
        _tile(y_ptr, x_ptr, w_ptr, bias_ptr, a_ptr, b_ptr, gw_ptr, h_ptr, pid_m, pid_n, row_on, end, width, rk, sc,
              total, M, K, N, R, P, rows_per_group, sym, syn, sxm, sxk, swn, swk, sas, sar, sak, sbn, sbs, sbr,
              sgg, sgs, shp, shm, shc, S_PAD, True, False, HAS_BIAS, EVEN_K, UPCAST, IEEE, BM, BN, BK, RMAX, True)
    else:  # a narrow live rank runs a narrow h (all tiers compiled once; no recompile on a switch)
        rank_tiers(_tile, (y_ptr, x_ptr, w_ptr, bias_ptr, a_ptr, b_ptr, gw_ptr, h_ptr, pid_m, pid_n, row_on, end,
                           width, rk, sc, total, M, K, N, R, P, rows_per_group, sym, syn, sxm, sxk, swn, swk, sas,
                           sar, sak, sbn, sbs, sbr, sgg, sgs, shp, shm, shc, S_PAD, False, MORE, HAS_BIAS, EVEN_K,
                           UPCAST, IEEE, BM, BN, BK), total, RMAX)


def lora_linear_kernel(
    y_ptr,  # [M, N] output
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] base weight
    bias_ptr,  # [N] (HAS_BIAS)
    a_ptr,  # [S, R, K]
    b_ptr,  # [N, S, R]
    scale_ptr,  # [S] fp32
    gw_ptr,  # [G, S] fp32
    ranks_ptr,  # [S] int32
    h_ptr,  # [P, M, S*R] fp32 (PRE)
    M, K, N, S, R, P, rows_per_group, M_BUCKET, NUM_SMS,
    sym, syn, sxm, sxk, swn, swk, sas, sar, sak, sbn, sbs, sbr, ssc, sgg, sgs, shp, shm, shc,
    S_PAD: tl.constexpr, RMAX: tl.constexpr, MORE: tl.constexpr, PRE: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
):
    if PERSISTENT:
        for t in range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), NUM_SMS):
            _one_tile(t, y_ptr, x_ptr, w_ptr, bias_ptr, a_ptr, b_ptr, scale_ptr, gw_ptr, ranks_ptr, h_ptr,
                      M, K, N, S, R, P, rows_per_group, sym, syn, sxm, sxk, swn, swk, sas, sar, sak, sbn, sbs, sbr,
                      ssc, sgg, sgs, shp, shm, shc, S_PAD, RMAX, MORE, PRE, HAS_BIAS, EVEN_K, UPCAST, IEEE,
                      BM, BN, BK, GROUP_M)
    else:
        _one_tile(tl.program_id(0), y_ptr, x_ptr, w_ptr, bias_ptr, a_ptr, b_ptr, scale_ptr, gw_ptr, ranks_ptr, h_ptr,
                  M, K, N, S, R, P, rows_per_group, sym, syn, sxm, sxk, swn, swk, sas, sar, sak, sbn, sbs, sbr,
                  ssc, sgg, sgs, shp, shm, shc, S_PAD, RMAX, MORE, PRE, HAS_BIAS, EVEN_K, UPCAST, IEEE,
                  BM, BN, BK, GROUP_M)


def _tune_bench(fn, quantiles=None):
    """Autotune timing on GPU time alone (a CUDA graph of repeats): eager launches of a kernel with this
    many arguments cost tens of microseconds of host time, which would hide the tile differences. (Its base weight
    alone exceeds L2 at full size; the other kernels' tuning flushes L2, config.tune_bench.)"""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=20, quantiles=quantiles)


_KERNELS = C.kernels(lora_linear_kernel, CONFIGS, key=["M_BUCKET", "K", "N", "RMAX", "PRE"], do_bench=_tune_bench)
_JIT = _KERNELS[(False, False)].fn  # the jitted kernel (every autotuner above wraps this one)


def launch_lora_linear(x, W, bias, A, B, scale, group_weight, ranks, pre: bool = False,
                       config: triton.Config | None = None) -> torch.Tensor:
    """lora_linear's fused launch (operands and shapes as fdlora.kernels.ops): `pre` runs the shrink first and the
    GEMM with the expand in its epilogue; `config` runs that config instead of autotuning (tests, sweeps)."""
    M, K = x.shape
    N = W.shape[0]
    S, R, _ = A.shape
    G = group_weight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    width = S * (-(-R // 16) * 16)
    RMAX = C.rank_tile(width)
    C.check_blocks([] if config is None else [config], RMAX=RMAX)
    sms = C.device_sms(x)
    ranks = ranks.contiguous()
    h = launch_shrink(x, A, scale, ranks) if pre else scale.view(1, 1, -1)  # not read unless PRE

    def grid(meta):
        tiles = C.cdiv(M, meta["BM"]) * C.cdiv(N, meta["BN"])
        return (min(tiles, sms) if meta["PERSISTENT"] else tiles,)

    args = (
        y, x, W, bias if bias is not None else y, A, B, scale, group_weight, ranks, h,
        M, K, N, S, R, h.shape[0], M // G, C.bucket(M), sms,
        y.stride(0), y.stride(1), x.stride(0), x.stride(1), W.stride(0), W.stride(1),
        A.stride(0), A.stride(1), A.stride(2), B.stride(0), B.stride(1), B.stride(2),
        scale.stride(0), group_weight.stride(0), group_weight.stride(1), *(h.stride() if pre else (0, 0, 0)),
    )
    flags = dict(S_PAD=C.slot_pad(S), RMAX=RMAX, MORE=width > RMAX, PRE=pre, HAS_BIAS=bias is not None,
                 EVEN_K=K % MAX_BK == 0, **C.dot_flags(A.dtype))
    C.launch(_KERNELS, M, grid, (C.bucket(M), K, N, RMAX, pre, x.dtype, bias is not None), *args,
             config=config, **flags)
    return y


def check_linear(x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor,
                 B: torch.Tensor, scale: torch.Tensor, group_weight: torch.Tensor, ranks: torch.Tensor) -> None:
    """Shapes and dtypes lora_linear relies on; the message says what to pass instead."""
    C.check_operands("lora_linear", None, x, A, B, scale=scale, group_weight=group_weight, ranks=ranks)
    M, K = x.shape
    S = A.shape[0]
    G = group_weight.shape[0]
    why = None
    if W.dim() != 2 or W.shape[1] != K or W.shape[0] != B.shape[0]:
        why = f"W must be [N, K] = [{B.shape[0]}, {K}] (the nn.Linear weight), got {tuple(W.shape)}."
    elif W.dtype != x.dtype:
        why = f"W is {W.dtype} but x is {x.dtype}; the base weight and the bank must share one dtype."
    elif bias is not None and (tuple(bias.shape) != (W.shape[0],) or bias.dtype != x.dtype):
        why = f"bias must be [N] = [{W.shape[0]}] in {x.dtype}, got {tuple(bias.shape)} {bias.dtype}."
    elif group_weight.shape[1] != S or scale.shape[0] != S or ranks.shape[0] != S or G < 1 or M % G:
        why = (f"scale {tuple(scale.shape)}, group_weight {tuple(group_weight.shape)} and ranks "
               f"{tuple(ranks.shape)} must be [S], [G, S], [S] with S={S} and G dividing M={M}.")
    elif len({t.device for t in (x, W, A)} | ({bias.device} if bias is not None else set())) > 1:
        why = "x, W, bias and the bank are on different devices; move them to one."
    if why is not None:
        raise C.FdLoraError(f"fdlora triton lora_linear: {why}")


def run_path(path: str, x, W, bias, A, B, scale, group_weight, ranks) -> torch.Tensor:
    """Run one dispatch path (see lora_linear_dispatch.PATHS) on lora_linear's operands (shapes as
    fdlora.kernels.ops); all of them compute the same y."""
    if path in ("fused", "fused_pre"):
        return launch_lora_linear(x, W, bias, A, B, scale, group_weight, ranks, pre=path == "fused_pre")
    if path == "merged":
        merged = launch_merge(W, A, B, scale, group_weight, ranks)  # [G, N, K]
        G = merged.shape[0]
        if G == 1:
            return F.linear(x, merged[0], bias)
        M, K = x.shape
        y = torch.bmm(x.view(G, M // G, K), merged.transpose(1, 2)).view(M, -1)  # rows of a group are contiguous
        return y if bias is None else y.add_(bias)
    y = F.linear(x, W, bias)
    if path == "cublas_delta":
        from fdlora.kernels.triton.forward.lora_delta import lora_delta  # the delta ops' module; imported on first use

        lora_delta(y, x, A, B, scale, group_weight, ranks)
    else:
        from fdlora.kernels.ops import lora_delta

        lora_delta(y, x, A, B, scale, group_weight, ranks)
    return y


# the contract's op: fdlora.kernels.ops.lora_linear
def lora_linear(x, W, bias, A, B, scale, group_weight, ranks) -> torch.Tensor:
    check_linear(x, W, bias, A, B, scale, group_weight, ranks)
    M, K = C.dims(x)  # plain ints: the plan and the launch are per concrete shape
    N = C.dims(W)[0]
    if M == 0 or N == 0 or K == 0:
        return F.linear(x, W, bias)
    S, R, _ = C.dims(A)
    G = C.dims(group_weight)[0]
    problem = D.Problem(M, K, N, S, R, x.dtype, x.device.type, C.device_sms(x), G)
    plan = D.decided(problem)
    if plan is None:  # the first call of this shape
        run = None
        if (x.is_cuda and type(x) is torch.Tensor and not torch.compiler.is_compiling()
                and not torch.cuda.is_current_stream_capturing()):  # real tensors, eager: the plan may time paths
            def run(path: str) -> torch.Tensor:
                return run_path(path, x, W, bias, A, B, scale, group_weight, ranks)
        plan = D.plan(problem, run)
    return run_path(plan.path, x, W, bias, A, B, scale, group_weight, ranks)


# The registered op (torch.compile / CUDA graphs / opcheck). Eager callers with plain tensors may call
# `lora_linear` itself inside set_wrap_triton_enabled(False), as ops.py does for the delta ops.
lora_linear_op = C.register(OPS["lora_linear"], lora_linear)
