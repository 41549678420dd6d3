"""lora_backward: the LoRA part of a trainable layer's backward in two passes, one over gy and one over u.

    pass 1 (expand backward, one program per row block, loop over N):
        g      = s gy B          [M, R]  fp32, kept in registers across the N loop, stored once
        grad_B += s gy^T h       [N, R]  fp32 atomics, one [BN, R] tile per (row block, N tile)
    pass 2 (shrink backward, one program per row block, loop over K):
        grad_u  = g A (+ gy W)   [M, K]  written once (the base part, computed by cuBLAS, accumulated in place)
        grad_A += g^T u          [R, K]  fp32 atomics

gy is read once (PEFT's path reads it twice: lora_B's weight grad and input grad are two GEMMs), u once (two
GEMMs again in PEFT), and g never leaves fp32; h comes from the forward (saved, never recomputed), the delta is
never stored. The rank axis is padded to a power of two >= 16 inside the tiles (masked loads). Idea: the
fused LoRA backward of LoRAFusion / Unsloth's fast_lora, restricted to the two reductions that share an operand.
Atomics make grad_A / grad_B summation order depend on scheduling (fp32, within rounding of a fixed order).
The torch oracle is fdlora.kernels.reference.lora_train.lora_train_linear_backward (same signature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import env

INTERPRET = env.triton_interpret()
MAX_RANK = 128


@triton.jit
def _expand_backward_kernel(
    gy_ptr,  # [M, N]
    b_ptr,  # [N, r]  (gy's dtype)
    h_ptr,  # [M, r]  fp32
    g_ptr,  # [M, RP] fp32 out
    gb_ptr,  # [N, r]  fp32, zeroed, atomics
    scale_ptr,  # []   fp32
    M, N, R,
    sgm, sgn, sbn, sbr, shm, shr,
    RP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = rows < M
    rows = rows.to(tl.int64)
    rr = tl.arange(0, RP)
    rk = rr < R
    s = tl.load(scale_ptr)
    h = tl.load(h_ptr + rows[:, None] * shm + rr[None, :] * shr, mask=rm[:, None] & rk[None, :], other=0.0)
    acc = tl.zeros((BM, RP), dtype=tl.float32)
    for n0 in range(0, N, BN):
        cols = n0 + tl.arange(0, BN)
        cm = cols < N
        gy = tl.load(gy_ptr + rows[:, None] * sgm + cols[None, :] * sgn, mask=rm[:, None] & cm[None, :], other=0.0)
        b = tl.load(b_ptr + cols[:, None] * sbn + rr[None, :] * sbr, mask=cm[:, None] & rk[None, :], other=0.0)
        if IEEE:  # fp32 operands throughout (gy / B may be half precision; h too, as autocast saves it)
            acc += tl.dot(gy.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            part = tl.dot(tl.trans(gy).to(tl.float32), h.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(gy, b)
            part = tl.dot(tl.trans(gy), h.to(gy.dtype))
        tl.atomic_add(gb_ptr + cols[:, None] * R + rr[None, :], part * s, mask=cm[:, None] & rk[None, :])
    tl.store(g_ptr + rows[:, None] * RP + rr[None, :], acc * s, mask=rm[:, None])


@triton.jit
def _shrink_backward_kernel(
    g_ptr,  # [M, RP] fp32
    a_ptr,  # [r, K]  (u's dtype)
    u_ptr,  # [M, K]
    gu_ptr,  # [M, K] out (HAS_BASE: holds gy W, accumulated in place)
    ga_ptr,  # [r, K] fp32, zeroed, atomics
    M, K, R,
    sam, sak, sum_, suk, sgum, sguk,
    RP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HAS_BASE: tl.constexpr, IEEE: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = rows < M
    rows = rows.to(tl.int64)
    rr = tl.arange(0, RP)
    rk = rr < R
    g = tl.load(g_ptr + rows[:, None] * RP + rr[None, :], mask=rm[:, None], other=0.0)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        km = ks < K
        a = tl.load(a_ptr + rr[:, None] * sam + ks[None, :] * sak, mask=rk[:, None] & km[None, :], other=0.0)
        u = tl.load(u_ptr + rows[:, None] * sum_ + ks[None, :] * suk, mask=rm[:, None] & km[None, :], other=0.0)
        if IEEE:  # fp32 operands throughout (A / u may be half precision; g is fp32)
            gu = tl.dot(g, a.to(tl.float32), input_precision="ieee")
            part = tl.dot(tl.trans(g), u.to(tl.float32), input_precision="ieee")
        else:
            gu = tl.dot(g.to(a.dtype), a)
            part = tl.dot(tl.trans(g).to(u.dtype), u)
        gp = gu_ptr + rows[:, None] * sgum + ks[None, :] * sguk
        if HAS_BASE:
            gu += tl.load(gp, mask=rm[:, None] & km[None, :], other=0.0).to(tl.float32)
        tl.store(gp, gu.to(gu_ptr.dtype.element_ty), mask=rm[:, None] & km[None, :])
        tl.atomic_add(ga_ptr + rr[:, None] * K + ks[None, :], part, mask=rk[:, None] & km[None, :])


def _blocks(M: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps): small tiles under the interpreter; on a GPU the largest row block that still gives
    every SM two programs (each program streams its rows of gy / u once, so parallelism is over rows only)."""
    if INTERPRET:
        return 16, 16, 16, 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    BM = next((b for b in (64, 32) if triton.cdiv(M, b) >= 2 * sms), 16)
    return BM, 64, 64, 4


