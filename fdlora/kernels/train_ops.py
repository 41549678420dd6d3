"""The trainable-LoRA ops, registered with torch.library: forward, backward and the autograd formula between them.

    fdlora::lora_train_linear(x, u?, y0?, W?, bias?, A, B, scale) -> (y, h)
    fdlora::lora_train_linear_backward(gy, u, h, W?, A, B, scale) -> (grad_u, grad_A, grad_B)
    fdlora::lora_train_conv2d(u, y0, A, B, scale, stride, padding) -> (y, h)
    fdlora::lora_train_conv2d_backward(gy, u, h, A, B, scale, stride, padding) -> (grad_u, grad_A, grad_B)

The math is fdlora.kernels.reference.lora_train (u = the LoRA input, x or dropout(x); u=None means x). The forward
saves only u and h = u A^T (fp32) for the backward, never the delta or the base output. Every op has a fake kernel, so
torch.compile traces a whole training step through them (no graph break). On CUDA the linear backward of half-precision
activations runs as four cuBLAS GEMMs in their dtype (lora_train_linear_backward_blas), or with
FDLORA_TRAIN_BACKWARD=triton the two-pass kernels of fdlora.kernels.triton.lora_backward (one pass over gy for g and
grad_B, one over u for grad_u and grad_A; 1.8-3.4x slower than the GEMMs on an H200 at Llama-3-8B shapes, so not the
default); everywhere else the torch reference runs. The backend is a device property of the op, not chosen per call:
the layers never branch on it.

W and bias are frozen by contract (the layer passes a base weight only when it does not require grad): the formula
returns no gradient for them, nor for the scale.

The layers call `train_linear` / `train_conv2d`: under torch.compile those are the registered ops; in eager they are a
plain torch.autograd.Function over the same implementations (the same device choice, the same saved tensors, the same
formula). torch.library's Python dispatch of a custom op and its autograd wrapper cost about 110 us of host time per
layer per training step on a CPU host, twice PEFT's whole LoRA layer (session 20); eager SDXL training steps are
host-bound (560 LoRA layers), so that was the difference between fd-lora's step and PEFT's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import env
from .reference import lora_train as ref


@torch.library.custom_op("fdlora::lora_train_linear", mutates_args=())
def lora_train_linear(x: Tensor, u: Tensor | None, y0: Tensor | None, W: Tensor | None, bias: Tensor | None,
                      A: Tensor, B: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    return ref.lora_train_linear(x, x if u is None else u, y0, W, bias, A, B, scale)


@lora_train_linear.register_fake
def _(x, u, y0, W, bias, A, B, scale):
    M, N = x.shape[0], B.shape[0]
    out = y0.dtype if y0 is not None else x.dtype
    return x.new_empty(M, N, dtype=out), x.new_empty(M, A.shape[0], dtype=ref.acc_dtype(x.dtype))


@torch.library.custom_op("fdlora::lora_train_linear_backward", mutates_args=())
def lora_train_linear_backward(gy: Tensor, u: Tensor, h: Tensor, W: Tensor | None, A: Tensor, B: Tensor,
                               scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return ref.lora_train_linear_backward(gy, u, h, W, A, B, scale)


@lora_train_linear_backward.register_kernel("cuda")
def _cuda_linear_backward(gy, u, h, W, A, B, scale):
    if env.train_backward() == "triton":
        try:
            from .triton.lora_backward import lora_backward
        except ImportError:  # CUDA without triton: cuBLAS below
            pass
        else:
            return lora_backward(gy, u, h, W, A, B, scale)
    if u.dtype in (torch.float16, torch.bfloat16):
        return ref.lora_train_linear_backward_blas(gy, u, h, W, A, B, scale)
    return ref.lora_train_linear_backward(gy, u, h, W, A, B, scale)


@lora_train_linear_backward.register_fake
def _(gy, u, h, W, A, B, scale):
    f = ref.acc_dtype(u.dtype)
    return u.new_empty(u.shape), A.new_empty(A.shape, dtype=f), B.new_empty(B.shape, dtype=f)


def _linear_setup(ctx, inputs, output) -> None:
    x, u, y0, W, bias, A, B, scale = inputs
    ctx.u_is_x, ctx.has_y0, ctx.has_W = u is None, y0 is not None, W is not None
    ctx.y0_dtype = None if y0 is None else y0.dtype
    ctx.save_for_backward(x if u is None else u, output[1], W, A, B, scale)


def _linear_backward(ctx, gy, _gh, backward=None):
    u, h, W, A, B, scale = ctx.saved_tensors
    gy = gy.contiguous()
    gy_u = gy.to(u.dtype)
    # grad_x = gy W + grad_u in one result when the LoRA input is x itself; after dropout they are two inputs
    grad_u, grad_A, grad_B = (backward or torch.ops.fdlora.lora_train_linear_backward)(
        gy_u, u, h, W if ctx.u_is_x else None, A, B, scale)
    if ctx.u_is_x:
        grad_x, grad_u = grad_u, None
    else:
        grad_x = gy_u @ W.to(gy_u.dtype) if ctx.has_W else None
    grad_y0 = gy.to(ctx.y0_dtype) if ctx.has_y0 else None
    # (the eager half path saved A and B cast to half: the parameters' own dtypes are kept on ctx)
    return (grad_x, grad_u, grad_y0, None, None, grad_A.to(getattr(ctx, "a_dtype", A.dtype)),
            grad_B.to(getattr(ctx, "b_dtype", B.dtype)), None)


lora_train_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


@torch.library.custom_op("fdlora::lora_train_conv2d", mutates_args=())
def lora_train_conv2d(u: Tensor, y0: Tensor, A: Tensor, B: Tensor, scale: Tensor, stride: list[int],
                      padding: list[int]) -> tuple[Tensor, Tensor]:
    return ref.lora_train_conv2d(u, y0, A, B, scale, stride, padding)


@lora_train_conv2d.register_fake
def _(u, y0, A, B, scale, stride, padding):
    return y0.new_empty(y0.shape), y0.new_empty((y0.shape[0], A.shape[0], *y0.shape[2:]), dtype=ref.acc_dtype(u.dtype))


@torch.library.custom_op("fdlora::lora_train_conv2d_backward", mutates_args=())
def lora_train_conv2d_backward(gy: Tensor, u: Tensor, h: Tensor, A: Tensor, B: Tensor, scale: Tensor,
                               stride: list[int], padding: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    return ref.lora_train_conv2d_backward(gy, u, h, A, B, scale, stride, padding)


@lora_train_conv2d_backward.register_fake
def _(gy, u, h, A, B, scale, stride, padding):
    f = ref.acc_dtype(u.dtype)
    return u.new_empty(u.shape), A.new_empty(A.shape, dtype=f), B.new_empty(B.shape, dtype=f)


def _conv_setup(ctx, inputs, output) -> None:
    u, y0, A, B, scale, stride, padding = inputs
    ctx.stride, ctx.padding, ctx.y0_dtype = stride, padding, y0.dtype
    ctx.save_for_backward(u, output[1], A, B, scale)


def _conv_backward(ctx, gy, _gh, backward=None):
    u, h, A, B, scale = ctx.saved_tensors
    grad_u, grad_A, grad_B = (backward or torch.ops.fdlora.lora_train_conv2d_backward)(
        gy.contiguous(), u, h, A, B, scale, ctx.stride, ctx.padding)
    return grad_u, gy.to(ctx.y0_dtype), grad_A.to(A.dtype), grad_B.to(B.dtype), None, None, None


lora_train_conv2d.register_autograd(_conv_backward, setup_context=_conv_setup)


# --- the eager entry points ---------------------------------------------------------------------------------------
def _eager_linear_backward(gy, u, h, W, A, B, scale):
    """What the registered backward op runs on gy's device, called directly."""
    if gy.is_cuda:
        return _cuda_linear_backward(gy, u, h, W, A, B, scale)
    return ref.lora_train_linear_backward(gy, u, h, W, A, B, scale)


