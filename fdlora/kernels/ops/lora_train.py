"""Trainable LoRA, plain torch: the forward and the backward formula of one trainable adapter on one layer.

Linear, with u the LoRA branch input (x, or dropout(x) as PEFT applies it) and s the fp32 scale:

    h  = u A^T                          [M, r]  fp32 (saved for the backward, with u)
    y  = y0 + x W^T + bias + s h B^T    (y0: an outside base output, W: a plain base's weight; both optional)

    g      = s gy B                     [M, r]  fp32
    grad_B = s gy^T h                   [N, r]  fp32 accumulation
    grad_A = g^T u                      [r, K]  fp32 accumulation
    grad_u = g A                        (added to grad_x = gy W when u is x)

Nothing else is saved: not the delta, not the base output. Conv2d (LoCon, PEFT's layout: A a conv with the base's
kernel, stride and padding, B a 1x1 conv) is the same algebra with A applied as a convolution. These functions are
the test oracle, the benchmark baseline and the backend on every device without the Triton kernels
(fdlora.kernels.triton.train.lora_backward); fdlora.kernels.train_ops registers them as torch.library ops. The `_half`
and `_uniform` forward/backward pairs are what eager steps run (fdlora.kernels.train_ops._Linear): the same products
with fewer ops per call, the forward keeping what its backward reuses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: fp32, or fp64 for fp64 inputs (the gradcheck oracle)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in fp32 (the BLAS accumulates in fp32 for half inputs; fp32 stays exact)."""
    if a.dtype == b.dtype and a.dtype in (torch.float32, torch.float64):
        return a @ b
    if torch.float64 in (a.dtype, b.dtype):
        return a.double() @ b.double()
    if a.is_cuda and a.dtype != torch.float32:
        return (a @ b.to(a.dtype)).float()
    return a.float() @ b.float()


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, with no call when it already is (a no-op .to still costs host time; eager steps of many small
    layers are host-bound)."""
    return t if t.dtype is dtype else t.to(dtype)


def _base(x: torch.Tensor, y0: torch.Tensor | None, W: torch.Tensor | None, bias: torch.Tensor | None,
          out: torch.dtype) -> torch.Tensor | None:
    """The base part of y: x W^T + bias for a plain base, plus an outside base output y0; None when neither."""
    base = None
    if W is not None:
        base = _to(F.linear(x, _to(W, x.dtype), None if bias is None else _to(bias, x.dtype)), out)
    if y0 is not None:
        base = y0 if base is None else base + y0
    return base


def _add_delta(base: torch.Tensor | None, y0: torch.Tensor | None, h: torch.Tensor, Bs: torch.Tensor,
               own_y0: bool = False) -> torch.Tensor:
    """base + h Bs^T by the expand GEMM itself; into base in place when it is a fresh tensor (a plain base's GEMM
    output, or an outside y0 the caller owns), which saves a copy of [M, N] and, on CUDA, a launch."""
    if base is None:
        return h @ Bs.t()
    if base is y0 and not own_y0:
        return torch.addmm(base, h, Bs.t())
    return base.addmm_(h, Bs.t())


def _scaled(B: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """s B in `dtype`, multiplied in B's precision (fp32 for fp32 B) and rounded once, in one op (a product then a
    cast is two launches)."""
    if dtype is B.dtype:
        return B * scale
    return torch.mul(B, scale, out=B.new_empty(B.shape, dtype=dtype))


def lora_train_linear(
    x: torch.Tensor,  # [M, K]
    u: torch.Tensor,  # [M, K] LoRA input (x or dropout(x))
    y0: torch.Tensor | None,  # [M, N] base output computed outside, or None
    W: torch.Tensor | None,  # [N, K] plain base weight, or None
    bias: torch.Tensor | None,  # [N]
    A: torch.Tensor,  # [r, K]
    B: torch.Tensor,  # [N, r]
    scale: torch.Tensor,  # [] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # y [M, N] in y0's (else x's) dtype, h [M, r] fp32
    """The delta is added by the expand GEMM itself (addmm: base + h (s B)^T accumulated in fp32, one rounding),
    so no [M, N] fp32 temporary exists; the scale is folded into B ([N, r], tiny)."""
    h = _mm32(u, A.t())
    out = y0.dtype if y0 is not None else x.dtype
    base = _base(x, y0, W, bias, out)
    Bs = (B.to(h.dtype) * scale.to(h.dtype)).to(out)
    return _add_delta(base, y0, h.to(out), Bs), h


def lora_train_linear_backward(
    gy: torch.Tensor,  # [M, N]
    u: torch.Tensor,  # [M, K]
    h: torch.Tensor,  # [M, r] fp32
    W: torch.Tensor | None,  # [N, K]: given when u is x, so grad_x = gy W + grad_u in one result
    A: torch.Tensor,  # [r, K]
    B: torch.Tensor,  # [N, r]
    scale: torch.Tensor,  # [] fp32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # grad_u [M, K] (u's dtype), grad_A fp32, grad_B fp32
    g = scale * _mm32(gy, B)  # [M, r]
    grad_B = scale * _mm32(gy.t(), h)  # [N, r]
    grad_A = _mm32(g.t(), u)  # [r, K]
    grad_u = _mm32(g, A)  # [M, K]
    if W is not None:
        grad_u = grad_u + _mm32(gy, W)
    return grad_u.to(u.dtype), grad_A, grad_B


def lora_train_linear_backward_blas(
    gy: torch.Tensor, u: torch.Tensor, h: torch.Tensor, W: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor,
    scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`lora_train_linear_backward` in the activations' dtype: four BLAS GEMMs, the work autograd does for PEFT's
    lora_B(lora_A(x)) * s (g = s gy B rounded once to that dtype, h rounded to it for grad_B, every product
    accumulated in fp32 by the BLAS), gradients returned in fp32. What CUDA runs for half-precision activations
    (fdlora.env.train_backward); fp32 and CPU inputs take the reference above."""
    dt = u.dtype
    g = gy @ (B.float() * scale).to(dt)  # [M, r]
    grad_B = (gy.t() @ h.to(dt)).float() * scale
    grad_A = (g.t() @ u).float()
    grad_u = g @ A.to(dt)
    if W is not None:
        grad_u.addmm_(gy, W.to(dt))
    return grad_u, grad_A, grad_B


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of half-precision inputs returned in fp32: one GEMM writing fp32 on CUDA (out_dtype), a GEMM and a cast
    elsewhere (CPU BLAS has no such output)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def lora_train_linear_half(
    x: torch.Tensor, u: torch.Tensor, y0: torch.Tensor | None, W: torch.Tensor | None, bias: torch.Tensor | None,
    A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, own_y0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # y, h [M, r] in u's dtype, As, Bs
    """`lora_train_linear` for half-precision activations, as eager CUDA steps run it: the same products and roundings
    (h = u As^T rounded to the activations' dtype, as the fp32 h of the op holds it; the delta added by the expand
    GEMM with s folded into B), keeping h in that dtype and returning As = A and Bs = s B cast once, which the
    backward reuses. The delta goes into the base output in place when that is fresh (a plain base's GEMM output, or
    y0 with own_y0: a base the caller ran for this call alone): 5 launches for a plain base, against 8 for the
    reference (eager steps of many small layers are host-bound)."""
    dt = u.dtype
    As = _to(A, dt)
    h = F.linear(u, As)  # (linear, mm: not matmul's extra dispatch layer, nor a Python-level transpose)
    out = y0.dtype if y0 is not None else x.dtype
    base = _base(x, y0, W, bias, out)
    Bs = _scaled(B, scale, out)  # s B rounded once (a half-precision B multiplies in fp32 too)
    return _add_delta(base, y0, _to(h, out), Bs, own_y0), h, As, Bs


def lora_train_linear_half_cast(
    x: torch.Tensor, u: torch.Tensor, y0: torch.Tensor | None, W: torch.Tensor | None, bias: torch.Tensor | None,
    sA: torch.Tensor, Bc: torch.Tensor, own_y0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # y, hs = u (s A)^T [M, r], both in u's dtype
    """`lora_train_linear_half` from casts made ahead (`half_casts`: sA = s A and Bc = B in u's dtype, which is
    also y's): the scale is folded into the saved hs, so the backward needs no product with it (see
    `lora_train_linear_backward_half` with scale None) and the forward runs no cast: 3 launches for a plain base."""
    hs = F.linear(u, sA)
    return _add_delta(_base(x, y0, W, bias, u.dtype), y0, hs, Bc, own_y0), hs


def half_casts(A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # A, s A, B, s B in dtype
    """What `lora_train_linear_half_cast` (s A, B) and its backward (A, s B) read, each product in A's / B's
    precision rounded once. fdlora.layers.trainable.half_casts makes the same tensors for all layers of a model at
    once."""
    return _to(A, dtype), _scaled(A, scale, dtype), _to(B, dtype), _scaled(B, scale, dtype)


def lora_train_linear_backward_half(
    gy: torch.Tensor, u: torch.Tensor, h: torch.Tensor, W: torch.Tensor | None, As: torch.Tensor, Bs: torch.Tensor,
    scale: torch.Tensor | None, need_u: bool = True, u_pass=None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:  # grad_u (u's dtype; None: not needed), fp32 grads
    """The backward of `lora_train_linear_half` from its saved h, As and Bs: g = gy Bs, grad_B = s gy^T h,
    grad_A = g^T u, grad_u = g As (+ gy W, added in place), the weight gradients accumulated and returned in fp32 by
    the GEMM itself on CUDA: 5 launches (6 with W), against 12 for `lora_train_linear_backward_blas`. With
    scale None, h is `lora_train_linear_half_cast`'s hs = s h, so grad_B = gy^T hs needs no product (4 launches).
    (Each piece's other forms, cuBLAS orientations and Triton kernels: fdlora.kernels.triton.train.lora_backward_parts;
    none was faster per call on an H100; as GPU time some compositions were, short of the target at two shapes:
    benchmarks/probes/sweep_train_backward_parts.py.)
    `u_pass(g, u, As) -> (grad_u, grad_A)`: the two products over u in another form (lora_backward_parts.x_pass's
    one pass, which large layers take on CUDA)."""
    dt = u.dtype
    g = torch.mm(gy, _to(Bs, dt))  # [M, r]
    grad_B = _mm_f32(gy.t(), h)
    if scale is not None:
        grad_B.mul_(scale)
    if not need_u:
        return None, _mm_f32(g.t(), u), grad_B
    if u_pass is None:
        grad_A = _mm_f32(g.t(), u)
        grad_u = torch.mm(g, As)
    else:
        grad_u, grad_A = u_pass(g, u, As)
    if W is not None:
        grad_u.addmm_(gy, _to(W, dt))  # in place: no copy of grad_u
    return grad_u, grad_A, grad_B


def lora_train_linear_uniform(
    x: torch.Tensor, u: torch.Tensor, y0: torch.Tensor | None, W: torch.Tensor | None, bias: torch.Tensor | None,
    A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor, own_y0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # y [M, N], hs = s h [M, r], both in the one dtype
    """`lora_train_linear` when every tensor is in one dtype that is its own accumulation dtype (fp32, or fp64), as
    eager steps run it: nothing to cast, so the base GEMM writes y and the expand GEMM adds the delta into it in place
    (into y0 itself with own_y0: a base the caller ran for this call alone), and s is folded into h (hs = s u A^T),
    which the backward then uses as is for grad_B: 4 ops for a plain base (eager steps of many small layers are
    host-bound)."""
    hs = F.linear(u, A).mul_(scale)  # [M, r]
    if W is not None:
        y = F.linear(x, W, bias)
        if y0 is not None:
            y.add_(y0)
        return y.addmm_(hs, B.t()), hs
    if y0 is not None:
        return (y0.addmm_(hs, B.t()) if own_y0 else torch.addmm(y0, hs, B.t())), hs
    return torch.mm(hs, B.t()), hs


def lora_train_linear_backward_uniform(
    gy: torch.Tensor, u: torch.Tensor, hs: torch.Tensor, W: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor,
    scale: torch.Tensor, need_u: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:  # grad_u (+ gy W), grad_A, grad_B, in the one dtype
    """The backward of `lora_train_linear_uniform` from its saved hs = s h: g = s gy B, grad_B = gy^T hs,
    grad_A = g^T u, grad_u = g A (+ gy W, added in place by the same GEMM call): 5 GEMMs and one scale; grad_u is
    None when not needed (an input that requires no grad, e.g. a cross-attention's text states)."""
    g = torch.mm(gy, B).mul_(scale)  # [M, r]
    grad_B = torch.mm(gy.t(), hs)
    grad_A = torch.mm(g.t(), u)
    if not need_u:
        return None, grad_A, grad_B
    grad_u = torch.mm(g, A)
    if W is not None:
        grad_u.addmm_(gy, W)
    return grad_u, grad_A, grad_B


def lora_train_conv2d(
    u: torch.Tensor,  # [Bt, C, H, W] LoRA input (x or dropout(x))
    y0: torch.Tensor,  # [Bt, N, H', W'] base output
    A: torch.Tensor,  # [r, C, kh, kw]
    B: torch.Tensor,  # [N, r, 1, 1]
    scale: torch.Tensor,  # [] fp32
    stride: list[int],
    padding: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:  # y like y0, h [Bt, r, H', W'] fp32
    """Convolutions in the activations' dtype (cuDNN / oneDNN accumulate in fp32), h kept in fp32, the scale folded
    into B: no fp32 copy of u or of the output."""
    f = acc_dtype(u.dtype)
    h = F.conv2d(u, A.to(u.dtype), None, stride, padding).to(f)
    Bs = (B.to(f) * scale.to(f)).to(y0.dtype)
    return y0 + F.conv2d(h.to(y0.dtype), Bs), h


def lora_train_conv2d_backward(
    gy: torch.Tensor,  # [Bt, N, H', W']
    u: torch.Tensor,  # [Bt, C, H, W]
    h: torch.Tensor,  # [Bt, r, H', W'] fp32
    A: torch.Tensor,  # [r, C, kh, kw]
    B: torch.Tensor,  # [N, r, 1, 1]
    scale: torch.Tensor,
    stride: list[int],
    padding: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # grad_u, grad_A fp32, grad_B fp32 [N, r, 1, 1]
    f = acc_dtype(u.dtype)
    g32 = gy.to(f)
    grad_B = scale * torch.einsum("bnhw,brhw->nr", g32, h)
    g = (scale * torch.einsum("bnhw,nr->brhw", g32, B.to(f).flatten(1))).to(u.dtype)  # [Bt, r, H', W']
    grad_A = torch.nn.grad.conv2d_weight(u, A.shape, g, stride, padding).to(f)
    grad_u = torch.nn.grad.conv2d_input(u.shape, A.to(u.dtype), g, stride, padding)
    return grad_u, grad_A, grad_B.view(B.shape)
