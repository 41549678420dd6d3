"""lora_shrink: h = x A^T for every slot at once, fp32, as the first half of the split path.

    h[m, s*R + r] = sum_k x[m, k] A[s, r, k]                (A viewed as one [S*R, K] matrix)

One program per (row block, slot, rank chunk of RC, K split). With few rows the K axis is split
over P programs that write P partial sums (h is [P, M, S*R]; the expand sums them), so that the
whole GPU streams A once instead of one program per slot: no atomics, deterministic, no memset.
The internal caller passes scale/ranks so that inactive slots and rank padding are skipped
(those columns are left unwritten; the expand never reads them). Idea: split-K GEMM, Punica's
shrink kernel.

Per row (row_slot, per-row mode's one slot per row, -1 = none): row m is computed for its own slot only,

    h[m, s*R + r] = sum_k x[m, k] A[s, r, k]                with s = row_slot[m]; every other column unwritten

Program (i, s, chunk, split) loads only the x rows of block i whose slot is s, so each x row is read by one
program per rank chunk, and a program whose block holds no such row exits at once (as lora_delta_rows does).
fdlora.layers.modules.shared_shrink stacks the members' A slot-major for it ([S, n*R, K]: slot s holds every member's
A_s), so that one launch computes, per row, only the n*R columns its slot needs instead of S*n*R.
"""

from __future__ import annotations

import torch
import triton.language as tl

from fdlora.kernels.ops import OPS
from fdlora.kernels.triton import config as C
from fdlora.kernels.triton.tiles import shrink_tile