class _Linear(torch.autograd.Function):  # forward(ctx, ...): a setup_context Function binds its signature per call
    @staticmethod
    def forward(ctx, x, u, y0, W, bias, A, B, scale):
        lora_in = x if u is None else u
        ctx.half = (lora_in.is_cuda and lora_in.dtype in (torch.float16, torch.bfloat16)
                    and env.train_backward() != "triton")  # the cuBLAS backward: h, A and s B kept in half precision
        if ctx.half:
            y, h, As, Bs = ref.lora_train_linear_half(x, lora_in, y0, W, bias, A, B, scale)
            out = (y, h)
            _linear_setup(ctx, (x, u, y0, W, bias, As, Bs, scale), out)
            ctx.a_dtype, ctx.b_dtype = A.dtype, B.dtype
        else:
            out = ref.lora_train_linear(x, lora_in, y0, W, bias, A, B, scale)
            _linear_setup(ctx, (x, u, y0, W, bias, A, B, scale), out)
        ctx.mark_non_differentiable(out[1])
        return out

    @staticmethod
    def backward(ctx, gy, gh):
        return _linear_backward(ctx, gy, gh, ref.lora_train_linear_backward_half if ctx.half
                                else _eager_linear_backward)


class _Conv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, y0, A, B, scale, stride, padding):
        out = ref.lora_train_conv2d(u, y0, A, B, scale, stride, padding)
        _conv_setup(ctx, (u, y0, A, B, scale, stride, padding), out)
        ctx.mark_non_differentiable(out[1])
        return out

    @staticmethod
    def backward(ctx, gy, gh):
        return _conv_backward(ctx, gy, gh, ref.lora_train_conv2d_backward)


def train_linear(x: Tensor, u: Tensor | None, y0: Tensor | None, W: Tensor | None, bias: Tensor | None, A: Tensor,
                 B: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """fdlora::lora_train_linear: the registered op while torch.compile traces, its eager Function otherwise."""
    if torch.compiler.is_compiling():
        return torch.ops.fdlora.lora_train_linear(x, u, y0, W, bias, A, B, scale)
    return _Linear.apply(x, u, y0, W, bias, A, B, scale)


def train_conv2d(u: Tensor, y0: Tensor, A: Tensor, B: Tensor, scale: Tensor, stride: list[int],
                 padding: list[int]) -> tuple[Tensor, Tensor]:
    """fdlora::lora_train_conv2d: the registered op while torch.compile traces, its eager Function otherwise."""
    if torch.compiler.is_compiling():
        return torch.ops.fdlora.lora_train_conv2d(u, y0, A, B, scale, stride, padding)
    return _Conv2d.apply(u, y0, A, B, scale, stride, padding)
