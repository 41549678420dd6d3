"""A frozen bitsandbytes 4-bit base (Linear4bit: nf4 / fp4) run inside fd-lora's trainable op, for QLoRA.

The op's eager Function (fdlora.kernels.train_ops.train_linear_over) computes the base output and, in the backward,
the base's input gradient gy W itself. `Frozen4bit` does both as bitsandbytes does them, through its public
`bitsandbytes.functional` and the `torch.ops.bitsandbytes.dequantize_4bit` op it calls:

    forward   absmax = the block scales (dequantize_blockwise of the double-quantized ones + offset, made once and
              kept while the quant state's tensors are the same and unchanged: the base is frozen)
              W = dequantize_4bit(weight, absmax) in the compute dtype           [N, K]
              y0 = linear(x in the compute dtype, W, bias), in x's dtype
    backward  W = dequantize_4bit(weight, the saved absmax) in gy's dtype         (grad_x = gy W + the LoRA part)

which is Linear4bit.forward's no-grad path (bnb.matmul_4bit -> gemm_4bit: dequantize, then F.linear; on CUDA
bitsandbytes 0.50 takes that path from M > 1536 rows, below it a fused kernel with another summation order) and
MatMul4Bit's backward (gy dequantize_4bit(W).to(gy's dtype)), without their Python layers: Linear4bit.forward,
matmul_4bit, the gemm_4bit op's dispatch, MatMul4Bit. Double-quantized block scales are dequantized once a call and
kept for the backward (fp32: 1/16 byte a weight while the step's graph lives), and the backward dequantizes W straight
into gy's dtype (the kernel rounds its fp32 product once either way) rather than into the stored dtype and then
casting: 1 launch where MatMul4Bit's backward takes 4 (scales, offset, W, cast). Eager QLoRA steps of many small
layers are host-bound.

Anything else runs the module itself (`forward` returns None for the saved state; `weight` then dequantizes as
MatMul4Bit's backward does): forward hooks or a patched forward (accelerate's), a weight without its quant state
(bitsandbytes restores it in its forward), the CPU inference path (an eval-mode module, an input without grad: on a
CPU with AVX512-BF16 bitsandbytes repacks the weight for its bf16 kernel), the legacy [K, N] weight orientation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _nn_module

_bnb_f = None  # bitsandbytes.functional, imported by the first Frozen4bit (this module imports no bitsandbytes)


def frozen_4bit(module: nn.Module) -> Frozen4bit | None:
    """A Frozen4bit for a bitsandbytes Linear4bit (or a subclass keeping its forward), else None."""
    t = type(module)
    if t.__module__.split(".")[0] != "bitsandbytes":
        return None
    import bitsandbytes as bnb

    if not isinstance(module, bnb.nn.Linear4bit) or t.forward is not bnb.nn.Linear4bit.forward:
        return None
    return Frozen4bit(module)


class Frozen4bit:
    """forward(x) -> (y0, saved) and weight(saved, dtype) -> W [N, K] of one frozen Linear4bit (see the module
    docstring)."""

    __slots__ = ("module", "_scales")

    def __init__(self, module: nn.Module) -> None:
        global _bnb_f
        if _bnb_f is None:
            import bitsandbytes.functional

            _bnb_f = bitsandbytes.functional
        self.module = module
        self._scales = None  # (the quant state's absmax and state2 tensors and versions, their fp32 dequantization)

    def _direct(self, x: Tensor):
        """(the packed weight as a plain tensor, its quant state) when forward may skip the module, else None. (The
        weight is a Params4bit, whose Python __torch_function__ every op on it would go through, a few us each.)"""
        m = self.module
        d = m.__dict__
        if (d["_forward_hooks"] or d["_forward_pre_hooks"] or "forward" in d or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks):
            return None
        w = d["_parameters"]["weight"]
        qs = getattr(w, "quant_state", None)
        if qs is None or qs.shape[-1] != x.shape[-1]:
            return None
        if x.is_cpu and (getattr(qs, "packing_format_for_cpu", False) or not (m.training or x.requires_grad)
                         and getattr(m, "support_avx512bf16_for_cpu", False)):
            return None  # Linear4bit.forward repacks the weight for its CPU bf16 inference kernel, and runs that
        w = w.data
        return (w, qs) if w.shape[0] != 1 else None  # (dequantize_4bit transposes a [1, n] weight)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple | None]:
        """y0 = the module's output for x, and what `weight` needs (the packed weight, its quant state and block
        scales: the backward rebuilds the W this forward used; None: the module ran)."""
        m = self.module
        direct = self._direct(x)
        if direct is None:
            return m(x), None
        w, qs = direct
        if not m.compute_type_is_set:  # Linear4bit.forward: the first input's dtype may set the compute dtype
            m.set_compute_type(x)
            m.compute_type_is_set = True
        cd = m.compute_dtype
        xc = x if cd is None or x.dtype is cd else x.to(cd)
        absmax = qs.absmax
        if qs.nested:
            absmax = self._block_scales(qs)
        W = _dequantize(w, qs, absmax, xc.dtype)
        bias = m._parameters["bias"]
        if bias is not None and bias.dtype is not xc.dtype:
            bias.data = bias.data.to(xc.dtype)  # as Linear4bit.forward does: its bias is kept in the compute dtype
        y0 = F.linear(xc, W, bias)
        return (y0 if y0.dtype is x.dtype else y0.to(x.dtype)), (w, qs, absmax)

    def _block_scales(self, qs) -> Tensor:
        """The double-quantized block scales dequantized (fp32), made once for as long as the quant state's tensors
        are the same and unchanged (a frozen base: every step would make them again, 2-3 launches a layer)."""
        a, st = qs.absmax, qs.state2
        key = (a, a._version, st.absmax, st.absmax._version, st.code, qs.offset)
        c = self._scales
        if c is not None and all(x is y if isinstance(x, Tensor) else x == y for x, y in zip(c[0], key)):
            return c[1]
        absmax = _bnb_f.dequantize_blockwise(a, st)
        absmax += qs.offset
        if absmax.dtype is not torch.float32:
            absmax = absmax.float()
        self._scales = (key, absmax)
        return absmax

    def weight(self, saved: tuple | None, dtype: torch.dtype) -> Tensor:
        """W [N, K] in dtype, from what `forward` returned (None: the module's weight dequantized as MatMul4Bit
        does)."""
        if saved is None:
            w = self.module._parameters["weight"]
            return _bnb_f.dequantize_4bit(w, w.quant_state).to(dtype)
        return _dequantize(*saved, dtype)


def _dequantize(w: Tensor, qs, absmax: Tensor, dtype: torch.dtype) -> Tensor:
    """The packed weight w with quant state qs dequantized into dtype [N, K], given its fp32 block scales: the op
    bitsandbytes.functional.dequantize_4bit calls, called directly (its wrapper builds a QuantState and checks it
    each call, host time twice a layer a step; this quant state was checked when the module made it)."""
    return torch.ops.bitsandbytes.dequantize_4bit.default(w, absmax, qs.blocksize, qs.quant_type, qs.shape, dtype)
