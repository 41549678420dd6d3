"""lora_expand_add: y += (h * w) B^T, the second half of the split path.

    w[m, s] = scale[s] * group_weight[m // (M / G), s]
    y[m, n] += sum_{s, r} w[m, s] * h[m, s*R + r] * B[n, s, r]        (fp32, one cast)

h comes from lora_shrink, possibly as P partial sums [P, M, S*R] that are added here, or as [M, S, R] /
[P, M, S, R] with any strides: one member's columns of a slot-major h (per-row mode's shared shrink,
fdlora.layers.modules.shared_shrink). Each program owns BM rows, packs the slots live in them onto one rank axis
(tiles.py), loads that h tile once and sweeps its N tiles; with few rows the N sweep is split across
programs. No h element whose weight w[m, s] is 0 is ever read: slots at weight 0 are not packed, and
with per-row weights (G > 1) a row's columns of a packed slot are masked where its own weight is 0
(lora_shrink_split by row leaves them unwritten; NaN there must not reach y). Idea: Punica's expand
kernel, with the slots of a row block merged into one tensor-core tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fdlora.kernels.ops import OPS
from fdlora.kernels.triton import config as C

# by name: Inductor copies the jit helpers a kernel names as globals (not attributes of a module)
from ..tiles import expand_add_tiles, first_tiles, packed_columns, rank_tiers, row_block, row_weights


@triton.jit
def _pass(
    c0, y_ptr, h_ptr, b_ptr, gw_ptr,
    rows, row_on, end, width, rk, sc,
    N, P, rows_per_group, sym, syn, shp, shm, shs, shc, sbn, sbs, sbr, sgg, sgs,
    S_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, ROW_W: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr,
    RC: tl.constexpr, FITS: tl.constexpr,
):
    slot, r, ok, scj = packed_columns(c0, end, width, rk, sc, S_PAD, RC)
    y0, b0 = first_tiles(y_ptr, b_ptr, rows, row_on, slot, r, ok, N, sym, syn, sbn, sbs, sbr, BM, BN, RC,
                           PREFETCH == 2)
    m = row_on[:, None] & ok[None, :]
    w = row_weights(gw_ptr, rows, row_on, slot, ok, rows_per_group, sgg, sgs)
    if ROW_W:  # weights differ by row: a packed slot's columns may be unwritten for the rows at weight 0
        m = m & (w != 0)
    hp = h_ptr + rows[:, None] * shm + (slot.to(tl.int64) * shs + r.to(tl.int64) * shc)[None, :]
    h = tl.zeros((BM, RC), dtype=tl.float32)
    for p in range(0, P):
        h += tl.load(hp + p * shp, mask=m, other=0.0)
    h = (h * (w * scj[None, :])).to(b_ptr.dtype.element_ty)
    expand_add_tiles(y_ptr, b_ptr, h, y0, b0, rows, row_on, slot, r, ok, N, sym, syn, sbn, sbs, sbr,
                       BN, UPCAST, IEEE, PREFETCH)


def lora_expand_add_kernel(
    y_ptr,  # [M, N] updated in place
    h_ptr,  # [P, M, S, R] fp32, any strides
    b_ptr,  # [N, S, R]
    scale_ptr,  # [S] fp32
    gw_ptr,  # [G, S] fp32
    ranks_ptr,  # [S] int32 (HAS_RANKS; else every slot has rank R)
    M, N, S, R, P, rows_per_group, M_BUCKET,
    sym, syn, shp, shm, shs, shc, sbn, sbs, sbr, ssc, sgg, sgs,
    S_PAD: tl.constexpr, RMAX: tl.constexpr, HAS_RANKS: tl.constexpr, ROW_W: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, NSPLIT: tl.constexpr,
    WRAP: tl.constexpr = False,  # a DELTA-table flag of the kernels with a shrink; nothing to walk here
):
    rows, row_on, end, width, rk, sc, total = row_block(
        scale_ptr, gw_ptr, ranks_ptr, M, S, R, rows_per_group, ssc, sgg, sgs, HAS_RANKS, S_PAD, BM)
    for c0 in range(0, total, RMAX):
        rank_tiers(_pass, (c0, y_ptr, h_ptr, b_ptr, gw_ptr, rows, row_on, end, width, rk, sc, N, P, rows_per_group,
                             sym, syn, shp, shm, shs, shc, sbn, sbs, sbr, sgg, sgs, S_PAD, BM, BN, ROW_W, UPCAST, IEEE,
                             PREFETCH), total - c0, RMAX)


_KERNELS = C.kernels(lora_expand_add_kernel, C.DELTA, key=["M_BUCKET", "N", "RMAX", "S_PAD"], restore_value=["y_ptr"])


def slot_view(h: torch.Tensor, M: int, S: int, R: int) -> torch.Tensor | None:
    """h [M, S*R] / [P, M, S*R] / [M, S, R] / [P, M, S, R] as the kernel's [P, M, S, R] view (any strides), or None
    when it is none of them. The flat forms first: a 3-D h that fits both ([1, 1, R]) addresses the same either way."""
    if h.dim() in (2, 3) and tuple(h.shape[-2:]) == (M, S * R):
        h = h.unflatten(-1, (S, R))
    elif not (h.dim() in (3, 4) and tuple(h.shape[-3:]) == (M, S, R)):
        return None
    return h if h.dim() == 4 else h.unsqueeze(0)


def launch_expand_add(y, h, B, scale, group_weight, ranks: torch.Tensor | None = None) -> None:
    """lora_expand_add's launch (operands and shapes as fdlora.kernels.ops); with ranks it skips dead slots."""
    M, N = C.dims(y)
    _, S, R = C.dims(B)
    h4 = slot_view(h, M, S, R)
    G = C.dims(group_weight)[0]
    RMAX = C.rank_tile(S * (-(-R // 16) * 16))
    C.check_blocks([], RMAX=RMAX)
    sms = C.device_sms(y)
    has_ranks = ranks is not None
    ranks = ranks.contiguous() if has_ranks else scale

    def grid(meta):
        return (C.cdiv(M, meta["BM"]), C.n_split(meta, M, N, sms), 1)

    C.launch(
        _KERNELS, M, grid, (C.bucket(M), N, RMAX, S, y.dtype, B.dtype, has_ranks, G > 1),
        y, h4, B, scale, group_weight, ranks,
        M, N, S, R, h4.shape[0], M // G, C.bucket(M),
        *C.strides(y), *C.strides(h4), *C.strides(B), *C.strides(scale), *C.strides(group_weight),
        S_PAD=C.slot_pad(S), RMAX=RMAX, HAS_RANKS=has_ranks, ROW_W=G > 1, **C.dot_flags(B.dtype),
    )


def lora_expand_add(y, h, B, scale, group_weight) -> None:  # the contract's op: fdlora.kernels.ops.lora_expand_add
    C.check_operands("lora_expand_add", y, None, None, B, scale=scale, group_weight=group_weight, h=h)
    M, N = C.dims(y)
    _, S, R = C.dims(B)
    G = C.dims(group_weight)[0]
    if slot_view(h, M, S, R) is None or group_weight.shape[1] != S or scale.shape[0] != S or G < 1 or M % G:
        raise C.FdLoraError(
            f"fdlora triton lora_expand_add: h {tuple(h.shape)}, scale {tuple(scale.shape)} and group_weight "
            f"{tuple(group_weight.shape)} must be [M, S*R] (or [P, M, S*R], [M, S, R], [P, M, S, R]), [S], [G, S] "
            f"with M={M}, S={S}, R={R}, G dividing M."
        )
    if M == 0 or N == 0:
        return
    launch_expand_add(y, h, B, scale, group_weight)


lora_expand_add_op = C.register(OPS["lora_expand_add"], lora_expand_add)