def lora_backward(
    gy: torch.Tensor,  # [M, N]
    u: torch.Tensor,  # [M, K]
    h: torch.Tensor,  # [M, r] fp32
    W: torch.Tensor | None,  # [N, K]: grad_u also gets gy W (u is x)
    A: torch.Tensor,  # [r, K]
    B: torch.Tensor,  # [N, r]
    scale: torch.Tensor,  # [] fp32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # grad_u [M, K] (u's dtype), grad_A, grad_B fp32
    r = A.shape[0]
    if r > MAX_RANK or u.dtype == torch.float64:
        from ..reference.lora_train import lora_train_linear_backward

        return lora_train_linear_backward(gy, u, h, W, A, B, scale)
    out_dtype = u.dtype
    if INTERPRET and u.dtype == torch.bfloat16:  # the interpreter mis-computes bf16 adds: upcast there
        gy, u = gy.float(), u.float()
    M, K = u.shape
    N = gy.shape[1]
    RP = max(16, triton.next_power_of_2(r))
    dt = u.dtype
    gy = gy.to(dt)  # autocast: gradients may come back in another dtype than the saved input
    ieee = dt == torch.float32
    BM, BN, BK, warps = _blocks(M, u.device)
    Bc, Ac = B.to(dt), A.to(dt)
    g = torch.empty(M, RP, dtype=torch.float32, device=u.device)
    grad_B = torch.zeros(N, r, dtype=torch.float32, device=u.device)
    grad_A = torch.zeros(r, K, dtype=torch.float32, device=u.device)
    scale = scale.to(torch.float32)
    if W is not None:
        grad_u = gy.to(dt) @ W.to(dt)
    else:
        grad_u = torch.empty(M, K, dtype=dt, device=u.device)
    if M:
        grid = (triton.cdiv(M, BM),)
        _expand_backward_kernel[grid](gy, Bc, h, g, grad_B, scale, M, N, r,
                                      gy.stride(0), gy.stride(1), Bc.stride(0), Bc.stride(1), h.stride(0),
                                      h.stride(1), RP=RP, BM=BM, BN=BN, IEEE=ieee, num_warps=warps)
        _shrink_backward_kernel[grid](g, Ac, u, grad_u, grad_A, M, K, r,
                                      Ac.stride(0), Ac.stride(1), u.stride(0), u.stride(1), grad_u.stride(0),
                                      grad_u.stride(1), RP=RP, BM=BM, BK=BK, HAS_BASE=W is not None, IEEE=ieee,
                                      num_warps=warps)
    return grad_u.to(out_dtype), grad_A, grad_B
