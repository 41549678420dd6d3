"""dequant_merge: a torchao weight-only int8 / float8 weight dequantized with the blend's LoRA merged in, in one pass.

    W'[n, k] = q[n, k] * qscale[n] + sum_s scale[s] sum_r B[n, s, r] A[s, r, k]    (fp32 sum, one cast)

q is int8 (torchao Int8Tensor) or float8_e4m3fn / e5m2 (Float8Tensor), both exact in fp32; qscale is per row ([N]) or
per tensor (one value, read with stride 0). torchao's weight-only linears convert the whole weight on every call
anyway (int8: `qdata.t().to(dtype)`, then a pass over y for the scale and one for the bias; float8:
`dequantize()`, an fp32 copy, then the matmul); a LoRA on top then costs a second pass over the activations (the
per-call delta re-reads x and reads and writes y). Here the conversion writes W' instead: the LoRA costs a rank-r
tl.dot per output tile, no pass over x or y, and nothing is kept (W' is as transient as torchao's own bf16 weight).
Numerics: q * qscale and the LoRA term are summed in fp32 and rounded once to the output dtype. With no LoRA (LORA=False
or every scale 0) that is torchao's `dequantize(dtype)` bit for bit (an fp32 product, one rounding). torchao's int8
linear rounds differently: x @ q in the compute dtype, rounded, times the scale rounded to the compute dtype, rounded
again; the two differ by the compute dtype's rounding (bf16: ~2^-8 relative), as the merged-weight cache's
numerics do from base + delta.

One program per BN x BK tile of W'; `lora_tile` adds the blend over the live slots packed onto one rank axis
(tiles.py: inactive slots and rank padding are never read). gguf_merge (GGUF Q8_0) shares it: only the way q and its
scale are read differs. The tile [64, 128] / 4 warps is gguf_merge's swept best (same LoRA work per tile, a simpler
load); not swept here.
Idea: LoRA weight merging (PEFT merge_and_unmerge) folded into a weight-only quantized linear's per-call
dequantization: the merge rides on a pass the base already pays for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fdlora.kernels.triton import config as C
from fdlora.kernels.triton.tiles import merge_columns, pack_block, packed_columns, weight_tile

BLOCKS = {"gpu": dict(BN=64, BK=128, num_warps=4, num_stages=2),
          "interpret": dict(BN=16, BK=32, num_warps=4, num_stages=1)}
QDTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # what the kernel reads exactly in fp32


@triton.jit
def lora_tile(
    acc,  # [BN, BK] fp32 tile of W' so far
    nn, n_in, kk, k_in,  # [BN] int64 rows and mask, [BK] columns and mask
    a_ptr, b_ptr, scale_ptr, gw_ptr, ranks_ptr,
    S, R, sas, sar, sak, sbn, sbs, sbr, ssc, sgs,
    S_PAD: tl.constexpr, RC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """acc + sum_s scale[s] B_s[nn] A_s[:, kk] over the blend's live slots, RC packed rank columns a pass."""
    grp = tl.zeros((16,), dtype=tl.int64)  # every "row" of the pack is the blend's one group
    _, end, width, rk, sc, total = pack_block(scale_ptr, gw_ptr, ranks_ptr, grp, grp >= 0, S, R, 1, ssc, 0, sgs,
                                              True, S_PAD)
    for c0 in range(0, total, RC):
        slot, r, ok, scj = packed_columns(c0, end, width, rk, sc, S_PAD, RC)
        acc = merge_columns(acc, nn, n_in, kk, k_in, slot, r, ok, scj, a_ptr, b_ptr, sas, sar, sak, sbn, sbs, sbr,
                            UPCAST, IEEE)
    return acc


@triton.jit
def dequant_merge_kernel(
    out_ptr,  # [N, K] W' in the output dtype
    q_ptr,  # [N, K] int8 / float8
    qs_ptr,  # [N] (stride sqs) or [1] (sqs = 0) scale
    a_ptr,  # [S, R, K]
    b_ptr,  # [N, S, R]
    scale_ptr,  # [S] fp32
    gw_ptr,  # [1, S] fp32 ones: the blend's one group (pack_block's row weights)
    ranks_ptr,  # [S] int32
    N, K, S, R,
    son, sok, sqn, sqk, sqs, sas, sar, sak, sbn, sbs, sbr, ssc, sgs,
    S_PAD: tl.constexpr, RC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, LORA: tl.constexpr,
):
    nn, n_in, kk, k_in = weight_tile(N, K, BN, BK)
    m = n_in[:, None] & k_in[None, :]
    q = tl.load(q_ptr + nn[:, None] * sqn + kk[None, :] * sqk, mask=m).to(tl.float32)  # exact; masked lanes unused
    d = tl.load(qs_ptr + nn * sqs, mask=n_in, other=0.0).to(tl.float32)  # [BN]
    acc = q * d[:, None]
    if LORA:
        acc = lora_tile(acc, nn, n_in, kk, k_in, a_ptr, b_ptr, scale_ptr, gw_ptr, ranks_ptr,
                        S, R, sas, sar, sak, sbn, sbs, sbr, ssc, sgs, S_PAD, RC, UPCAST, IEEE)
    tl.store(out_ptr + nn[:, None] * son + kk[None, :] * sok, acc.to(out_ptr.dtype.element_ty), mask=m)


