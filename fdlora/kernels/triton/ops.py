"""The Triton backend's ops: the contract's linear ops (fdlora.kernels.ops), plus the launches kept ready for the
fast paths (prepare_*), the split shrink and the many-layer merge.

Each op is registered with torch.library from its spec (`triton_op` + `wrap_triton`, namespace "fdlora"), so
torch.compile(fullgraph=True) traces into the kernels and CUDA graphs capture them. Nothing about
a launch depends on which adapters are active: slot activity, ranks and weights are read from
device tensors inside the kernels.

Which kernel runs:
- lora_delta: fused (one launch, forward/lora_delta.py) or split (lora_shrink + lora_expand_add) by the
  static rule in forward/delta_dispatch.py: split up to 256 rows (decode, small batches), where the fused
  kernel's per-program re-reads of A dominate; fused above (diffusion sizes).
- lora_delta_rows: always one launch (forward/lora_delta_rows.py); `prepare_delta_rows` also returns that launch
  kept ready, which eager decode layers replay (fdlora.layers.fastpath.decode).
- lora_shrink / lora_expand_add: the two halves, also usable on their own; lora_shrink_split (eager only) keeps
  the shrink's K-split partial sums for lora_expand_add to add (the one shrink per input of
  fdlora.layers.modules.shared_shrink).
  With a row_slot it computes each row for its own slot only (per-row mode's shared shrink), and lora_expand_add
  takes a member's strided [P, M, S, R] columns of that slot-major h.
Conv LoRA stays on the torch backend (the registry says so: kinds={"linear"}).

Plain eager calls (no compile, no tracing mode, plain tensors, no autograd) skip the dispatcher
and launch directly: a custom op's Python dispatch costs more host time than a decode-sized
kernel runs. Everything else goes through torch.ops.fdlora.*, which compile and export trace.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._library.triton import set_wrap_triton_enabled

from fdlora.kernels.ops import OPS
from fdlora.kernels.triton.forward import lora_delta as _delta  # registers fdlora::lora_delta
from fdlora.kernels.triton.forward import lora_delta_rows as _rows  # registers fdlora::lora_delta_rows
from fdlora.kernels.triton.forward import lora_expand_add as _expand  # registers fdlora::lora_expand_add
from fdlora.kernels.triton.forward import lora_linear as _linear  # registers fdlora::lora_linear
from fdlora.kernels.triton.forward import lora_linear_dispatch as D
from fdlora.kernels.triton.forward import lora_shrink as _shrink  # registers fdlora::lora_shrink
from fdlora.kernels.triton.merge import lora_merge as _merge
from fdlora.kernels.triton.merge import lora_merge_many as _many

from ..eager import direct
from ..eager import ones as _ones
from . import config as C

__all__ = ["lora_delta", "lora_delta_rows", "lora_expand_add", "lora_linear", "lora_merge", "lora_merge_many",
           "lora_shrink", "lora_shrink_split", "merge_table", "prepare_linear", "prepare_merge", "prepare_merge_many"]


def _bound(name: str, launch: Callable) -> Callable:
    """The op `name` of the contract: a plain eager call launches its kernel directly, anything else (compile,
    tracing modes, autograd) goes through torch.ops.fdlora.<name>."""
    op = getattr(torch.ops.fdlora, name)

    @functools.wraps(OPS[name].reference)
    def call(*args):
        if direct(*(a for a in args if a is not None)):
            with set_wrap_triton_enabled(False):
                return launch(*args)
        return op(*args)

    return call


lora_shrink = _bound("lora_shrink", _shrink.lora_shrink)
lora_expand_add = _bound("lora_expand_add", _expand.lora_expand_add)
lora_delta = _bound("lora_delta", _delta.lora_delta)
lora_delta_rows = _bound("lora_delta_rows", _rows.lora_delta_rows)
lora_linear = _bound("lora_linear", _linear.lora_linear)

NOT_IMPLEMENTED = {"lora_conv_delta": "conv LoRA runs on the torch backend (the registry routes conv layers there)"}


def lora_shrink_split(
    x: torch.Tensor,  # [M, K]
    A: torch.Tensor,  # [S, R, K]
    row_slot: torch.Tensor | None = None,  # [M] int32, -1 = none: each row for its own slot only (per-row mode)
) -> torch.Tensor:  # [P, M, S*R] fp32 partial sums over K (by row: only row m's slot's columns written)
    with set_wrap_triton_enabled(False):
        return _shrink.lora_shrink_split(x, A, row_slot)


def prepare_delta_rows(y, x, A, B, scale, row_slot, ranks):  # lora_delta_rows' parameters
    """lora_delta_rows now, and for plain eager calls the same launch kept ready, else None: `ready(y, x, scale,
    row_slot)` replays it on new tensors of the same shapes, strides and dtypes (False, launching nothing, if
    their alignment changed). An eager decode step replays one launch per layer without re-deriving it
    (fdlora.kernels.triton.config.Prepared, fdlora.layers.fastpath.decode)."""
    if direct(y, x, A, B, scale, row_slot, ranks):
        with set_wrap_triton_enabled(False):
            return _rows.launch_rows(y, x, A, B, scale, row_slot, ranks, keep=True)
    torch.ops.fdlora.lora_delta_rows(y, x, A, B, scale, row_slot, ranks)
    return None


def lora_merge(out, W, A, B, scale, ranks, stamp=None, version=None) -> torch.Tensor:  # the contract's op
    """W' = W + sum_s scale[s] B_s A_s into `out`: the merged-weight cache's refresh (fdlora.layers.fastpath.merged),
    called eagerly or from inside the opaque fdlora::merged_linear op, so it needs no torch.library registration of its
    own. With a stamp it checks on the device whether anything changed since the last merge and skips if not."""
    ones = _ones(A.shape[0], A.device)
    with set_wrap_triton_enabled(False):
        _merge.launch_merge(W, A, B, scale, ones, ranks, out=out[None], stamp=stamp, version=version)
    return out


def prepare_merge(out, W, A, B, scale, ranks, stamp, version) -> C.Prepared | None:  # lora_merge's
    """lora_merge with a stamp now, and the same launch kept ready with every argument bound (None where none can
    be kept): the device-checked cache of compiled and captured calls replays it every call, since the launch
    derivation (operand checks, Triton's binder) cost ~80 us of host time per layer per step."""
    ones = _ones(A.shape[0], A.device)
    with set_wrap_triton_enabled(False):
        return _merge.launch_merge(W, A, B, scale, ones, ranks, out=out[None], stamp=stamp, version=version,
                                   keep=True)[1]


def merge_table() -> _many.MergeTable:
    """A kept launch table for lora_merge_many (reused while the layers' addresses stay the same)."""
    return _many.MergeTable()


def lora_merge_many(entries: list[tuple[torch.Tensor, ...]], table: _many.MergeTable) -> None:
    """lora_merge for many layers in one launch: entries (W' [N, K], W [N, K], A [S, R, K], B [N, S, R], scale [S]
    fp32, ranks [S]) of one device, dtype and bank shape; the eager merged-weight cache's refresh
    (fdlora.layers.fastpath.remerge)."""
    table.launch([e[:5] for e in entries])


def prepare_merge_many(entries: list[tuple[torch.Tensor, ...]], table: _many.MergeTable) -> Callable[[], None]:
    """lora_merge_many kept for relaunches while no bank, copy or scale row is replaced or resized (the slider
    replay of fdlora.layers.fastpath.remerge): each relaunch checks only the weights' addresses."""
    kept = [e[:5] for e in entries]
    return functools.partial(table.launch, kept, kept=True)


# (device, dtype, stream) -> the merged weight of the layer running now, held weakly: the kept launches that write
# it hold it (views keep their base), so it goes back with the last model using it (tests/reliability/test_gpu_memory)
_SCRATCH: dict[tuple, weakref.ref] = {}


def prepare_linear(
    x: torch.Tensor,  # [M, K]
    W: torch.Tensor,  # [N, K] the base nn.Linear weight
    bias: torch.Tensor | None,  # [N]
    A: torch.Tensor,  # [S, R, K]
    B: torch.Tensor,  # [N, S, R]
    scale: torch.Tensor,  # [S] fp32 blend weights
    ranks: torch.Tensor,  # [S] int32
    stream: int,  # the current CUDA stream's handle
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """lora_linear's "merged" path kept ready for eager blend calls without the merged-weight cache: `run(x)` replays
    the merge W' = W + sum_s scale[s] B_s A_s into a scratch buffer with every argument bound, then runs one GEMM on
    it. The scratch is one per device, dtype and stream, shared by every layer (layers on one stream run one after
    another, so the next merge waits for the GEMM that reads it); a layer that needs more makes a bigger one, and
    earlier kept launches keep theirs alive. None when the dispatch picks another path for this shape (few rows:
    the delta) or no launch can be kept (plain calls, the interpreter).
    Why: the regular op costs ~300 us of host time per call (operand checks, dispatch, Triton's Python launcher);
    eager diffusion steps are host-bound, so that time was the step time (SDXL without the cache: 3.4x base)."""
    M, K = C.dims(x)
    N = C.dims(W)[0]
    S, R, _ = C.dims(A)
    if D.plan(D.Problem(M, K, N, S, R, x.dtype, x.device.type, C.device_sms(x), 1)).path != "merged":
        return None
    key = (W.device, W.dtype, stream)
    held = _SCRATCH.get(key)
    scratch = None if held is None else held()
    if scratch is None or scratch.numel() < N * K:
        scratch = torch.empty(N * K, device=W.device, dtype=W.dtype)
        _SCRATCH[key] = weakref.ref(scratch)
    out = scratch[: N * K].view(N, K)
    ones = _ones(S, A.device)
    with set_wrap_triton_enabled(False):
        _, ready = _merge.launch_merge(W, A, B, scale, ones, ranks, out=out[None], keep=True)
    if ready is None:
        return None

    def run(x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        ready()
        return F.linear(x, out, bias)

    return run


def plan_of(W: torch.Tensor, A: torch.Tensor, rows: int, groups: int) -> str | None:
    """The path the dispatcher planned for lora_linear over `rows` rows of W's layer with bank A in `groups` groups
    (None where it has made no plan for that shape): what fdlora.dispatch_counts reports."""
    N, K = C.dims(W)
    S, R, _ = C.dims(A)
    got = D.decided(D.Problem(rows, K, N, S, R, A.dtype, W.device.type, C.device_sms(W), groups))
    return None if got is None else got.path
