"""lora_expand_add: y += (h * w) B^T, the second half of the split path.

    w[m, s] = scale[s] * group_weight[m // (M / G), s]
    y[m, n] += sum_{s, r} w[m, s] * h[m, s*R + r] * B[n, s, r]        (fp32, one cast)

h comes from lora_shrink, possibly as P partial sums [P, M, S*R] that are added here. Each program
owns BM rows, packs the slots live in them onto one rank axis (tiles.py), loads that h tile once
and sweeps its N tiles; with few rows the N sweep is split across programs. Slots at weight 0
are never read (their h columns may be unwritten). Idea: Punica's expand kernel, with the slots
of a row block merged into one tensor-core tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from . import config as C
from .tiles import expand_add_tiles, first_tiles, pack_block, packed_columns


@triton.jit
def _pass(
    y_ptr, h_ptr, b_ptr, gw_ptr,
    rows, row_on, end, width, rk, sc, c0,
    N, P, R, rows_per_group, sym, syn, shp, shm, shc, sbn, sbs, sbr, sgg, sgs,
    S_PAD: tl.constexpr, RC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr,
):
    slot, r, ok, scj = packed_columns(c0, end, width, rk, sc, S_PAD, RC)
    y0, b0 = first_tiles(y_ptr, b_ptr, rows, row_on, slot, r, ok, N, tl.program_id(1) * BN, sym, syn, sbn, sbs, sbr,
                         BM, BN, RC, PREFETCH == 2)
    hp = h_ptr + rows[:, None] * shm + (slot * R + r).to(tl.int64)[None, :] * shc
    m = row_on[:, None] & ok[None, :]
    h = tl.zeros((BM, RC), dtype=tl.float32)
    for p in range(0, P):
        h += tl.load(hp + p * shp, mask=m, other=0.0)
    grp = rows // rows_per_group
    w = tl.load(gw_ptr + grp[:, None] * sgg + slot[None, :] * sgs, mask=m, other=0.0)
    h = (h * (w * scj[None, :])).to(b_ptr.dtype.element_ty)
    expand_add_tiles(y_ptr, b_ptr, h, y0, b0, rows, row_on, slot, r, ok, N, tl.program_id(1) * BN,
                     tl.num_programs(1) * BN, sym, syn, sbn, sbs, sbr, BN, UPCAST, IEEE, PREFETCH)


def lora_expand_add_kernel(
    y_ptr,  # [M, N] updated in place
    h_ptr,  # [P, M, S*R] fp32
    b_ptr,  # [N, S, R]
    scale_ptr,  # [S] fp32
    gw_ptr,  # [G, S] fp32
    ranks_ptr,  # [S] int32 (HAS_RANKS; else every slot has rank R)
    M, N, S, R, P, rows_per_group, M_BUCKET,
    sym, syn, shp, shm, shc, sbn, sbs, sbr, ssc, sgg, sgs,
    S_PAD: tl.constexpr, RMAX: tl.constexpr, HAS_RANKS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, NSPLIT: tl.constexpr,
    WRAP: tl.constexpr = False,  # a DELTA-table flag of the kernels with a shrink; nothing to walk here
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_in = rows < M
    rows = rows.to(tl.int64)
    row_on, end, width, rk, sc, total = pack_block(
        scale_ptr, gw_ptr, ranks_ptr, rows, row_in, S, R, rows_per_group, ssc, sgg, sgs, HAS_RANKS, S_PAD)
    for c0 in range(0, total, RMAX):
        rest = total - c0
        if RMAX == 16:
            _pass(y_ptr, h_ptr, b_ptr, gw_ptr, rows, row_on, end, width, rk, sc, c0, N, P, R, rows_per_group,
                  sym, syn, shp, shm, shc, sbn, sbs, sbr, sgg, sgs, S_PAD, 16, BM, BN, UPCAST, IEEE, PREFETCH)
        elif rest <= 16:
            _pass(y_ptr, h_ptr, b_ptr, gw_ptr, rows, row_on, end, width, rk, sc, c0, N, P, R, rows_per_group,
                  sym, syn, shp, shm, shc, sbn, sbs, sbr, sgg, sgs, S_PAD, 16, BM, BN, UPCAST, IEEE, PREFETCH)
        elif RMAX == 32:
            _pass(y_ptr, h_ptr, b_ptr, gw_ptr, rows, row_on, end, width, rk, sc, c0, N, P, R, rows_per_group,
                  sym, syn, shp, shm, shc, sbn, sbs, sbr, sgg, sgs, S_PAD, 32, BM, BN, UPCAST, IEEE, PREFETCH)
        elif rest <= 32:
            _pass(y_ptr, h_ptr, b_ptr, gw_ptr, rows, row_on, end, width, rk, sc, c0, N, P, R, rows_per_group,
                  sym, syn, shp, shm, shc, sbn, sbs, sbr, sgg, sgs, S_PAD, 32, BM, BN, UPCAST, IEEE, PREFETCH)
        else:
            _pass(y_ptr, h_ptr, b_ptr, gw_ptr, rows, row_on, end, width, rk, sc, c0, N, P, R, rows_per_group,
                  sym, syn, shp, shm, shc, sbn, sbs, sbr, sgg, sgs, S_PAD, RMAX, BM, BN, UPCAST, IEEE, PREFETCH)


_KERNELS = C.kernels(lora_expand_add_kernel, C.DELTA, key=["M_BUCKET", "N", "RMAX", "S_PAD"], restore_value=["y_ptr"])


def launch_expand_add(
    y: torch.Tensor,  # [M, N]
    h: torch.Tensor,  # [P, M, S*R] fp32 (partial sums) or [M, S*R]
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    group_weight: torch.Tensor,  # [G, S] fp32
    ranks: torch.Tensor | None = None,  # [S] int32; None: every slot uses all R columns
) -> None:
    M, N = C.dims(y)
    _, S, R = C.dims(B)
    h3 = h if h.dim() == 3 else h.unsqueeze(0)
    G = C.dims(group_weight)[0]
    RMAX = C.rank_tile(S * (-(-R // 16) * 16))
    C.check_blocks([], RMAX=RMAX)
    sms = C.device_sms(y)
    has_ranks = ranks is not None
    ranks = ranks.contiguous() if has_ranks else scale

    def grid(meta):
        return (C.cdiv(M, meta["BM"]), C.n_split(meta, M, N, sms), 1)

    C.launch(
        _KERNELS, M, grid, (C.bucket(M), N, RMAX, S, y.dtype, B.dtype, has_ranks),
        y, h3, B, scale, group_weight, ranks,
        M, N, S, R, h3.shape[0], M // G, C.bucket(M),
        *C.strides(y), *C.strides(h3), *C.strides(B), *C.strides(scale), *C.strides(group_weight),
        S_PAD=C.slot_pad(S), RMAX=RMAX, HAS_RANKS=has_ranks, **C.dot_flags(B.dtype),
    )


def lora_expand_add(
    y: torch.Tensor,  # [M, N], updated in place
    h: torch.Tensor,  # [M, S*R] fp32, or [P, M, S*R]: partial sums (lora_shrink_split), added here
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32
    group_weight: torch.Tensor,  # [G, S] fp32
) -> None:
    C.check_operands("lora_expand_add", y, None, None, B, scale=scale, group_weight=group_weight, h=h)
    M, N = C.dims(y)
    _, S, R = C.dims(B)
    G = C.dims(group_weight)[0]
    if (tuple(h.shape[-2:]) != (M, S * R) or h.dim() not in (2, 3) or group_weight.shape[1] != S
            or scale.shape[0] != S or G < 1 or M % G):
        raise C.FdLoraError(
            f"fdlora triton lora_expand_add: h {tuple(h.shape)}, scale {tuple(scale.shape)} and group_weight "
            f"{tuple(group_weight.shape)} must be [M, S*R] (or [P, M, S*R]), [S], [G, S] with M={M}, S={S}, R={R}, "
            "G dividing M."
        )
    if M == 0 or N == 0:
        return
    launch_expand_add(y, h, B, scale, group_weight)


lora_expand_add_op = triton_op("fdlora::lora_expand_add", lora_expand_add, mutates_args={"y"})
