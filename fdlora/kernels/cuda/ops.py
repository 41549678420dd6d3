"""The CUDA C++ backend's ops: same functions and signatures as fdlora.kernels.ops, each one call into the
compiled library (csrc/ops.cpp) through the dispatcher, which does its host work in C++ (shape checks, the path
choice, cuBLAS and kernel launches). Fake kernels make torch.compile(fullgraph=True) trace them; nothing in a call
depends on which adapters are active (that is read from device tensors), so CUDA graphs capture them.

Importing this module loads the library, building it first if needed (fdlora.kernels.cuda.build).
"""

from __future__ import annotations

import torch

from ..eager import direct, ones
from ..ops import OPS
from . import build

_C = build.load()

_ops = torch.ops.fdlora_cuda
_shrink = _ops.lora_shrink.default
_expand = _ops.lora_expand_add.default
_delta = _ops.lora_delta.default
_rows = _ops.lora_delta_rows.default
_linear = _ops.lora_linear.default
_merge = _ops.lora_merge.default
_many = _ops.lora_merge_many.default
_conv = _ops.lora_conv_delta.default
_bias = _ops.lora_bias_add.default

__all__ = ["lora_bias_add", "lora_conv_delta", "lora_delta", "lora_delta_rows", "lora_expand_add", "lora_linear",
           "lora_merge", "lora_merge_many", "lora_shrink", "merge_table", "prepare_delta_rows", "prepare_groups",
           "prepare_linear", "prepare_linear_rows", "prepare_samples", "prepare_samples_banked"]