def check(Wq: torch.Tensor, qscale: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> tuple[int, int, int]:
    """(N, K, scale stride) of a weight-only quantized weight whose values and scale fit the kernel and the bank's A
    and B; the message names what to pass instead."""
    if Wq.dim() != 2 or Wq.dtype not in QDTYPES:
        raise C.FdLoraError(f"dequant_merge: the weight must be a 2-D int8 / float8_e4m3fn / float8_e5m2 tensor (a "
                            f"torchao Int8Tensor's or Float8Tensor's qdata); got {Wq.dtype} {tuple(Wq.shape)}.")
    N, K = Wq.shape
    n = qscale.numel()
    if n not in (N, 1) or not qscale.is_floating_point():
        raise C.FdLoraError(f"dequant_merge: the scale must hold one float per row ({N}) or one for the tensor; got "
                            f"{qscale.dtype} {tuple(qscale.shape)} (per-group scales: use torchao's dequantize()).")
    check_bank("dequant_merge", "a weight", A, B, N, K)
    return N, K, 0 if n == 1 or N == 1 else qscale.reshape(-1).stride(0)


def check_bank(who: str, what: str, A: torch.Tensor, B: torch.Tensor, N: int, K: int) -> None:
    """The bank's A [S, R, K] and B [N, S, R] fit a weight of [N, K] and R is whole 16-row granules (the LoRA tile's
    dot); the message names what to pass instead. Shared with fdlora.kernels.triton.merge.gguf_merge."""
    if A.dim() != 3 or B.dim() != 3 or A.shape[2] != K or B.shape[0] != N or tuple(B.shape[1:]) != tuple(A.shape[:2]):
        raise C.FdLoraError(f"{who}: A {tuple(A.shape)} and B {tuple(B.shape)} do not fit {what} of "
                            f"[N={N}, K={K}]; A must be [S, R, K] and B [N, S, R].")
    if A.shape[1] % C.MIN_BLOCK:
        raise C.FdLoraError(f"{who}: rank capacity {A.shape[1]} must be a multiple of 16 (AdapterBank pads it).")


def dequant_merge(
    Wq: torch.Tensor,  # [N, K] int8 / float8 values
    qscale: torch.Tensor,  # [N] (any shape of N elements, e.g. [N, 1]) per-row or one-element per-tensor scale
    A: torch.Tensor,  # [S, R, K]
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32 blend weights
    group_weight: torch.Tensor,  # [1, S] fp32 ones (the blend's one group)
    ranks: torch.Tensor,  # [S] int32
    dtype: torch.dtype,  # W''s dtype (the layer's compute dtype)
    out: torch.Tensor | None = None,  # [N, K] to write into
    lora: bool = True,  # False: the dequantization alone (benchmarks: what the LoRA adds)
    blocks: dict | None = None,  # BN, BK, num_warps, num_stages instead of BLOCKS (sweeps)
    keep: bool = False,  # also return the launch kept ready, `out` its one argument (C.Prepared; None if none)
) -> torch.Tensor | tuple[torch.Tensor, C.Prepared | None]:  # [N, K]
    """W' = Wq * qscale + sum_s scale[s] B_s A_s in `dtype`: an eager launch (the layer path runs only outside
    torch.compile and CUDA-graph capture, fdlora.layers.quant.dequant), so no torch.library registration. Kept, a launch
    replays with a new `out` for a fraction of this call's host time (operand checks, Triton's binder)."""
    N, K, sqs = check(Wq, qscale, A, B)
    S, R, _ = A.shape
    out, grid, flags = prepare(Wq, A, N, K, dtype, out, lora, blocks or BLOCKS["interpret" if C.INTERPRET else "gpu"])
    args = (out, Wq, qscale, A, B, scale, group_weight, ranks, N, K, S, R,
            out.stride(0), out.stride(1), Wq.stride(0), Wq.stride(1), sqs, A.stride(0), A.stride(1), A.stride(2),
            B.stride(0), B.stride(1), B.stride(2), scale.stride(0), group_weight.stride(1))
    return launch(dequant_merge_kernel, grid, args, flags, keep)


def prepare(Wq: torch.Tensor, A: torch.Tensor, N: int, K: int, dtype: torch.dtype, out: torch.Tensor | None,
            lora: bool, blocks: dict) -> tuple[torch.Tensor, tuple[int], dict]:
    """A merge launch's output (`out`, or a new [N, K] in `dtype`), grid (one program per BN x BK tile of W') and
    constexpr flags. Shared with gguf_merge."""
    if out is None:
        out = torch.empty(N, K, device=Wq.device, dtype=dtype)
    C.check_blocks([], RC=C.MIN_BLOCK, BN=blocks["BN"], BK=blocks["BK"])
    grid = (C.cdiv(N, blocks["BN"]) * C.cdiv(K, blocks["BK"]),)
    return out, grid, dict(S_PAD=C.slot_pad(A.shape[0]), RC=C.MIN_BLOCK, **C.dot_flags(A.dtype), **blocks, LORA=lora)


def launch(kernel, grid, args: tuple, flags: dict, keep: bool):
    """`kernel` on `args` (their first, the output, returned); with `keep` also that launch kept ready to replay with
    another output (C.Prepared swapping argument 0; None where none can be kept). Shared with gguf_merge."""
    if not keep:
        kernel[grid](*args, **flags)
        return args[0]
    ready = C.kept(kernel, grid, *args, **flags)
    return args[0], None if ready is None else C.Prepared(ready.run, ready.full, (0,))
