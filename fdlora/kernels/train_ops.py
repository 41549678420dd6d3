"""The trainable-LoRA ops, registered with torch.library: forward, backward and the autograd formula between them.

    fdlora::lora_train_linear(x, u?, y0?, W?, bias?, A, B, scale) -> (y, h)
    fdlora::lora_train_linear_backward(gy, u, h, W?, A, B, scale) -> (grad_u, grad_A, grad_B)
    fdlora::lora_train_conv2d(u, y0, A, B, scale, stride, padding) -> (y, h)
    fdlora::lora_train_conv2d_backward(gy, u, h, A, B, scale, stride, padding) -> (grad_u, grad_A, grad_B)

The math is fdlora.kernels.ops.lora_train (u = the LoRA input, x or dropout(x); u=None means x). The forward
saves only u and h = u A^T (fp32) for the backward, never the delta or the base output. Every op has a fake kernel, so
torch.compile traces a whole training step through them (no graph break). On CUDA the linear backward of half-precision
activations runs as four cuBLAS GEMMs in their dtype (lora_train_linear_backward_blas), or with
FDLORA_TRAIN_BACKWARD=triton the two-pass kernels of fdlora.kernels.triton.train.lora_backward (one pass over gy for g
and grad_B, one over u for grad_u and grad_A; 1.8-3.4x slower than the GEMMs on an H200 at Llama-3-8B shapes, so not the
default); everywhere else the torch reference runs. The backend is a device property of the op, not chosen per call:
the layers never branch on it.

W and bias are frozen by contract (the layer passes a base weight only when it does not require grad): the formula
returns no gradient for them, nor for the scale.

The layers call `train_linear` / `train_conv2d`: under torch.compile those are the registered ops; in eager they are a
plain torch.autograd.Function over the reference's eager forward/backward pairs (the same math and device choice; see
_Linear), because torch.library's Python dispatch of a custom op costs more host time per layer than PEFT's whole
LoRA layer, and eager half-precision steps of hundreds of LoRA layers are host-bound. The eager Function therefore
returns y only, folds the leading dimensions itself (no reshape nodes in the graph), skips no-op casts, computes no
grad_x for an input that needs none, and in fp32 runs 4 ops forward and 6 backward. A frozen nf4 base runs inside the
Function through fdlora.layers.trainable.frozen_4bit, not bitsandbytes' Python layers.

Which path runs: under half-precision autocast the half pair reads A, s A, B and s B made ahead for the whole model
once per forward pass (fdlora.layers.trainable.half_casts; `casts`), the scale folded into the saved h: 3 launches
forward and 5 backward per layer. Over a plain base with casts, `train_linear` calls the same pair as one C++
autograd Function (fdlora.kernels.host, where it builds). On CUDA, from FUSED_MIN elements of u the backward takes
grad_A and grad_u from one Triton pass over u (`half_backward`). benchmarks/probes/profile_train_host.py measures a
layer's host time and device-op count against PEFT and a frozen nn.Linear; the measurements behind these choices
are in benchmarks/README.md (Measurement history: training ops).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import env
from .ops import lora_train as ref

# FDLORA_TRAIN_BACKWARD, read once (a process setting): the eager forward asks at every call, and reading the
# environment there cost a few us per layer on host-bound steps.
_TRITON_BACKWARD = env.train_backward() == "triton"


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
    if _TRITON_BACKWARD:
        try:
            from fdlora.kernels.triton.train.lora_backward import lora_backward
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


def _linear_backward(ctx, gy, _gh):
    u, h, W, A, B, scale = ctx.saved_tensors
    gy = gy.contiguous()
    gy_u = gy.to(u.dtype)
    # grad_x = gy W + grad_u in one result when the LoRA input is x itself; after dropout they are two inputs
    grad_u, grad_A, grad_B = torch.ops.fdlora.lora_train_linear_backward(
        gy_u, u, h, W if ctx.u_is_x else None, A, B, scale)
    if ctx.u_is_x:
        grad_x, grad_u = grad_u, None
    else:
        grad_x = gy_u @ W.to(gy_u.dtype) if ctx.has_W else None
    grad_y0 = gy.to(ctx.y0_dtype) if ctx.has_y0 else None
    return grad_x, grad_u, grad_y0, None, None, grad_A.to(A.dtype), grad_B.to(B.dtype), None


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


def _conv_backward(ctx, gy, _gh):
    u, h, A, B, scale = ctx.saved_tensors
    grad_u, grad_A, grad_B = torch.ops.fdlora.lora_train_conv2d_backward(
        gy.contiguous(), u, h, A, B, scale, ctx.stride, ctx.padding)
    return grad_u, gy.to(ctx.y0_dtype), grad_A.to(A.dtype), grad_B.to(B.dtype), None, None, None


lora_train_conv2d.register_autograd(_conv_backward, setup_context=_conv_setup)


# --- the eager entry points ---------------------------------------------------------------------------------------
def _eager_linear_backward(gy, u, h, W, A, B, scale):
    """What the registered backward op runs on gy's device, called directly."""
    if gy.is_cuda:
        return _cuda_linear_backward(gy, u, h, W, A, B, scale)
    return ref.lora_train_linear_backward(gy, u, h, W, A, B, scale)


