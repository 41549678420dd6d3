"""gguf_merge: a GGUF Q8_0 weight dequantized with the blend's LoRA merged in, in one pass.

    W'[n, k] = fp16(d[n, k // 32] * q[n, k]) + sum_s scale[s] sum_r B[n, s, r] A[s, r, k]    (fp32 sum, one cast)

Q8_0 stores each row as blocks of 32 values, 34 bytes a block: the fp16 scale d (2 bytes, little-endian), then 32
int8 q. diffusers' GGUFLinear.forward_native dequantizes the whole weight on every call (d * q, computed in fp16),
casts it to the compute dtype and runs F.linear; a LoRA on top then costs a second pass over the activations (the
per-call delta re-reads x and reads and writes y). Here the dequantization writes W' instead of W: the LoRA costs a
rank-r tl.dot per output tile (its operands are a few % of the bytes the dequantization moves anyway), no pass over
x or y, and nothing is kept (W' is as transient as diffusers' own W).
Numerics: the product d * q is rounded to fp16 first, as diffusers computes it, then the LoRA term is added in fp32
and the sum rounded once to the output dtype; with no LoRA (LORA=False, or every scale 0) the output equals
diffusers' `dequantize_gguf_tensor(w).to(dtype)` bit for bit. With a LoRA it differs from diffusers' base + delta by
that one rounding of W' (the merged-weight cache's numerics, lora_merge.py).

One program per BN x BK tile of W' (BK a multiple of 32: whole Q8_0 blocks; each block's d loaded once, its 32 q
as one contiguous run); the blend's live slots are packed onto one rank axis as lora_merge does (tiles.py: inactive
slots and rank padding are never read) by dequant_merge.lora_tile, which torchao's int8 / float8 weights share.
On an H100 the dequantization alone moves ~2.5 TB/s (bytes read + written) and one r16 adds ~50% to it
(bench_quantized's gguf_kernel rows; the tile [64, 128] / 4 warps is the best of a sweep over 32-128 x 64-256 tiles,
4-8 warps). The LoRA's own accumulator, 2-D byte gathers instead of [BN, NB, 32] blocks,
and the fp16 tile as the dot's accumulator input were each no faster.
Idea: LoRA weight merging (PEFT merge_and_unmerge) folded into GGUF's on-the-fly dequantization (ggml, city96's
ComfyUI-GGUF and diffusers' GGUFLinear dequantize per call): the merge rides on a pass the base already pays for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fdlora.kernels.triton import config as C
from fdlora.kernels.triton.merge.dequant_merge import check_bank, launch, lora_tile, prepare

QK = 32  # values per Q8_0 block
QBYTES = 34  # bytes per Q8_0 block: fp16 d, then QK int8
BLOCKS = {"gpu": dict(BN=64, BK=128, num_warps=4, num_stages=2),
          "interpret": dict(BN=16, BK=64, num_warps=4, num_stages=1)}


@triton.jit
def gguf_q8_0_merge_kernel(
    out_ptr,  # [N, K] W' in the output dtype
    q_ptr,  # [N, K // 32 * 34] uint8 Q8_0 blocks
    a_ptr,  # [S, R, K]
    b_ptr,  # [N, S, R]
    scale_ptr,  # [S] fp32
    gw_ptr,  # [1, S] fp32 ones: the blend's one group (pack_block's row weights)
    ranks_ptr,  # [S] int32
    N, K, S, R,
    son, sok, sqn, sas, sar, sak, sbn, sbs, sbr, ssc, sgs,
    S_PAD: tl.constexpr, RC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, LORA: tl.constexpr,
):
    NB: tl.constexpr = BK // 32  # Q8_0 blocks per tile row
    n_k = tl.cdiv(K, BK)
    nn = (tl.program_id(0) // n_k) * BN + tl.arange(0, BN)
    bb = (tl.program_id(0) % n_k) * NB + tl.arange(0, NB)  # block index along the row
    n_in = nn < N
    b_in = bb < K // 32
    nn = nn.to(tl.int64)
    mb = n_in[:, None] & b_in[None, :]  # [BN, NB]
    blk = q_ptr + nn[:, None] * sqn + bb[None, :] * 34  # [BN, NB] first byte of each block
    d_lo = tl.load(blk, mask=mb, other=0).to(tl.uint16)
    d_hi = tl.load(blk + 1, mask=mb, other=0).to(tl.uint16)
    d = (d_lo | (d_hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)  # [BN, NB]
    j = tl.arange(0, 32)
    q = tl.load(blk[:, :, None] + 2 + j[None, None, :], mask=mb[:, :, None], other=0)
    q = q.to(tl.int8, bitcast=True).to(tl.float32)  # [BN, NB, 32]
    # d * q rounded to fp16 as diffusers computes it (exact in fp32: 11 x 8 significant bits), then widened
    w = (d[:, :, None] * q).to(tl.float16).to(tl.float32)
    acc = tl.reshape(w, (BN, BK))
    kk = (tl.program_id(0) % n_k) * BK + tl.arange(0, BK)
    k_in = kk < K
    if LORA:
        acc = lora_tile(acc, nn, n_in, kk, k_in, a_ptr, b_ptr, scale_ptr, gw_ptr, ranks_ptr,
                        S, R, sas, sar, sak, sbn, sbs, sbr, ssc, sgs, S_PAD, RC, UPCAST, IEEE)
    op = out_ptr + nn[:, None] * son + kk[None, :] * sok
    tl.store(op, acc.to(out_ptr.dtype.element_ty), mask=n_in[:, None] & k_in[None, :])


def check(Wq: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a Q8_0 weight's bytes that fit the bank's A and B; the message names what to pass instead."""
    if Wq.dtype != torch.uint8 or Wq.dim() != 2 or Wq.shape[1] % QBYTES or Wq.stride(1) != 1:
        raise C.FdLoraError(f"gguf_merge: the Q8_0 weight must be uint8 [N, K / 32 * 34] with contiguous rows; got "
                            f"{Wq.dtype} {tuple(Wq.shape)} strides {tuple(Wq.stride())} (pass the GGUFParameter's "
                            "bytes, e.g. its as_tensor()).")
    N, K = Wq.shape[0], Wq.shape[1] // QBYTES * QK
    check_bank("gguf_merge", "a Q8_0 weight", A, B, N, K)
    return N, K


