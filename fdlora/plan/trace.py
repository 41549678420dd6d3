"""Run a model's forward on the `meta` device and record every torch call: what a GPU step would launch.

Why a torch-function trace and not the aten one: on `meta` (and on CPU) scaled_dot_product_attention
decomposes into bmm + softmax, while a GPU runs one flash kernel; at the torch-function level every call is
what one eager host dispatch costs, and `F.scaled_dot_product_attention` stays one call. Nested calls run
with the mode off, so a functional written in Python counts once. Views launch nothing and are kept apart.
Nothing here allocates memory: meta tensors carry shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_GEMM = {F.linear, torch.matmul, torch.Tensor.matmul, torch.bmm, torch.mm, torch.addmm, torch.baddbmm,
         torch.Tensor.__matmul__}
_CONV = {F.conv1d, F.conv2d, F.conv3d}


@dataclass
class Op:
    """One launched call: kind gemm | conv | attn | other; `flops` and `bytes` for the roofline; for the
    Linear/Conv calls `weight` is the parameter's name in the model (targets are matched on it)."""

    kind: str
    flops: float
    bytes: float
    itemsize: float
    M: int = 0
    K: int = 0
    N: int = 0
    batch: int = 1
    weight: str = ""


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _nbytes(ts: list[torch.Tensor]) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


class Recorder(TorchFunctionMode):
    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names = names
        self.ops: list[Op] = []
        self.views = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins, outs = _tensors(args) + _tensors(kwargs), _tensors(out)
        if not outs:
            return out
        if func in _GEMM:
            self._gemm(func, args, outs[0])
        elif func in _CONV:
            self._conv(args, outs[0])
        elif func is F.scaled_dot_product_attention:
            q = args[0] if args else kwargs["query"]
            k = args[1] if len(args) > 1 else kwargs["key"]
            ins = [q, k, args[2] if len(args) > 2 else kwargs["value"]]
            L, S, D = q.shape[-2], k.shape[-2], q.shape[-1]
            bh = q.numel() // (L * D)
            flops = 4.0 * bh * L * S * D
            self.ops.append(Op("attn", flops, _nbytes(ins) + _nbytes(outs), q.element_size(), L, D, S, bh))
        elif all(o._is_view() for o in outs) or func in (torch.Tensor.size, torch.Tensor.dim):
            self.views += 1
        else:
            item = max((t.element_size() for t in outs), default=2)
            self.ops.append(Op("other", 0.0, _nbytes(ins) + _nbytes(outs), item))
        return out

    def _gemm(self, func, args, y: torch.Tensor) -> None:
        if func is F.linear:
            x, w = args[0], args[1]
            K, N = w.shape[1], w.shape[0]
            M = x.numel() // K
            self.ops.append(Op("gemm", 2.0 * M * K * N, 0.0, x.element_size(), M, K, N, 1,
                               self.names.get(id(w), "")))
            return
        a, b = (args[1], args[2]) if func in (torch.addmm, torch.baddbmm) else (args[0], args[1])
        K, N = a.shape[-1], b.shape[-1]
        M = a.shape[-2] if a.dim() > 1 else 1
        batch = max(1, y.numel() // max(1, M * N))
        self.ops.append(Op("gemm", 2.0 * batch * M * K * N, 0.0, a.element_size(), M, K, N, batch))

    def _conv(self, args, y: torch.Tensor) -> None:
        x, w = args[0], args[1]
        N = w.shape[0]
        K = w[0].numel()
        M = y.numel() // N
        self.ops.append(Op("conv", 2.0 * M * K * N, 0.0, x.element_size(), M, K, N, 1, self.names.get(id(w), "")))


def trace(model: torch.nn.Module, inputs: dict) -> Recorder:
    """Record one forward of `model` (built on meta) on meta `inputs`."""
    names = {id(p): n.removesuffix(".weight") for n, p in model.named_parameters()}
    rec = Recorder(names)
    with torch.no_grad(), rec:
        model(**inputs)
    return rec