_UNIFORM, _HALF, _MIXED = "uniform", "half", "mixed"  # which forward an eager call ran; its backward matches it


def _half_pair(u: Tensor) -> bool:
    """Whether an eager call runs the half-precision pair: half-precision activations on CUDA with the cuBLAS
    backward (on CPU the BLAS cannot write fp32 from half inputs, so the reference's fp32 h keeps its accuracy)."""
    return u.is_cuda and (u.dtype is torch.bfloat16 or u.dtype is torch.float16) and not _TRITON_BACKWARD


# A reshape that autograd does not record as a view: a view made inside a Function's forward and returned cannot be
# modified in place afterwards (autograd forbids it), and model code may do that to a layer's output.
_unsafe_view = torch.ops.aten._unsafe_view.default


class _Linear(torch.autograd.Function):
    """The eager form of fdlora::lora_train_linear for x [..., K] (u like x, y0 [..., N]), returning y [..., N] only
    (h stays on ctx). The leading dimensions are folded inside, so the step's graph holds one node per call, not
    one per reshape as well. One of three forward/backward pairs of fdlora.kernels.ops.lora_train, chosen per
    call from the dtypes (no casts, nothing read from the environment on that path):
      uniform  every tensor fp32 (or fp64): lora_train_linear_uniform, 4 ops forward, 6 backward, s folded into the
               saved h;
      half     half-precision activations on CUDA with the cuBLAS backward: lora_train_linear_half, which keeps h,
               A and s B cast;
      mixed    anything else (e.g. bf16 activations on CPU, an fp16 outside base under fp32 A/B): the op's own
               reference forward and its device's backward.
    With `run` (a frozen base whose input gradient is gy W: run.forward(x) -> (y0, saved), run.weight(saved, dtype)
    -> W [N, K]; a 4-bit bitsandbytes layer, see train_linear_over) y0 is computed here, so it has no graph node of
    its own, the delta is added into it in place, and W is rebuilt in the backward for grad_x = gy W + g A in one
    in-place GEMM pair (instead of the base's own backward, a second [M, K] gradient and their sum)."""

    @staticmethod
    def forward(ctx, x, u, y0, W, bias, A, B, scale, run=None, casts=None):
        shape = ctx.shape = x.shape
        if run is not None:
            y0, ctx.saved = run.forward(x)  # grad mode is off in here: the base records nothing
        if len(shape) != 2:
            x = x.reshape(-1, shape[-1])
            u = None if u is None else u.reshape(-1, shape[-1])
            y0 = None if y0 is None else y0.reshape(-1, y0.shape[-1])
        lora_in = x if u is None else u
        dt = lora_in.dtype
        ctx.a_dtype, ctx.b_dtype = A.dtype, B.dtype
        own = run is not None
        folded = None  # the scale: None when folded into the saved h (casts made ahead)
        if (dt is x.dtype is A.dtype is B.dtype and (dt is torch.float32 or dt is torch.float64)
                and (W is None or W.dtype is dt) and (bias is None or bias.dtype is dt)
                and (y0 is None or y0.dtype is dt)):
            ctx.how = _UNIFORM
            y, h = ref.lora_train_linear_uniform(x, lora_in, y0, W, bias, A, B, scale, own)
        elif _half_pair(lora_in):
            ctx.how = _HALF
            if (y0 is None or y0.dtype is dt) and (W is None or x.dtype is dt):  # (y in u's dtype)
                As, sA, Bc, sB = ref.half_casts(A, B, scale, dt) if casts is None or casts[0].dtype is not dt \
                    else casts
                y, h = ref.lora_train_linear_half_cast(x, lora_in, y0, W, bias, sA, Bc, own)
                A, B = As, sB  # what the backward reads, with h = s u A^T
            else:
                y, h, A, B = ref.lora_train_linear_half(x, lora_in, y0, W, bias, A, B, scale, own)  # A, B kept cast
                folded = scale
        else:
            ctx.how = _MIXED
            y, h = ref.lora_train_linear(x, lora_in, y0, W, bias, A, B, scale)
        ctx.u_is_x, ctx.scale, ctx.run = u is None, scale if ctx.how is not _HALF else folded, run
        ctx.y0_dtype = None if y0 is None or own else y0.dtype
        ctx.save_for_backward(lora_in, h, W, A, B)
        return y if len(shape) == 2 else _unsafe_view(y, (*shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, gy):
        u, h, W, A, B = ctx.saved_tensors
        u_is_x, shape, need = ctx.u_is_x, ctx.shape, ctx.needs_input_grad
        need_u = need[0] if u_is_x else need[1]  # (no grad_x for an input that needs none, as autograd does)
        if len(shape) != 2:
            gy = gy.reshape(-1, gy.shape[-1])
        if ctx.how is not _UNIFORM:
            gy = gy.contiguous()
        gy_u = gy if gy.dtype is u.dtype else gy.to(u.dtype)
        if ctx.run is not None and need[0]:  # the base's part of grad_x: gy W, W rebuilt (dequantized) now
            W = ctx.run.weight(ctx.saved, gy_u.dtype)
        if ctx.how is _UNIFORM:
            grad_u, grad_A, grad_B = ref.lora_train_linear_backward_uniform(gy, u, h, W if u_is_x else None, A, B,
                                                                            ctx.scale, need_u)
        else:
            if ctx.how is _HALF:
                grad_u, grad_A, grad_B = half_backward(gy_u, u, h, W if u_is_x else None, A, B, ctx.scale, need_u)
            else:
                grad_u, grad_A, grad_B = _eager_linear_backward(gy_u, u, h, W if u_is_x else None, A, B, ctx.scale)
            a_dtype, b_dtype = ctx.a_dtype, ctx.b_dtype
            grad_A = grad_A if grad_A.dtype is a_dtype else grad_A.to(a_dtype)
            grad_B = grad_B if grad_B.dtype is b_dtype else grad_B.to(b_dtype)
        if u_is_x:  # grad_x = gy W + grad_u came as one result
            grad_x, grad_u = grad_u, None
        else:
            grad_x = None if W is None or not need[0] else gy_u @ (W if W.dtype is gy_u.dtype else W.to(gy_u.dtype))
        y0_dtype = ctx.y0_dtype
        grad_y0 = None if y0_dtype is None else gy if gy.dtype is y0_dtype else gy.to(y0_dtype)
        if len(shape) != 2:
            grad_x = None if grad_x is None else grad_x.view(shape)
            grad_u = None if grad_u is None else grad_u.view(shape)
            grad_y0 = None if grad_y0 is None else grad_y0.view(*shape[:-1], gy.shape[-1])
        return grad_x, grad_u, grad_y0, None, None, grad_A, grad_B, None, None, None


# Function.apply without its Python wrapper (argument binding for setup_context Functions, functorch unwrapping):
# _FunctionBase.apply itself, used while no functorch transform is active. A few us per call on a host-bound step.
_linear_apply = super(torch.autograd.Function, _Linear).apply


class _Conv2d(torch.autograd.Function):
    """The eager form of fdlora::lora_train_conv2d, returning y only."""

    @staticmethod
    def forward(ctx, u, y0, A, B, scale, stride, padding):
        y, h = ref.lora_train_conv2d(u, y0, A, B, scale, stride, padding)
        ctx.scale, ctx.stride, ctx.padding, ctx.y0_dtype = scale, stride, padding, y0.dtype
        ctx.save_for_backward(u, h, A, B)
        return y

    @staticmethod
    def backward(ctx, gy):
        u, h, A, B = ctx.saved_tensors
        grad_u, grad_A, grad_B = ref.lora_train_conv2d_backward(gy.contiguous(), u, h, A, B, ctx.scale, ctx.stride,
                                                                ctx.padding)
        return grad_u, gy.to(ctx.y0_dtype), grad_A.to(A.dtype), grad_B.to(B.dtype), None, None, None


def train_linear(x: Tensor, u: Tensor | None, y0: Tensor | None, W: Tensor | None, bias: Tensor | None, A: Tensor,
                 B: Tensor, scale: Tensor, casts: tuple[Tensor, ...] | None = None) -> Tensor:
    """y [..., N] of fdlora::lora_train_linear for x [..., K] (u like x, y0 like y): the registered op (on the
    leading dimensions folded) while torch.compile traces, its eager Function otherwise. `casts`: A, s A, B, s B
    made ahead in the activations' dtype (fdlora.layers.trainable.half_casts; the eager half-precision pair reads
    them)."""
    if torch.compiler.is_compiling():
        K = x.shape[-1]
        y = torch.ops.fdlora.lora_train_linear(x.reshape(-1, K), None if u is None else u.reshape(-1, K),
                                               None if y0 is None else y0.reshape(-1, y0.shape[-1]), W, bias, A, B,
                                               scale)[0]
        return y.view(*x.shape[:-1], y.shape[-1])
    if torch._C._are_functorch_transforms_active():
        return _Linear.apply(x, u, y0, W, bias, A, B, scale)
    if casts is not None and u is None and y0 is None and W is not None and not _takes_fused(x, A.shape[0]):
        dt = x.dtype  # the C++ form, where it is built (host time is what small layers pay; large ones, GPU time)
        if W.dtype is dt and (bias is None or bias.dtype is dt) and casts[0].dtype is dt:
            host = _HOST if _HOST is not None else _host()
            if host is not False:
                return host(x, A, B, W, bias, *casts)
    return _linear_apply(x, u, y0, W, bias, A, B, scale, None, casts)


_HOST = None  # fdlora.kernels.host's half_linear once looked for (False: not available here)
FUSED_MIN = 1 << 24  # elements of u from which the half pair's backward takes the fused pass over u (GPU time)
_FUSED = None  # lora_backward_parts.half_backward_fused once looked for (False: no Triton)


def _fused():
    global _FUSED
    if _FUSED is None:
        try:
            from fdlora.kernels.triton.train.lora_backward_parts import half_backward_fused
        except ImportError:
            half_backward_fused = False
        _FUSED = half_backward_fused
    return _FUSED


def _takes_fused(u: Tensor, r: int) -> bool:
    """Whether the half pair's backward of a rank-r layer on u takes the fused pass over u (`half_backward`)."""
    return u.is_cuda and u.numel() >= FUSED_MIN and r <= 64 and _fused() is not False


def half_backward(gy, u, h, W, As, Bs, scale, need_u=True):
    """The half pair's backward (lora_train.lora_train_linear_backward_half's signature) as an eager CUDA step runs
    it: from FUSED_MIN elements of u, with Triton, rank <= 64 and grad_u wanted, grad_A and grad_u in one pass over
    u (lora_backward_parts.half_backward_fused: the LoRA part of a Llama-3-8B layer's backward 0.53-0.55x the
    PEFT-style path's against 0.59-0.61x on an H100, benchmarks/probes/probe_x_pass.py); else
    cuBLAS's GEMMs."""
    if need_u and _takes_fused(u, As.shape[0]):
        return _FUSED(gy, u, h, W, As, Bs, scale)
    return ref.lora_train_linear_backward_half(gy, u, h, W, As, Bs, scale, need_u)


def _host():
    """The C++ form of the half pair over a plain base (fdlora.kernels.host: the same ATen calls without the Python
    around them), built on first use; False where it cannot be (the Function above then runs)."""
    global _HOST
    if _HOST is None:
        from .host import build

        lib = build.load()
        _HOST = lib.half_linear if lib is not None else False
    return _HOST


def train_linear_over(base, run, x: Tensor, u: Tensor | None, A: Tensor, B: Tensor, scale: Tensor,
                      casts: tuple[Tensor, ...] | None = None) -> Tensor:
    """base(x) + the LoRA part, for a frozen `base` module whose input gradient is gy W, and `run` computing both as
    the module does: run.forward(x) -> (base(x), saved), run.weight(saved, dtype) -> W [N, K] (a bitsandbytes 4-bit
    layer: fdlora.layers.trainable.frozen_4bit). In eager the base runs inside the Function (see _Linear): no graph node
    and no backward of its own, the delta added into its output in place, grad_x in one tensor. Under torch.compile:
    base(x) through its own autograd and the registered op, as for any outside base."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return train_linear(x, u, base(x), None, None, A, B, scale)
    return _linear_apply(x, u, None, None, None, A, B, scale, run, casts)


def train_conv2d(u: Tensor, y0: Tensor, A: Tensor, B: Tensor, scale: Tensor, stride: list[int],
                 padding: list[int]) -> Tensor:
    """y of fdlora::lora_train_conv2d: the registered op while torch.compile traces, its eager Function otherwise."""
    if torch.compiler.is_compiling():
        return torch.ops.fdlora.lora_train_conv2d(u, y0, A, B, scale, stride, padding)[0]
    return _Conv2d.apply(u, y0, A, B, scale, stride, padding)