def gguf_q8_0_merge(
    Wq: torch.Tensor,  # [N, K // 32 * 34] uint8 Q8_0 blocks
    A: torch.Tensor,  # [S, R, K]
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32 blend weights
    group_weight: torch.Tensor,  # [1, S] fp32 ones (the blend's one group)
    ranks: torch.Tensor,  # [S] int32
    dtype: torch.dtype,  # W''s dtype (the GGUF layer's compute dtype)
    out: torch.Tensor | None = None,  # [N, K] to write into
    lora: bool = True,  # False: the dequantization alone (benchmarks: what the LoRA adds)
    blocks: dict | None = None,  # BN, BK, num_warps, num_stages instead of BLOCKS (sweeps)
    keep: bool = False,  # also return the launch kept ready, `out` its one argument (C.Prepared; None if none)
) -> torch.Tensor | tuple[torch.Tensor, C.Prepared | None]:  # [N, K]
    """W' = dequant(Wq) + sum_s scale[s] B_s A_s in `dtype`: an eager launch (the GGUF layer path runs only outside
    torch.compile and CUDA-graph capture, fdlora.layers.quant.gguf), so no torch.library registration. Kept, a launch
    replays with a new `out` for ~13 us of host time instead of this call's ~35 (operand checks, Triton's binder; an
    H100 host), which is more than the kernel runs at 3072 x 3072 (~17 us with r16)."""
    N, K = check(Wq, A, B)
    S, R, _ = A.shape
    blocks = blocks or BLOCKS["interpret" if C.INTERPRET else "gpu"]
    if blocks["BK"] % QK:
        raise C.FdLoraError(f"gguf_merge: BK={blocks['BK']} must cover whole Q8_0 blocks (a multiple of {QK}).")
    out, grid, flags = prepare(Wq, A, N, K, dtype, out, lora, blocks)
    args = (out, Wq, A, B, scale, group_weight, ranks, N, K, S, R,
            out.stride(0), out.stride(1), Wq.stride(0), A.stride(0), A.stride(1), A.stride(2), B.stride(0),
            B.stride(1), B.stride(2), scale.stride(0), group_weight.stride(1))
    return launch(gguf_q8_0_merge_kernel, grid, args, flags, keep)