def lora_shrink(x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:  # [M, K], [S, R, K] -> [M, S*R] fp32
    return _shrink(x, A)


def lora_expand_add(y: torch.Tensor, h: torch.Tensor, B: torch.Tensor, scale: torch.Tensor,
                    group_weight: torch.Tensor) -> None:
    _expand(y, h, B, scale, group_weight)


def lora_delta(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor,
               group_weight: torch.Tensor, ranks: torch.Tensor) -> None:
    """Blend / per-sample-segment mode: y += ((x A^T) * w) B^T over all slots as one rank-S*R adapter."""
    if direct(y, x, A, B, scale, group_weight, ranks):
        return _C.lora_delta(y, x, A, B, scale, group_weight, ranks)
    _delta(y, x, A, B, scale, group_weight, ranks)


def lora_delta_rows(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor,
                    row_slot: torch.Tensor, ranks: torch.Tensor) -> None:
    """Per-row mode: row m gets slot row_slot[m] at scale[row_slot[m]], or nothing for -1."""
    if direct(y, x, A, B, scale, row_slot, ranks):
        return _C.lora_delta_rows(y, x, A, B, scale, row_slot, ranks)
    _rows(y, x, A, B, scale, row_slot, ranks)


def lora_linear(x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor,
                scale: torch.Tensor, group_weight: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """Base GEMM + LoRA as one op: merged weight + one GEMM, or GEMM + delta, chosen per shape in C++."""
    if direct(x, W, A, B, scale, group_weight, ranks) and (bias is None or direct(bias)):
        return _C.lora_linear(x, W, bias, A, B, scale, group_weight, ranks)
    return _linear(x, W, bias, A, B, scale, group_weight, ranks)


def prepare_delta_rows(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor,
                       row_slot: torch.Tensor, ranks: torch.Tensor):
    """lora_delta_rows now, and for plain eager calls the call kept with the bank bound: `ready(y, x, scale,
    row_slot)` runs it on new tensors (True), as fdlora.layers.fastpath.decode replays one launch per layer."""
    lora_delta_rows(y, x, A, B, scale, row_slot, ranks)
    if not direct(y, x, A, B, scale, row_slot, ranks):
        return None
    run = _C.lora_delta_rows

    def ready(y: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, row_slot: torch.Tensor) -> bool:
        run(y, x, A, B, scale, row_slot, ranks)
        return True

    return ready


def prepare_linear(x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor,
                   scale: torch.Tensor, ranks: torch.Tensor, stream: int):
    """lora_linear (blend) with every argument but x bound in C++ for x's row count, for eager layers to keep and call:
    `run(x)` (the path and a cuBLASLt plan of its GEMM chosen once; `run.merged`, `run.planned` say which). None for
    calls that must go through the dispatcher (traced, autograd). The layer remakes it when an address, the stream or
    the row count changes (fdlora.layers.modules.fused.FusedLoraLinear._kept_linear)."""
    if not (direct(x, W, A, B, scale, ranks) and (bias is None or direct(bias))):
        return None
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return _C.BoundLinear(W, bias, A, B, scale, ones(A.shape[0], A.device), ranks, M)


def prepare_linear_rows(x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor,
                        B: torch.Tensor, scale: torch.Tensor, row_slot: torch.Tensor, ranks: torch.Tensor):
    """The base GEMM and lora_delta_rows with every argument but x bound in C++: `run(x)` -> y ([..., N] for x
    [..., K] holding row_slot's rows), for eager decode layers to keep (fdlora.layers.fastpath.decode) and replay on
    their hot path (fdlora.layers.fastpath.hot). None where a call must go through the dispatcher (traced, autograd)
    or W is not a plain row-major weight in the bank's dtype."""
    if (not (direct(x, W, A, B, scale, row_slot, ranks) and (bias is None or direct(bias)))
            or W.dtype != A.dtype or W.dim() != 2 or W.stride(1) != 1 or row_slot.dtype != torch.int32):
        return None
    return _C.BoundRows(W, bias, A, B, scale, row_slot, ranks)


def prepare_groups(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None, jobs: list[int]):
    """Per-prompt groups of x's rows, each on its own merged weight, bound in C++: `run(x)` -> y. jobs: 5 ints per
    job (weight index, first row, rows, count, stride): count blocks of `rows` rows, `stride` rows apart, on one
    weight (one cuBLASLt matmul planned at bind time, or one strided-batched cuBLAS GEMM). None for calls that must
    go through the dispatcher or weights that are not contiguous in x's dtype on x's device."""
    if (not (direct(x, *weights) and (bias is None or direct(bias)))
            or any(w.dtype != x.dtype or w.device != x.device or not w.is_contiguous() for w in weights)):
        return None
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return _C.BoundGroups(weights, bias, jobs, M)


def prepare_samples(x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor, Bg: torch.Tensor,
                    jobs: list[int]):
    """Per-prompt blends with no kept copy, bound in C++ for x's row count: `run(x)` -> y merges each blend's
    W'_b = W + Bg[b] A into one scratch (one planned cuBLASLt matmul per blend, W read in place) and runs the batch's
    GEMMs on the copies. A [nR, K], Bg [nb, N, nR] (nR a multiple of 8); jobs: 6 ints per job (weight index, first
    row, rows, count, stride, step), weight nb being W itself, block i of a job on weight index + i * step. None for
    calls that must go through the dispatcher or shapes cuBLASLt has no plan for."""
    if not (direct(x, W, A, Bg) and (bias is None or direct(bias))) or W.dtype != x.dtype or W.device != x.device:
        return None
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    run = _C.BoundSamples(W, bias, A, Bg, jobs, M)
    return run if run.planned else None


def prepare_samples_banked(x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor,
                           B: torch.Tensor, scale: torch.Tensor, ranks: torch.Tensor, blends: torch.Tensor,
                           jobs: list[int]):
    """prepare_samples with the blends merged from the bank (A [S, R, K], B [N, S, R], scale [S] and ranks [S] as the
    ops take them, blends [nb, S] fp32: each blend's slot weights) by one launch of the extension's merge kernel for
    all of them: W'_b = W + sum_s scale[s] blends[b, s] B_s A_s. None where prepare_samples' form would be."""
    if (not (direct(x, W, A, B, scale, ranks, blends) and (bias is None or direct(bias))) or W.dtype != x.dtype
            or W.device != x.device):
        return None
    M = x.numel() // x.shape[-1] if x.shape[-1] else 0
    run = _C.BoundSamples(W, bias, A, B, scale, ranks, blends, jobs, M)
    return run if run.planned else None


def lora_merge(out: torch.Tensor, W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor,
               ranks: torch.Tensor, stamp: torch.Tensor | None = None,
               version: torch.Tensor | None = None) -> torch.Tensor:
    """out = W + sum_s scale[s] B_s A_s (fp32 sum, one rounding); with a stamp, skipped on the device when nothing
    changed since the last stamped merge (fdlora.kernels.ops.lora_merge.new_stamp has the layout)."""
    _merge(out, W, A, B, scale, ranks, stamp, version)
    return out


def merge_table() -> None:
    """lora_merge_many builds its pointer table in C++ on every call: nothing to keep between calls."""
    return None


def lora_merge_many(entries: list[tuple[torch.Tensor, ...]], table: None = None) -> None:
    """lora_merge for many layers in one launch: entries (W', W, A, B, scale[, ranks]) of one device, dtype and bank
    shape."""
    outs, Ws, As, Bs, scales = (list(c) for c in zip(*(e[:5] for e in entries)))
    _many(outs, Ws, As, Bs, scales)


def lora_conv_delta(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor,
                    group_weight: torch.Tensor, stride: tuple[int, int], padding: tuple[int, int] | str,
                    dilation: tuple[int, int]) -> None:
    """Conv LoRA (kohya LoCon): A is a conv with the base geometry, B a 1x1 conv (cuDNN through ATen)."""
    if isinstance(padding, str):
        _conv(y, x, A, B, scale, group_weight, list(stride), [0, 0], list(dilation), padding)
    else:
        _conv(y, x, A, B, scale, group_weight, list(stride), list(padding), list(dilation), None)


def lora_bias_add(y: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor, group_weight: torch.Tensor,
                  row_slot: torch.Tensor | None = None) -> None:
    """y += w @ bias with w the per-row slot weights (LoRA bias entries, [S, N]), added in fp32."""
    _bias(y, bias, scale, group_weight, row_slot)


# fake kernels (shapes only, for torch.compile and FakeTensor tracing): the contract's, for the ops that return a tensor
for _name in ("lora_shrink", "lora_linear"):
    torch.library.register_fake(f"fdlora_cuda::{_name}")(OPS[_name].fake)
for _name in ("lora_expand_add", "lora_delta", "lora_delta_rows", "lora_merge", "lora_merge_many", "lora_conv_delta",
              "lora_bias_add"):
    torch.library.register_fake(f"fdlora_cuda::{_name}")(lambda *args, **kwargs: None)
