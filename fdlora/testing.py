"""Oracles and tolerances shared by tests, benchmarks and notebooks (no test framework needed).

The oracle computes in float64 from the same (already rounded) inputs; a result passes when its
error against the oracle is within a bound derived from eager PyTorch's own error in that dtype.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

EPS = {torch.float32: 1.2e-7, torch.float16: 9.8e-4, torch.bfloat16: 7.9e-3, torch.float64: 2.3e-16}


def oracle_delta(
    x: torch.Tensor,  # [M, K]
    A: torch.Tensor,  # [S, R, K]
    B: torch.Tensor,  # [N, S, R]
    row_scale: torch.Tensor,  # [M, S] effective scale of every slot for every row
) -> torch.Tensor:  # [M, N] float64
    S, R, K = A.shape
    N = B.shape[0]
    h = x.double() @ A.double().reshape(S * R, K).t()
    h = (h.view(-1, S, R) * row_scale.double()[:, :, None]).reshape(-1, S * R)
    return h @ B.double().reshape(N, S * R).t()


def eager_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The PEFT-style computation in x's dtype: what eager users get today (for error bounds)."""
    S, R, K = A.shape
    N = B.shape[0]
    h = x @ A.reshape(S * R, K).t()
    h = (h.view(-1, S, R) * row_scale.to(x.dtype)[:, :, None]).reshape(-1, S * R)
    return h @ B.reshape(N, S * R).t()


def bound(eager_err: float, ref: torch.Tensor, dtype: torch.dtype, factor: float = 2.0) -> float:
    """Allowed error: `factor` x eager's error, floored at a few ulps of the output's scale."""
    return factor * eager_err + 4 * EPS[dtype] * float(ref.abs().max()) + 1e-12


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in result"
    return float((a.double() - b.double()).abs().max())


def median_ms(fn, repeats: int, device: str = "cpu") -> float:
    """Median wall time of `fn` in ms after one warm-up call (synchronising CUDA around each call)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def step_ms(fn, device: torch.device | str) -> float:
    """One call of `fn` in ms: CUDA events around it (the GPU is idle at the start, so host-bound steps count host
    time), wall time on CPU."""
    if torch.device(device).type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


_FLUSH: dict[int, torch.Tensor] = {}  # CUDA device -> 256 MB zeroed before each timed replay (L2 is 50 MB on an H100)


def graph_ms(fn, reps: int) -> list[float]:
    """GPU time in ms of each of `reps` replays of `fn` captured once in a CUDA graph, L2 flushed before each (no host
    time, no operand left warm in L2 by the call before). `fn` runs once uncaptured first (compiles, autotunes) and
    the graph once untimed; all on a side stream of the current device."""
    return graphs_ms([fn], reps)[0]


def graphs_ms(fns, reps: int) -> list[list[float]]:
    """`graph_ms` of several functions, their replays taken in turn (rep i of each, then rep i + 1): the i-th times
    of all of them share the GPU's clocks of that moment, so per-rep differences and ratios are steadier than those
    of separate runs."""
    dev = torch.cuda.current_device()
    flush = _FLUSH.get(dev)
    if flush is None:
        flush = _FLUSH[dev] = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graphs = []
        for fn in fns:
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                fn()
            graph.replay()
            graphs.append(graph)
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
                  for _ in range(reps)]
        for rep in events:
            for graph, (start, end) in zip(graphs, rep):
                flush.zero_()
                start.record(stream)
                graph.replay()
                end.record(stream)
    torch.cuda.current_stream().wait_stream(stream)
    stream.synchronize()
    return [[rep[i][0].elapsed_time(rep[i][1]) for rep in events] for i in range(len(fns))]


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Inside, torch.empty fills new tensors with NaN: what a kernel leaves unwritten stays NaN, so a test sees a
    consumer that reads it (torch's deterministic mode, restored after)."""
    prev = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0])
        torch.utils.deterministic.fill_uninitialized_memory = prev[1]
