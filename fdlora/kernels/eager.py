"""What both kernel backends (triton/ops.py, cuda/ops.py) need to call their kernels directly from eager code, and
the CUDA-graph capture that the dispatcher's timings and fd-lora's captured steps (fdlora.layers.fastpath.captured)
share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a base layer's weight is a Parameter: still a plain tensor here


def direct(*tensors: torch.Tensor) -> bool:
    """True when launching a kernel directly is indistinguishable from going through its op: eager, no tracing mode,
    plain tensors, no autograd."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    grad = torch.is_grad_enabled()
    return all(type(t) in _PLAIN and not (grad and t.requires_grad) for t in tensors)


_ONES: dict[tuple[int, torch.device], torch.Tensor] = {}  # blend merges' group weights: none made per call


def ones(S: int, device: torch.device) -> torch.Tensor:
    """[1, S] ones: the one group of a blend."""
    t = _ONES.get((S, device))
    if t is None:
        t = _ONES[(S, device)] = torch.ones(1, S, device=device)
    return t


def warm_up(run: Callable[[], Any]) -> None:
    """Two calls of `run` on a side stream, as a capture needs before it (autotuning, compiles, lazy allocations
    happen outside the graph); the current stream waits for them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
        run()
    torch.cuda.current_stream().wait_stream(side)


def graphed(run: Callable[[], Any], pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, outputs) of one call of `run` captured in a CUDA graph (in `pool`, if given); call `warm_up` first."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out