def lora_shrink_kernel(
    h_ptr,  # [P, M, S*R] fp32
    x_ptr,  # [M, K]
    a_ptr,  # [S, R, K]
    scale_ptr,  # [S] fp32 (HAS_SKIP)
    ranks_ptr,  # [S] int32 (HAS_SKIP)
    slot_ptr,  # [M] int32 (HAS_ROWS): the one slot row m is computed for, -1 = none
    M, K, R, M_BUCKET,
    shp, shm, shc, sxm, sxk, sas, sar, sak, ssc, srs,
    RC: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_ROWS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    chunks = tl.cdiv(R, RC)
    slot = tl.program_id(1) // chunks
    r0 = (tl.program_id(1) % chunks) * RC
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_in = rows < M
    if HAS_SKIP:
        live = tl.where(tl.load(scale_ptr + slot * ssc) != 0, (tl.load(ranks_ptr + slot) + 15) // 16 * 16, 0)
    else:
        live = R
    if HAS_ROWS:  # this slot's rows of the block only; none: nothing to do
        row_in = (tl.load(slot_ptr + rows * srs, mask=row_in, other=-1) == slot) & row_in
        live = tl.where(tl.max(row_in.to(tl.int32), axis=0) > 0, live, 0)
    if r0 < live:
        rows64 = rows.to(tl.int64)  # (a new name: Triton keeps a variable's type across an if)
        r = r0 + tl.arange(0, RC)
        k_per = tl.cdiv(tl.cdiv(K, tl.num_programs(2)), BK) * BK
        k_lo = tl.program_id(2) * k_per
        k_hi = tl.minimum(K, k_lo + k_per)
        acc = shrink_tile(x_ptr, a_ptr, rows64, row_in, slot + 0 * r, r, r < live, k_lo, k_hi,
                          sxm, sxk, sas, sar, sak, BM, RC, BK, UPCAST, IEEE, False)
        hp = h_ptr + tl.program_id(2) * shp + rows64[:, None] * shm + (slot * R + r)[None, :] * shc
        tl.store(hp, acc, mask=row_in[:, None] & (r < R)[None, :])


_KERNELS = C.kernels(lora_shrink_kernel, C.SHRINK, key=["M_BUCKET", "K", "RC"])


def k_splits(M: int, K: int, S: int, R: int, sms: int) -> int:
    """Partial sums P: enough programs to cover the GPU when rows are few, each K slice >= 256. (Per row, a row
    block's programs split its rows by slot: the same count, each with fewer rows.)"""
    if C.INTERPRET:
        return 2 if K > 64 else 1  # exercise the partial-sum path in CPU tests
    progs = C.cdiv(M, 16 if M <= C.FEW_ROWS else 64) * S * C.cdiv(R, C.rank_tile(R))
    return max(1, min(C.cdiv(K, 256), sms // progs))


def launch_shrink(x, A, scale: torch.Tensor | None = None, ranks: torch.Tensor | None = None,
                  row_slot: torch.Tensor | None = None, most: int | None = None) -> torch.Tensor:
    """lora_shrink's launch (operands and shapes as fdlora.kernels.ops); with scale and ranks the shrink skips dead
    slots' columns, with row_slot each row computes its own slot's only, `most` caps the K-split parts."""
    M, K = C.dims(x)
    S, R, _ = C.dims(A)
    RC = C.rank_tile(R)
    C.check_blocks([], RC=RC)
    P = k_splits(M, K, S, R, C.device_sms(x))
    if most is not None:
        P = min(P, most)
    h = torch.empty(P, M, S * R, device=x.device, dtype=torch.float32)
    skip = scale is not None and ranks is not None
    if skip:
        ranks = ranks.contiguous()
    by_row = row_slot is not None
    dummy = h  # never read when not skipping / not by row
    C.launch(
        _KERNELS, M, lambda meta: (C.cdiv(M, meta["BM"]), S * C.cdiv(R, RC), P),
        (C.bucket(M), K, RC, A.dtype, skip, by_row),
        h, x, A, scale if skip else dummy, ranks if skip else dummy, row_slot if by_row else dummy,
        M, K, R, C.bucket(M),
        *C.strides(h), *C.strides(x), *C.strides(A), C.strides(scale)[0] if skip else 0,
        C.strides(row_slot)[0] if by_row else 0,
        RC=RC, HAS_SKIP=skip, HAS_ROWS=by_row, **C.dot_flags(A.dtype),
    )
    return h


SPLIT_KEEP = 4  # K-split partial sums lora_shrink_split hands over at most (it splits K no further)


def _wide(A: torch.Tensor) -> torch.Tensor:
    """A [S, R, K] read as one slot of rank S*R ([1, S*R, K], a view where the layout allows): with no slot to skip,
    h's columns are the same, and a row block's programs cover S*R columns 64 at a time instead of R per slot, so
    x is read S*R/64 times, not S times (Llama-3-8B q/k/v's stacked shrink at 2048 rows: 15.8 us on an H100
    against 32.7 per slot, benchmarks/probes/sweep_shared_shrink.py)."""
    S, R, K = A.shape
    return A.view(1, S * R, K) if A.stride(0) == R * A.stride(1) else A


def _partials(x: torch.Tensor, A: torch.Tensor, row_slot: torch.Tensor | None, most: int | None) -> torch.Tensor:
    C.check_operands("lora_shrink", None, x, A, None, **({} if row_slot is None else {"row_slot": row_slot}))
    M, K = C.dims(x)
    S, R, _ = C.dims(A)
    if row_slot is not None and tuple(row_slot.shape) != (M,):
        raise C.FdLoraError(f"fdlora triton lora_shrink_split: row_slot {tuple(row_slot.shape)} must be [M], M={M}.")
    if M == 0 or K == 0:
        return torch.zeros(1, M, S * R, device=x.device, dtype=torch.float32)
    if row_slot is not None:
        return launch_shrink(x, A, row_slot=row_slot, most=most)
    return launch_shrink(x, _wide(A), most=most)


def lora_shrink_split(x, A, row_slot: torch.Tensor | None = None) -> torch.Tensor:
    """lora_shrink without the sum of its K-split partials: for a caller that hands h straight to lora_expand_add
    (fdlora.layers.modules.shared_shrink), one launch fewer. K is split in at most SPLIT_KEEP parts: the expand adds the
    partials one load after another in each program (decode's 16 made Llama-3-8B gate/up's two expands 48 vs 30 us on an
    H100), and at few rows fewer, longer parts beat more parts and a sum launch (Llama-3-8B q/k/v at 32 rows, shrink and
    three expands: 22.1 us with 4 parts, 25.0 with 16 summed, benchmarks/probes/
    sweep_shared_shrink.py). Not a registered op itself: ShrinkGroup calls it eagerly.

    With row_slot (per-row mode) only h[m, row_slot[m]*R : +R] is written, for every m with a slot; the rest of h
    is left as torch.empty left it, so the consumer must read only columns whose row weight is nonzero, as
    lora_expand_add does with per-row weights (G = M). A is then slot-major: ShrinkGroup's [S, n*R, K]."""
    return _partials(x, A, row_slot, SPLIT_KEEP)


def lora_shrink(x, A) -> torch.Tensor:  # the contract's op: fdlora.kernels.ops.lora_shrink
    """h = x A^T: as many K-split partials as cover the GPU (k_splits, not capped: the sum launch is paid anyway),
    then their sum."""
    h = _partials(x, A, None, None)
    return h[0] if h.shape[0] == 1 else h.sum(0)


lora_shrink_op = C.register(OPS["lora_shrink"], lora_shrink)
