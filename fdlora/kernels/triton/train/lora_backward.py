"""lora_backward: the LoRA part of a trainable layer's backward in two passes, one over gy and one over u.

    pass 1, over gy (program: BM rows x one N range):
        g_p      = gy Bs             [M, r]  fp32, the N range's partial, stored per range (Bs = s B)
        gB_q     = gy^T h            [N, r]  fp32, the row block's partial, stored per block
    pass 2, over u (program: BM rows x one K range):
        g        = sum_p g_p         (rounded to u's dtype, as a GEMM writing g in it would)
        grad_u   = g As (+ gy W)     [M, K]  written once (the base part, computed by cuBLAS, added in place)
        gA_q     = g^T u             [r, K]  fp32, the row block's partial
    grad_B = s sum_q gB_q,  grad_A = sum_q gA_q      (two small torch reductions)

gy is read once (PEFT's path reads it twice: lora_B's weight grad and input grad are two GEMMs, and cuBLAS runs
those tall, rank-wide products at about 1.3 TB/s on an H100), u once, grad_u written once; h comes from the
forward, the delta is never stored. The reductions over rows write partial sums, one per row block of BM rows,
instead of atomics: deterministic, no memset, and at BM = 256 they are 1/8 of gy's (or u's) bytes for rank 16.
The row blocks times the N (K) ranges are sized to fill the GPU. Idea: the fused LoRA backward of LoRAFusion /
Unsloth's fast_lora, restricted to the two reductions that share an operand, with split-K partials as in
lora_shrink. The torch oracle is fdlora.kernels.ops.lora_train.lora_train_linear_backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fdlora.kernels.triton import config as C

MAX_RANK = 64  # rank columns kept in registers next to a [BM, BN] tile; wider ranks take the torch path


@triton.jit
def _block(M, R, RP: tl.constexpr, BM: tl.constexpr):
    """This program's row block and the rank columns: rows [BM] int64 and their mask, rr [RP] and theirs."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = rows < M
    rows = rows.to(tl.int64)
    rr = tl.arange(0, RP)
    rk = rr < R
    return rows, rm, rr, rk


@triton.jit
def _span(L, per):
    """This program's range [lo, hi) of a length-L axis split into `per`-long ranges along grid axis 1."""
    lo = tl.program_id(1) * per
    return lo, tl.minimum(L, lo + per)


