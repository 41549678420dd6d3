"""Tile helpers shared by the LoRA kernels: fp32 dot, packed rank columns, shrink, expand-add.

Packed rank axis (the "rank-sum adapter" of DESIGN.md): for one block of rows, the slots that
are live there (scale != 0, some row weight != 0, rank > 0) are laid side by side on one rank
axis, each taking its live rank rounded up to 16 columns. A pass covers RC packed columns, so a
block's h = x A^T is [BM, RC] in registers, whatever slots are active and wherever they sit in
the bank; inactive slots and rank padding are never loaded (the masks skip their memory).
Idea: Punica/S-LoRA's SGMV gathers weights by slot index; here the gather is per rank column so
that several slots share one tensor-core tile.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b in fp32. UPCAST: the CPU interpreter mis-computes bf16 dots; IEEE: fp32 without tf32."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def pack_block(
    scale_ptr, gw_ptr, ranks_ptr,
    rows, row_in,  # [BM] int64 row index, row < M
    S, R, rows_per_group, ssc, sgg, sgs,
    HAS_RANKS: tl.constexpr, S_PAD: tl.constexpr,
):
    """Which rows and slots are live in this row block, and the packed rank axis they make.

    Row m has weight scale[s] * group_weight[m // rows_per_group, s] for slot s. Returns
    (row_on [BM], end [S_PAD], width [S_PAD], rk [S_PAD], sc [S_PAD], total packed columns).
    """
    s = tl.arange(0, S_PAD)
    s_in = s < S
    sc = tl.load(scale_ptr + s * ssc, mask=s_in, other=0.0)
    if HAS_RANKS:
        rk = tl.load(ranks_ptr + s, mask=s_in, other=0)
    else:
        rk = tl.where(s_in, R, 0)
    grp = rows // rows_per_group
    w = tl.load(gw_ptr + grp[:, None] * sgg + s[None, :] * sgs, mask=row_in[:, None] & s_in[None, :], other=0.0)
    w = tl.where((rk > 0)[None, :], tl.abs(w * sc[None, :]), 0.0)  # [BM, S_PAD]
    row_on = tl.max(w, axis=1) > 0
    width = tl.where(tl.max(w, axis=0) > 0, (rk + 15) // 16 * 16, 0)
    end = tl.cumsum(width, axis=0)
    return row_on, end, width, rk, sc, tl.sum(width, axis=0)


@triton.jit
def row_block(
    scale_ptr, gw_ptr, ranks_ptr, M, S, R, rows_per_group, ssc, sgg, sgs,
    HAS_RANKS: tl.constexpr, S_PAD: tl.constexpr, BM: tl.constexpr,
):
    """This program's BM rows (int64, block program_id(0)) and pack_block's packed rank axis over them:
    (rows, row_on, end, width, rk, sc, total)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_in = rows < M
    rows = rows.to(tl.int64)
    row_on, end, width, rk, sc, total = pack_block(
        scale_ptr, gw_ptr, ranks_ptr, rows, row_in, S, R, rows_per_group, ssc, sgg, sgs, HAS_RANKS, S_PAD)
    return rows, row_on, end, width, rk, sc, total


@triton.jit
def rank_tiers(run_pass: tl.constexpr, args, rest, RMAX: tl.constexpr):
    """run_pass(*args, RC, FITS) with the narrowest rank tile RC of 16, 32 and RMAX that holds `rest` packed columns.

    Every tier is compiled with the kernel, so a narrow live rank runs narrow tiles and a change of the bank's live
    ranks never recompiles. FITS: RC was chosen because `rest` fits in it (no columns are left for a later pass);
    False where RMAX forced the tier.
    """
    if RMAX == 16:
        run_pass(*args, 16, False)
    elif rest <= 16:
        run_pass(*args, 16, True)
    elif RMAX == 32:
        run_pass(*args, 32, False)
    elif rest <= 32:
        run_pass(*args, 32, True)
    else:
        run_pass(*args, RMAX, False)


@triton.jit
def packed_columns(c0, end, width, rk, sc, S_PAD: tl.constexpr, RC: tl.constexpr):
    """Packed columns c0..c0+RC -> (slot [RC], rank row [RC], valid [RC], slot scale [RC]).

    Valid columns are the live rank rounded up to 16 (the bank zero-pads each slot to R).

    end/width/rk/sc are [S_PAD]: cumulative end, width (0 = not live), live rank and scale per slot.
    """
    j = c0 + tl.arange(0, RC)
    slot = tl.sum((end[None, :] <= j[:, None]).to(tl.int32), axis=1)  # first slot ending after j
    hit = tl.arange(0, S_PAD)[None, :] == slot[:, None]  # [RC, S_PAD]
    start = tl.sum(tl.where(hit, (end - width)[None, :], 0), axis=1)
    live = tl.sum(tl.where(hit, ((rk + 15) // 16 * 16)[None, :], 0), axis=1)  # live rank, whole granules
    scj = tl.sum(tl.where(hit, sc[None, :], 0.0), axis=1)
    # Slots start on 16-column boundaries and cover whole 16-column granules (the bank's zero padding
    # fills the last one), so slot and validity are constant, and r contiguous, over groups of 16:
    # the hints let loads of B (contiguous along r) vectorize.
    r = tl.max_contiguous(tl.multiple_of(j - start, 16), 16)
    ok = tl.max_constancy(r < live, 16)  # past the last slot nothing hits: live = 0
    return tl.max_constancy(tl.where(ok, slot, 0), 16), r, ok, scj


@triton.jit
def row_weights(gw_ptr, rows, row_on, slot, ok, rows_per_group, sgg, sgs):
    """w [BM, RC] fp32: group_weight[row's group, slot] of each row and packed column, 0 off the live ones."""
    grp = rows // rows_per_group
    return tl.load(gw_ptr + grp[:, None] * sgg + slot[None, :] * sgs, mask=row_on[:, None] & ok[None, :], other=0.0)


@triton.jit
def weight_tile(N, K, BN: tl.constexpr, BK: tl.constexpr):
    """Program program_id(0)'s BN x BK tile of a weight [N, K] (tiles in row-major order): rows nn [BN] int64 and
    their mask, columns kk [BK] and theirs."""
    n_k = tl.cdiv(K, BK)
    nn = (tl.program_id(0) // n_k) * BN + tl.arange(0, BN)
    kk = (tl.program_id(0) % n_k) * BK + tl.arange(0, BK)
    n_in = nn < N
    k_in = kk < K
    return nn.to(tl.int64), n_in, kk, k_in


@triton.jit
def merge_columns(
    acc,  # [BN, BK] fp32 tile of W'
    nn, n_in, kk, k_in,  # [BN] int64 rows and mask, [BK] columns and mask
    slot, r, ok, wj,  # [RC] packed columns and their fp32 weight
    a_ptr, b_ptr, sas, sar, sak, sbn, sbs, sbr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """acc + (B[nn, slot, r] * wj, cast to A's dtype) @ A[slot, r, kk]: RC packed rank columns merged into W'."""
    slot64 = slot.to(tl.int64)
    bt = tl.load(b_ptr + nn[:, None] * sbn + slot64[None, :] * sbs + r[None, :] * sbr,
                 mask=n_in[:, None] & ok[None, :], other=0.0)  # [BN, RC]
    at = tl.load(a_ptr + slot64[:, None] * sas + r[:, None] * sar + kk[None, :] * sak,
                 mask=ok[:, None] & k_in[None, :], other=0.0)  # [RC, BK]
    return mma((bt.to(tl.float32) * wj[None, :]).to(a_ptr.dtype.element_ty), at, acc, UPCAST, IEEE)


@triton.jit
def shrink_tile(
    x_ptr, a_ptr,
    rows, row_on,  # [BM] int64 row index, rows to compute
    slot, r, ok,  # [RC] slot, rank row, valid column
    k_lo, k_hi, sxm, sxk, sas, sar, sak,
    BM: tl.constexpr, RC: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    WRAP: tl.constexpr,
):
    """h [BM, RC] fp32 = x[rows, k_lo:k_hi] @ A[slot, r, k_lo:k_hi]^T.

    WRAP (k_lo = 0; grid axis 1 is an N split whose programs each compute this same h): each program walks
    K round from its own start, spread over K by its index on axis 1, so that the split's programs request
    different lines of A at any moment instead of the same ones.
    """
    acc = tl.zeros((BM, RC), dtype=tl.float32)
    x_row = x_ptr + rows * sxm  # [BM]
    a_col = a_ptr + slot.to(tl.int64) * sas + r * sar  # [RC]
    k_tiles = tl.cdiv(k_hi, BK)  # WRAP only (unused otherwise)
    k_round = k_tiles * BK
    k_first = (tl.program_id(1) * k_tiles // tl.num_programs(1)) * BK
    for k0 in range(k_lo, k_hi, BK):
        kb = k0
        if WRAP:
            kb = tl.multiple_of(tl.where(k0 + k_first >= k_round, k0 + k_first - k_round, k0 + k_first), BK)
        kk = kb + tl.arange(0, BK)
        k_in = kk < k_hi
        xt = tl.load(x_row[:, None] + kk[None, :] * sxk, mask=row_on[:, None] & k_in[None, :], other=0.0)
        at = tl.load(a_col[None, :] + kk[:, None] * sak, mask=ok[None, :] & k_in[:, None], other=0.0)
        acc = mma(xt, at, acc, UPCAST, IEEE)
    return acc


@triton.jit
def first_tiles(
    y_ptr, b_ptr,
    rows, row_on,  # [BM] int64 row index, rows to update
    slot, r, ok,  # [RC]
    N, sym, syn, sbn, sbs, sbr,
    BM: tl.constexpr, BN: tl.constexpr, RC: tl.constexpr, EARLY: tl.constexpr,
):
    """With EARLY, the y tile [BM, BN] and B tile [RC, BN] that this program's N sweep starts at, loaded before the
    shrink so that their latency overlaps its K loop (decode: a program has one N tile, and this load was the
    last dependent one on its path); else zeros that expand_add_tiles ignores."""
    if EARLY:
        nn = tl.program_id(1) * BN + tl.arange(0, BN)
        n_in = nn < N
        y0 = tl.load(y_ptr + rows[:, None] * sym + nn[None, :] * syn, mask=row_on[:, None] & n_in[None, :], other=0.0)
        b0 = tl.load(b_ptr + slot.to(tl.int64)[:, None] * sbs + r[:, None] * sbr + nn[None, :].to(tl.int64) * sbn,
                     mask=ok[:, None] & n_in[None, :], other=0.0)
    else:
        y0 = tl.zeros((BM, BN), dtype=y_ptr.dtype.element_ty)
        b0 = tl.zeros((RC, BN), dtype=b_ptr.dtype.element_ty)
    return y0, b0


@triton.jit
def expand_add_tiles(
    y_ptr, b_ptr,
    h,  # [BM, RC] scaled h, in the dot dtype
    y0, b0,  # first_tiles: the first N tile's y and B when PREFETCH == 2
    rows, row_on,  # [BM] int64 row index, rows to update
    slot, r, ok,  # [RC]
    N, sym, syn, sbn, sbs, sbr,
    BN: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr,
):
    """y[rows, n] += h @ B[n, slot, r]^T for this program's N tiles (fp32 add, one cast): grid axis 1 splits the N
    sweep, program j taking tiles j, j + num_programs(1), ...

    PREFETCH (1 or 2) loads the next y tile before adding into the current one: the y stream is what
    bounds this loop, and the compiler's pipeliner only prefetches dot operands, not the accumulator.
    PREFETCH == 2 also takes the first y and B tiles from first_tiles (loaded before the shrink) and
    prefetches B one tile ahead too.
    """
    n_first = tl.program_id(1) * BN
    n_step = tl.num_programs(1) * BN
    y_row = y_ptr + rows * sym  # [BM]
    b_col = b_ptr + slot.to(tl.int64) * sbs + r * sbr  # [RC]
    nn = n_first + tl.arange(0, BN)
    y_next = tl.zeros((h.shape[0], BN), dtype=y_ptr.dtype.element_ty)
    b_next = b0
    if PREFETCH == 2:
        y_next = y0
    elif PREFETCH:
        y_next = tl.load(y_row[:, None] + nn[None, :] * syn, mask=row_on[:, None] & (nn < N)[None, :], other=0.0)
    for n0 in range(n_first, N, n_step):
        nn = n0 + tl.arange(0, BN)
        n_in = nn < N
        m = row_on[:, None] & n_in[None, :]
        yp = y_row[:, None] + nn[None, :] * syn
        nx = nn + n_step
        if PREFETCH:
            y_cur = y_next
            y_next = tl.load(y_row[:, None] + nx[None, :] * syn, mask=row_on[:, None] & (nx < N)[None, :], other=0.0)
        else:
            y_cur = tl.load(yp, mask=m, other=0.0)
        if PREFETCH == 2:
            bt = b_next
            b_next = tl.load(b_col[:, None] + nx[None, :].to(tl.int64) * sbn, mask=ok[:, None] & (nx < N)[None, :],
                             other=0.0)
        else:
            bt = tl.load(b_col[:, None] + nn[None, :].to(tl.int64) * sbn, mask=ok[:, None] & n_in[None, :], other=0.0)
        acc = mma(h, bt, y_cur.to(tl.float32), UPCAST, IEEE)
        tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=m)
