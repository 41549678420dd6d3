"""Captured steps: a module's forward recorded once per input signature as a CUDA graph, replayed after.

Why: an eager denoiser step of a full-size model is host-bound (the SDXL UNet's eager step keeps the GPU busy ~40% of
the time; every layer pays Python, dispatch and launch cost). A replayed CUDA graph issues the whole step with one
host call. fd-lora layers stay dynamic inside it: the model is frozen (`handle.freeze()`), so blend-mode layers run
fdlora::merged_linear, whose stamped merge reads the scale table and the banks' device version on the device. A
`set_adapters`, a slider move or a load into a free slot between two replays is merged by the next replay, with no
re-capture (fdlora.layers.fastpath.merged).

    runner = fdlora.capture_steps(pipe.unet)        # or pipe.enable_fd_lora_cuda_graphs()
    image = pipe("a castle").images[0]              # first call per shape: warm up twice, capture; then replays
    fdlora.set_adapters(pipe.unet, ["style"], [0.4])  # picked up by the next replay
    fdlora.release_steps(pipe.unet)                 # the eager forward again

A signature is the shapes, dtypes and devices of the tensor arguments, the values of the others, and fd-lora's
call mode (blend; per-sample or per-row with the identity of their device tensors, which later calls of the same
batch layout rewrite in place). A new signature captures anew, up to `max_graphs` (least recently used go first),
all in one memory pool. Calls with autograd enabled, calls while another capture is under way, and signatures
whose capture failed (a host sync in the forward: one warning) run eagerly.
Inputs are copied into the graph's static buffers; outputs are the graph's static tensors, which the next replay
overwrites, so they are returned as clones unless `clone_outputs=False` (then use each output before the next call).
"""

from __future__ import annotations

import collections
import logging
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fdlora.errors import FdLoraError
from fdlora.kernels.eager import graphed, warm_up
from fdlora.layers.registry import registry_of_models
from fdlora.layers.state import Mode, lasting

logger = logging.getLogger("fdlora")
_ATTR = "_fdlora_steps"


class CudaGraphs:
    """The capture mechanism (a seam: tests on machines without CUDA give their own)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise FdLoraError(f"captured steps need a CUDA device; this module's parameters are on {device}. Move "
                              "the model to the GPU first, or call it eagerly (no capture).")
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def capturing(t: torch.Tensor | None) -> bool:
        return t is not None and t.is_cuda and torch.cuda.is_current_stream_capturing()

    def capture(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        """(graph, static outputs): two warm-up calls on a side stream (autotuning, lazy allocations), then one
        captured call. A forward that cannot be captured (a host sync such as .item(), a pageable copy) raises
        Uncapturable; errors of the warm-up calls are the forward's own and propagate."""
        warm_up(run)
        try:
            return graphed(run, self.pool)
        except Exception as e:  # noqa: BLE001 (any failure inside capture means: not capturable)
            torch.cuda.synchronize()
            raise Uncapturable(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}") from e

    @staticmethod
    def replay(graph) -> None:
        graph.replay()


class Uncapturable(Exception):
    """The forward ran eagerly but could not be recorded as a CUDA graph."""


