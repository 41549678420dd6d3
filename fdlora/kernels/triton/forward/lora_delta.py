"""lora_delta, blend and per-sample-segment mode: y += ((x A^T) * w) B^T in one launch.

    w[m, s] = scale[s] * group_weight[m // (M / G), s]          (G = 1: blend, G = batch: per sample)
    y[m, :] += sum_s w[m, s] * (x[m] A_s^T) B_s^T

Each program owns BM rows. It packs the slots live in its rows into one rank axis (the rank-sum
adapter, see tiles.py), computes h = x A^T for them once in fp32 (one pass over K), applies w in
fp32, then sweeps its N tiles adding h B^T to y in fp32 with one cast per element. x is read once
and y read and written once per pass; a pass holds up to RMAX packed columns (64), so a wider live
rank takes more passes, each adding to y. With few rows, programs also split the N sweep (each
recomputes its h; see dispatch.py for when the two-launch shrink + expand path wins instead).
Idea: the "fuse shrink and expand, keep h on chip" half of DESIGN.md, after Punica's SGMV layout.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fdlora.kernels.ops import OPS
from fdlora.kernels.triton import config as C
from fdlora.kernels.triton.forward.delta_dispatch import delta_plan
from fdlora.kernels.triton.forward.lora_expand_add import launch_expand_add
from fdlora.kernels.triton.forward.lora_shrink import launch_shrink

# by name: Inductor copies the jit helpers a kernel names as globals (not attributes of a module)
from fdlora.kernels.triton.tiles import (
    expand_add_tiles,
    first_tiles,
    packed_columns,
    rank_tiers,
    row_block,
    row_weights,
    shrink_tile,
)


@triton.jit
def _pass(
    c0, y_ptr, x_ptr, a_ptr, b_ptr, gw_ptr,
    rows, row_on, end, width, rk, sc,
    K, N, rows_per_group, sym, syn, sxm, sxk, sas, sar, sak, sbn, sbs, sbr, sgg, sgs,
    S_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr, WRAP: tl.constexpr,
    RC: tl.constexpr, FITS: tl.constexpr,
):
    slot, r, ok, scj = packed_columns(c0, end, width, rk, sc, S_PAD, RC)
    y0, b0 = first_tiles(y_ptr, b_ptr, rows, row_on, slot, r, ok, N, sym, syn, sbn, sbs, sbr, BM, BN, RC,
                           PREFETCH == 2)
    h = shrink_tile(x_ptr, a_ptr, rows, row_on, slot, r, ok, 0, K, sxm, sxk, sas, sar, sak, BM, RC, BK, UPCAST,
                      IEEE, WRAP)
    w = row_weights(gw_ptr, rows, row_on, slot, ok, rows_per_group, sgg, sgs)
    h = (h * (w * scj[None, :])).to(b_ptr.dtype.element_ty)
    expand_add_tiles(y_ptr, b_ptr, h, y0, b0, rows, row_on, slot, r, ok, N, sym, syn, sbn, sbs, sbr,
                       BN, UPCAST, IEEE, PREFETCH)


def lora_delta_kernel(
    y_ptr,  # [M, N] updated in place
    x_ptr,  # [M, K]
    a_ptr,  # [S, R, K]
    b_ptr,  # [N, S, R]
    scale_ptr,  # [S] fp32
    gw_ptr,  # [G, S] fp32
    ranks_ptr,  # [S] int32
    M, K, N, S, R, rows_per_group, M_BUCKET,
    sym, syn, sxm, sxk, sas, sar, sak, sbn, sbs, sbr, ssc, sgg, sgs,
    S_PAD: tl.constexpr, RMAX: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, NSPLIT: tl.constexpr,
    WRAP: tl.constexpr = False,
):
    rows, row_on, end, width, rk, sc, total = row_block(
        scale_ptr, gw_ptr, ranks_ptr, M, S, R, rows_per_group, ssc, sgg, sgs, True, S_PAD, BM)
    for c0 in range(0, total, RMAX):
        rank_tiers(_pass, (c0, y_ptr, x_ptr, a_ptr, b_ptr, gw_ptr, rows, row_on, end, width, rk, sc, K, N,
                             rows_per_group, sym, syn, sxm, sxk, sas, sar, sak, sbn, sbs, sbr, sgg, sgs,
                             S_PAD, BM, BN, BK, UPCAST, IEEE, PREFETCH, WRAP), total - c0, RMAX)


_KERNELS = C.kernels(lora_delta_kernel, C.DELTA, key=["M_BUCKET", "K", "N", "RMAX", "S_PAD"], restore_value=["y_ptr"])


def launch_fused(y, x, A, B, scale, group_weight, ranks, config: triton.Config | None = None) -> None:
    """lora_delta in one launch (operands and shapes as fdlora.kernels.ops); `config` instead of the tuned one."""
    M, N = C.dims(y)
    S, R, K = C.dims(A)
    G = C.dims(group_weight)[0]
    RMAX = C.rank_tile(S * (-(-R // 16) * 16))
    C.check_blocks([], RMAX=RMAX)
    sms = C.device_sms(y)
    ranks = ranks.contiguous()

    def grid(meta):
        return (C.cdiv(M, meta["BM"]), C.n_split(meta, M, N, sms), 1)

    C.launch(
        _KERNELS, M, grid, (C.bucket(M), K, N, RMAX, S, y.dtype, A.dtype),
        y, x, A, B, scale, group_weight, ranks,
        M, K, N, S, R, M // G, C.bucket(M),
        *C.strides(y), *C.strides(x), *C.strides(A), *C.strides(B), *C.strides(scale), *C.strides(group_weight),
        config=config, S_PAD=C.slot_pad(S), RMAX=RMAX, **C.dot_flags(A.dtype),
    )


def lora_delta(y, x, A, B, scale, group_weight, ranks) -> None:  # the contract's op: fdlora.kernels.ops.lora_delta
    C.check_operands("lora_delta", y, x, A, B, scale=scale, group_weight=group_weight, ranks=ranks)
    M, N = C.dims(y)
    S, R, K = C.dims(A)
    G = C.dims(group_weight)[0]
    if group_weight.shape[1] != S or scale.shape[0] != S or ranks.shape[0] != S or G < 1 or M % G:
        raise C.FdLoraError(
            f"fdlora triton lora_delta: scale {tuple(scale.shape)}, group_weight {tuple(group_weight.shape)} and "
            f"ranks {tuple(ranks.shape)} must be [S], [G, S], [S] with S={S} and G dividing M={M}."
        )
    if M == 0 or N == 0 or K == 0:
        return
    if delta_plan(M, K, N, S, R, A.element_size(), C.device_sms(y)) == "split":
        h = launch_shrink(x, A, scale, ranks)
        launch_expand_add(y, h, B, scale, group_weight, ranks)
    else:
        launch_fused(y, x, A, B, scale, group_weight, ranks)


lora_delta_op = C.register(OPS["lora_delta"], lora_delta)