@triton.jit
def _gy_pass_kernel(
    gy_ptr,  # [M, N]
    bs_ptr,  # [N, r]  (s B, gy's dtype; fp32 when IEEE)
    h_ptr,  # [M, r]
    gp_ptr,  # [NS, M, r] fp32 out: g's partial per N range
    gbp_ptr,  # [MB, N, r] fp32 out: gy^T h's partial per row block
    M, N, R, n_per,
    sgm, sgn, sbn, sbr, shm, shr,
    RP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
):
    rows, rm, rr, rk = _block(M, R, RP, BM)
    h = tl.load(h_ptr + rows[:, None] * shm + rr[None, :] * shr, mask=rm[:, None] & rk[None, :], other=0.0)
    h = h.to(tl.float32) if IEEE else h.to(gy_ptr.dtype.element_ty)
    acc = tl.zeros((BM, RP), dtype=tl.float32)
    n_lo, n_hi = _span(N, n_per)
    for n0 in range(n_lo, n_hi, BN):
        cols = n0 + tl.arange(0, BN)
        cm = cols < n_hi
        gy = tl.load(gy_ptr + rows[:, None] * sgm + cols[None, :] * sgn, mask=rm[:, None] & cm[None, :], other=0.0)
        b = tl.load(bs_ptr + cols[:, None] * sbn + rr[None, :] * sbr, mask=cm[:, None] & rk[None, :], other=0.0)
        if IEEE:  # fp32 operands throughout
            acc += tl.dot(gy.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            part = tl.dot(tl.trans(gy.to(tl.float32)), h, input_precision="ieee")
        else:
            acc += tl.dot(gy, b.to(gy.dtype))
            part = tl.dot(tl.trans(gy), h)
        tl.store(gbp_ptr + (tl.program_id(0) * N + cols)[:, None] * R + rr[None, :], part,
                 mask=cm[:, None] & rk[None, :])
    tl.store(gp_ptr + (tl.program_id(1) * M + rows)[:, None] * R + rr[None, :], acc, mask=rm[:, None] & rk[None, :])


@triton.jit
def _u_pass_kernel(
    gp_ptr,  # [NS, M, r] fp32: g's partials
    a_ptr,  # [r, K]  (u's dtype; fp32 when IEEE)
    u_ptr,  # [M, K]
    gu_ptr,  # [M, K] out (HAS_BASE: holds gy W, added to in place)
    gap_ptr,  # [MB, r, K] fp32 out: g^T u's partial per row block
    M, K, R, NS, k_per,
    sam, sak, sum_, suk, sgum, sguk,
    RP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HAS_BASE: tl.constexpr, NEED_U: tl.constexpr,
    IEEE: tl.constexpr,
):
    rows, rm, rr, rk = _block(M, R, RP, BM)
    gm = rm[:, None] & rk[None, :]
    g = tl.zeros((BM, RP), dtype=tl.float32)
    for p in range(0, NS):
        g += tl.load(gp_ptr + (p * M + rows)[:, None] * R + rr[None, :], mask=gm, other=0.0)
    g = g if IEEE else g.to(u_ptr.dtype.element_ty)  # the rounding of a GEMM writing g in u's dtype
    k_lo, k_hi = _span(K, k_per)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + tl.arange(0, BK)
        km = ks < k_hi
        u = tl.load(u_ptr + rows[:, None] * sum_ + ks[None, :] * suk, mask=rm[:, None] & km[None, :], other=0.0)
        if IEEE:
            part = tl.dot(tl.trans(g), u.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(tl.trans(g), u)
        tl.store(gap_ptr + (tl.program_id(0) * R + rr)[:, None] * K + ks[None, :], part, mask=rk[:, None] & km[None, :])
        if NEED_U:
            a = tl.load(a_ptr + rr[:, None] * sam + ks[None, :] * sak, mask=rk[:, None] & km[None, :], other=0.0)
            if IEEE:
                gu = tl.dot(g, a.to(tl.float32), input_precision="ieee")
            else:
                gu = tl.dot(g, a.to(g.dtype))
            gp = gu_ptr + rows[:, None] * sgum + ks[None, :] * sguk
            if HAS_BASE:
                gu += tl.load(gp, mask=rm[:, None] & km[None, :], other=0.0).to(tl.float32)
            tl.store(gp, gu.to(gu_ptr.dtype.element_ty), mask=rm[:, None] & km[None, :])


@dataclass(frozen=True)
class Blocks:
    """One launch shape for both passes: BM rows a program, BN / BK columns a step, warps and pipeline stages."""

    BM: int = 256
    BN: int = 64
    BK: int = 64
    warps: int = 8
    stages: int = 3
    fill: int = 2  # programs per SM each pass aims for (row blocks x N or K ranges)


DEFAULT = Blocks()
INTERPRETED = Blocks(BM=16, BN=16, BK=16, warps=1, stages=1, fill=1)  # (the interpreter's 4 "SMs" split N and K)


def _ranges(M: int, L: int, BM: int, BL: int, programs: int) -> tuple[int, int]:
    """(ranges, columns per range) splitting L so that row blocks x ranges >= `programs`, each a whole BL steps."""
    want = max(1, min(triton.cdiv(L, BL), triton.cdiv(programs, triton.cdiv(M, BM))))
    per = triton.cdiv(triton.cdiv(L, want), BL) * BL
    return triton.cdiv(L, per), per


def backward_half(
    gy: torch.Tensor,  # [M, N]
    u: torch.Tensor,  # [M, K]
    h: torch.Tensor,  # [M, r] (u's dtype or fp32)
    W: torch.Tensor | None,  # [N, K]: grad_u also gets gy W (u is x)
    As: torch.Tensor,  # [r, K] u's dtype
    Bs: torch.Tensor,  # [N, r] s B in u's dtype
    scale: torch.Tensor,  # [] fp32
    need_u: bool = True,
    blocks: Blocks | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:  # grad_u (u's dtype; None: not needed), fp32 grads
    """fdlora.kernels.ops.lora_train.lora_train_linear_backward_half in two Triton passes (same signature,
    same roundings: g in u's dtype, the weight gradients accumulated in fp32)."""
    M, K = u.shape
    N, r = Bs.shape
    dt = u.dtype
    if M == 0:
        f = dict(dtype=torch.float32, device=u.device)
        grad_u = None if not need_u else torch.zeros(M, K, dtype=dt, device=u.device)
        return grad_u, torch.zeros(r, K, **f), torch.zeros(N, r, **f)
    b = blocks or (INTERPRETED if C.INTERPRET else DEFAULT)
    if not need_u:
        grad_u = None
    elif W is not None:
        grad_u = torch.mm(gy, W if W.dtype is dt else W.to(dt))
    else:
        grad_u = torch.empty(M, K, dtype=dt, device=u.device)
    gp, gbp = gy_pass(gy, h, Bs, b)
    gap = u_pass(gp, u, As, grad_u, W is not None, b)
    return grad_u, gap.sum(0), gbp.sum(0).mul_(scale)


def _programs(b: Blocks, t: torch.Tensor) -> int:
    return b.fill * C.device_sms(t)


def gy_pass(
    gy: torch.Tensor,  # [M, N]
    h: torch.Tensor,  # [M, r]
    Bs: torch.Tensor,  # [N, r]
    b: Blocks,
) -> tuple[torch.Tensor, torch.Tensor]:  # g's partials [NS, M, r], gy^T h's partials [MB, N, r], fp32
    M, N = gy.shape
    r = Bs.shape[1]
    MB = triton.cdiv(M, b.BM)
    NS, n_per = _ranges(M, N, b.BM, b.BN, _programs(b, gy))
    gp = torch.empty(NS, M, r, dtype=torch.float32, device=gy.device)
    gbp = torch.empty(MB, N, r, dtype=torch.float32, device=gy.device)
    _gy_pass_kernel[(MB, NS)](gy, Bs, h, gp, gbp, M, N, r, n_per, *gy.stride(), *Bs.stride(), *h.stride(),
                              RP=max(16, triton.next_power_of_2(r)), BM=b.BM, BN=b.BN, IEEE=gy.dtype == torch.float32,
                              num_warps=b.warps, num_stages=b.stages)
    return gp, gbp


def u_pass(
    gp: torch.Tensor,  # [NS, M, r] fp32
    u: torch.Tensor,  # [M, K]
    As: torch.Tensor,  # [r, K]
    grad_u: torch.Tensor | None,  # [M, K] written (None: not needed), or added to (has_base)
    has_base: bool,
    b: Blocks,
) -> torch.Tensor:  # g^T u's partials [MB, r, K] fp32
    M, K = u.shape
    r = As.shape[0]
    MB = triton.cdiv(M, b.BM)
    KS, k_per = _ranges(M, K, b.BM, b.BK, _programs(b, u))
    gap = torch.empty(MB, r, K, dtype=torch.float32, device=u.device)
    out = grad_u if grad_u is not None else u
    _u_pass_kernel[(MB, KS)](gp, As, u, out, gap, M, K, r, gp.shape[0], k_per, *As.stride(), *u.stride(),
                             *out.stride(), RP=max(16, triton.next_power_of_2(r)), BM=b.BM, BK=b.BK,
                             HAS_BASE=has_base, NEED_U=grad_u is not None, IEEE=u.dtype == torch.float32,
                             num_warps=b.warps, num_stages=b.stages)
    return gap


def lora_backward(
    gy: torch.Tensor,  # [M, N]
    u: torch.Tensor,  # [M, K]
    h: torch.Tensor,  # [M, r] fp32
    W: torch.Tensor | None,  # [N, K]: grad_u also gets gy W (u is x)
    A: torch.Tensor,  # [r, K]
    B: torch.Tensor,  # [N, r]
    scale: torch.Tensor,  # [] fp32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # grad_u [M, K] (u's dtype), grad_A, grad_B fp32
    """The registered op's backward (fdlora::lora_train_linear_backward's signature) through `backward_half`: A and
    s B cast to u's dtype once; fp32 activations run IEEE fp32 dots."""
    r = A.shape[0]
    if r > MAX_RANK or u.dtype == torch.float64:
        from fdlora.kernels.ops.lora_train import lora_train_linear_backward

        return lora_train_linear_backward(gy, u, h, W, A, B, scale)
    out_dtype = u.dtype
    if C.INTERPRET and u.dtype == torch.bfloat16:  # the interpreter mis-computes bf16 adds: upcast there
        gy, u = gy.float(), u.float()
    dt = u.dtype
    scale = scale.to(torch.float32)
    grad_u, grad_A, grad_B = backward_half(gy.to(dt), u, h, W, A.to(dt), (B.float() * scale).to(dt), scale)
    return grad_u.to(out_dtype), grad_A, grad_B
