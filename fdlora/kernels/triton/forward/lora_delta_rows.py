"""lora_delta_rows, per-row mode (SGMV): row m gets slot row_slot[m] at scale[row_slot[m]].

    y[m, :] += scale[s] * (x[m] A_s^T) B_s^T      with s = row_slot[m]; nothing where s = -1

One launch over (row block, N split, slot). Program (i, j, s) takes the rows of block i whose slot
is s, computes their h = x A_s^T in fp32 over the live rank of s only (rank padding is never
loaded), scales it in fp32 and adds h B_s^T into its share of the N tiles. Rows of different
slots are disjoint, so programs never write the same element: no atomics, rows in any order,
ranks may differ per slot. A program whose slot is absent from its rows (or has scale 0) exits
at once. With few rows (decode) the N and slot axes give the parallelism that the rows lack, so
each live A_s is streamed by its own programs. Idea: Punica / S-LoRA SGMV, fused shrink+expand.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fdlora.kernels.ops import OPS
from fdlora.kernels.triton import config as C
from fdlora.kernels.triton.tiles import expand_add_tiles, first_tiles, rank_tiers, shrink_tile


@triton.jit
def _pass(
    c0, y_ptr, x_ptr, a_ptr, b_ptr,
    rows, row_on, s, live, sc,
    K, N, sym, syn, sxm, sxk, sas, sar, sak, sbn, sbs, sbr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr, WRAP: tl.constexpr,
    RC: tl.constexpr, FITS: tl.constexpr,
):
    r = tl.multiple_of(c0, 16) + tl.arange(0, RC)
    ok = tl.max_constancy(r < live, 16)  # live is a whole number of 16-row granules (bank zero padding)
    slot = s + 0 * r
    y0, b0 = first_tiles(y_ptr, b_ptr, rows, row_on, slot, r, ok, N, sym, syn, sbn, sbs, sbr, BM, BN, RC, PREFETCH == 2)
    h = shrink_tile(x_ptr, a_ptr, rows, row_on, slot, r, ok, 0, K, sxm, sxk, sas, sar, sak, BM, RC, BK, UPCAST, IEEE,
                    WRAP)  # WRAP: the N split's programs of one slot walk K from different starts
    h = (h * sc).to(b_ptr.dtype.element_ty)
    expand_add_tiles(y_ptr, b_ptr, h, y0, b0, rows, row_on, slot, r, ok, N, sym, syn, sbn, sbs, sbr,
                     BN, UPCAST, IEEE, PREFETCH)


def lora_delta_rows_kernel(
    y_ptr,  # [M, N] updated in place
    x_ptr,  # [M, K]
    a_ptr,  # [S, R, K]
    b_ptr,  # [N, S, R]
    scale_ptr,  # [S] fp32
    slot_ptr,  # [M] int32, -1 = no adapter
    ranks_ptr,  # [S] int32
    M, K, N, M_BUCKET,
    sym, syn, sxm, sxk, sas, sar, sak, sbn, sbs, sbr, ssc, srs,
    RMAX: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, NSPLIT: tl.constexpr,
    WRAP: tl.constexpr = False,
):
    s = tl.program_id(2)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_in = rows < M
    row_on = (tl.load(slot_ptr + rows * srs, mask=row_in, other=-1) == s) & row_in
    rows = rows.to(tl.int64)
    sc = tl.load(scale_ptr + s * ssc)
    live = tl.where((sc != 0) & (tl.max(row_on.to(tl.int32), axis=0) > 0), (tl.load(ranks_ptr + s) + 15) // 16 * 16, 0)
    for c0 in range(0, live, RMAX):
        rank_tiers(_pass, (c0, y_ptr, x_ptr, a_ptr, b_ptr, rows, row_on, s, live, sc, K, N, sym, syn, sxm, sxk,
                           sas, sar, sak, sbn, sbs, sbr, BM, BN, BK, UPCAST, IEEE, PREFETCH, WRAP), live - c0, RMAX)


_KERNELS = C.kernels(lora_delta_rows_kernel, C.DELTA, key=["M_BUCKET", "K", "N", "RMAX"], restore_value=["y_ptr"])


KEEP = (0, 1, 4, 5)  # y, x, scale, row_slot: the arguments a kept launch takes anew per call


def launch_rows(y, x, A, B, scale, row_slot, ranks, keep: bool = False,
                config: triton.Config | None = None) -> C.Prepared | None:
    """Launch lora_delta_rows (operands and shapes as fdlora.kernels.ops); with `keep`, also return the launch kept
    ready for repeats on other y, x, scale and row_slot of the same shapes, strides and dtypes (a C.Prepared called
    as ready(y, x, scale, row_slot)), or None (not launched to a compiled kernel yet: the autotuner's first call,
    the interpreter, tracing)."""
    C.check_operands("lora_delta_rows", y, x, A, B, scale=scale, row_slot=row_slot, ranks=ranks)
    M, N = C.dims(y)
    S, R, K = C.dims(A)
    if row_slot.shape[0] != M or scale.shape[0] != S or ranks.shape[0] != S:
        raise C.FdLoraError(
            f"fdlora triton lora_delta_rows: row_slot {tuple(row_slot.shape)}, scale {tuple(scale.shape)}, ranks "
            f"{tuple(ranks.shape)} must be [M], [S], [S] with M={M}, S={S}."
        )
    if M == 0 or N == 0 or K == 0:
        return None
    RMAX = C.rank_tile(R)
    C.check_blocks([], RMAX=RMAX)
    sms = C.device_sms(y)
    ranks = ranks.contiguous()
    slots_used = min(S, M)

    def grid(meta):
        return (C.cdiv(M, meta["BM"]), C.n_split(meta, M, N, sms, per_block=slots_used), S)

    return C.launch(
        _KERNELS, M, grid, (C.bucket(M), K, N, RMAX, y.dtype, A.dtype),
        y, x, A, B, scale, row_slot, ranks,
        M, K, N, C.bucket(M),
        *C.strides(y), *C.strides(x), *C.strides(A), *C.strides(B), *C.strides(scale), *C.strides(row_slot),
        keep=KEEP if keep else None, config=config, RMAX=RMAX, **C.dot_flags(A.dtype),
    )


def lora_delta_rows(y, x, A, B, scale, row_slot, ranks) -> None:  # the contract's op: ops.lora_delta_rows
    launch_rows(y, x, A, B, scale, row_slot, ranks)


lora_delta_rows_op = C.register(OPS["lora_delta_rows"], lora_delta_rows)
