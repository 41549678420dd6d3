"""bank_scatter: write one adapter into many banks in one launch (fast adapter loads).

Loading an SDXL-size LoRA writes ~1000 modules: per module A [r, K] into bank.A[slot, :r] (contiguous),
B [N, r] into bank.B[:, slot, :r] (N rows at the bank's row stride) and r into bank.ranks[slot]. As
torch copies that is ~2000 small strided copies (a kernel each, plus a view each on the host); here
it is one kernel reading a table of addresses, one row per module:

    table[i] = (A src, A dst, A numel, B src, B dst, N, r, B dst row stride, ranks dst)   (int64; addresses)

Sources are in the packed device buffer of the staged adapter (fdlora.hub.cache.stage); values are
cast to the bank's dtype on the way. Program (i, j) copies the j-th share of module i.
Idea: the pointer-table form of Triton's grouped GEMM tutorial (device pointers loaded from a tensor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fdlora.kernels.triton import config as C

FIELDS = 9
BLOCK = 1024
SHARES = 8  # programs per module (grid dim 1)


@triton.jit
def bank_scatter_kernel(table_ptr, src_like, dst_like, rank_like, FIELDS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    shares = tl.num_programs(1)
    row = table_ptr + i * FIELDS
    a_src = tl.load(row + 0).to(src_like.dtype)
    a_dst = tl.load(row + 1).to(dst_like.dtype)
    a_n = tl.load(row + 2)
    b_src = tl.load(row + 3).to(src_like.dtype)
    b_dst = tl.load(row + 4).to(dst_like.dtype)
    n_rows = tl.load(row + 5)
    r = tl.load(row + 6)
    b_stride = tl.load(row + 7)
    for start in range(j * BLOCK, a_n, shares * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < a_n
        v = tl.load(a_src + offs, mask=m)
        tl.store(a_dst + offs, v.to(dst_like.dtype.element_ty), mask=m)
    b_n = n_rows * r
    for start in range(j * BLOCK, b_n, shares * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < b_n
        v = tl.load(b_src + offs, mask=m)
        tl.store(b_dst + (offs // r) * b_stride + offs % r, v.to(dst_like.dtype.element_ty), mask=m)
    if j == 0:
        rank_dst = tl.load(row + 8).to(rank_like.dtype)
        tl.store(rank_dst, r.to(tl.int32))


def scatter(table: torch.Tensor, src_dtype: torch.dtype, dst_dtype: torch.dtype) -> None:
    """Run the copies of `table` ([n, FIELDS] int64 on the device; sources of `src_dtype`, banks of `dst_dtype`)."""
    n = table.shape[0]
    if n == 0:
        return
    dev = table.device
    like = (torch.empty(1, dtype=src_dtype, device=dev), torch.empty(1, dtype=dst_dtype, device=dev),
            torch.empty(1, dtype=torch.int32, device=dev))
    block = 64 if C.INTERPRET else BLOCK
    bank_scatter_kernel[(n, 2 if C.INTERPRET else SHARES)](table, *like, FIELDS=FIELDS, BLOCK=block)