class StepGraphs:
    """The forward of one module, captured per signature (see the module docstring)."""

    def __init__(self, module: nn.Module, *, clone_outputs: bool = True, max_graphs: int = 8,
                 mechanism: Any = None) -> None:
        if max_graphs < 1:
            raise FdLoraError(f"max_graphs={max_graphs}: give at least 1.")
        self._hold(module, module.forward)  # the forward in place before capture (class method or a hook's wrapper)
        self.clone_outputs = clone_outputs
        self.max_graphs = max_graphs
        first = next(iter(module.parameters()), None)
        self.mech = mechanism or CudaGraphs(first.device if first is not None else torch.device("cpu"))
        self.graphs: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()
        self.captures = 0  # graphs captured so far (tests and benchmarks count re-captures)
        self.eager_only: set[tuple] = set()  # signatures whose capture failed: eager from then on
        self.replays = 0

    def _hold(self, module: nn.Module, eager: Callable) -> None:
        """The module holds this runner (as its forward): it and its bound forward are held weakly here, so no
        reference cycle keeps the model (and its static buffers) alive until a garbage collection."""
        self._module = weakref.ref(module)
        self._eager = (weakref.WeakMethod(eager) if isinstance(eager, types.MethodType) and eager.__self__ is module
                       else lambda: eager)

    def __getstate__(self) -> dict:  # copies carry the module and its forward, held weakly again on the other side
        return {**self.__dict__, "_module": self.module, "_eager": self.eager}

    def __setstate__(self, state: dict) -> None:
        module, eager = state.pop("_module"), state.pop("_eager")
        self.__dict__.update(state)
        self._hold(module, eager)

    @property
    def module(self) -> nn.Module | None:
        return self._module()

    @property
    def eager(self) -> Callable:
        """The module's forward as it was before capture."""
        return self._eager()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        first = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
        if torch.is_grad_enabled() or self.mech.capturing(first):  # training, or inside someone else's capture
            return self.eager(*args, **kwargs)
        key = (str(spec), tuple(_signature(v) for v in leaves), _mode_key(self.module))
        if key in self.eager_only:
            return self.eager(*args, **kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, leaves, spec)
            except Uncapturable as e:
                self.eager_only.add(key)
                logger.warning("fd-lora: %s's forward cannot be captured as a CUDA graph for this input signature "
                               "(%s); those calls run eagerly", type(self.module).__name__, e)
                return self.eager(*args, **kwargs)
        else:
            self.graphs.move_to_end(key)
        graph, static, out = entry
        for buf, v in zip(static, leaves):
            if isinstance(buf, torch.Tensor) and buf is not v:
                buf.copy_(v)
        self.mech.replay(graph)
        self.replays += 1
        return pytree.tree_map_only(torch.Tensor, torch.clone, out) if self.clone_outputs else out

    def _capture(self, key: tuple, leaves: list, spec) -> tuple:
        with lasting():  # every later call copies its inputs in, whatever its mode
            static = [v.clone() if isinstance(v, torch.Tensor) else v for v in leaves]

        def run():
            a, kw = pytree.tree_unflatten(static, spec)
            return self.eager(*a, **kw)

        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        graph, out = self.mech.capture(run)
        self.captures += 1
        logger.info("fd-lora: captured %s's step for a new input signature (%d so far)",
                    type(self.module).__name__, self.captures)
        self.graphs[key] = entry = (graph, static, out)
        return entry


def _signature(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.dtype, v.device)
    try:
        hash(v)
        return v
    except TypeError:
        return ("R", type(v).__qualname__, repr(v))


def _mode_key(module: nn.Module) -> tuple:
    """fd-lora's call mode: the host branch every layer takes, and the device tensors per-sample / per-row calls
    read (rewritten in place while their batch layout repeats; a new tensor means a new graph)."""
    h = registry_of_models.get(module)
    if h is None:
        return ()
    st = h.state
    if st.mode is Mode.SAMPLES:
        return (st.mode, tuple(sorted(((k, id(t)) for k, t in st._group_weight.items()), key=str)))
    if st.mode is Mode.ROWS:
        return (st.mode, tuple((d, id(t)) for d, t in st._row_slot.items()))
    return (st.mode,)


def capture_steps(module: nn.Module, *, clone_outputs: bool = True, max_graphs: int = 8,
                  mechanism: Any = None) -> StepGraphs:
    """Run `module`'s forward as CUDA graphs from now on (see the module docstring); returns the runner. Freezes the
    module's fd-lora layers (if it has any) so adapter switches and slider moves apply on replay."""
    if _ATTR in module.__dict__:
        raise FdLoraError(f"{type(module).__name__}'s steps are already captured; call fdlora.release_steps(module) "
                          "first to change the options.")
    runner = StepGraphs(module, clone_outputs=clone_outputs, max_graphs=max_graphs, mechanism=mechanism)
    h = registry_of_models.get(module)
    was_static = h is not None and h.state.static
    if h is not None:
        h.freeze()
    module.__dict__[_ATTR] = (runner, was_static, module.__dict__.get("forward"))
    module.forward = runner  # an instance attribute: nn.Module.__call__ finds it before the class's forward
    return runner


def release_steps(module: nn.Module) -> None:
    """Back to the eager forward: the graphs are dropped, and the fd-lora layers unfrozen unless they were frozen
    before capture_steps. Never call it while a graph of this module is being replayed elsewhere."""
    kept = module.__dict__.pop(_ATTR, None)
    if kept is None:
        return
    runner, was_static, prior = kept
    runner.graphs.clear()
    if module.__dict__.get("forward") is runner:
        del module.__dict__["forward"]
        if prior is not None:  # a wrapper that was in place before (an accelerate hook) goes back
            module.forward = prior
    h = registry_of_models.get(module)
    if h is not None and not was_static:
        h.unfreeze()


def steps_of(module: nn.Module) -> StepGraphs | None:
    kept = module.__dict__.get(_ATTR)
    return None if kept is None else kept[0]
