"""Backends as data, and the one place that chooses between them.

A backend declares what it can run (`Capability`); a layer describes what it needs (`Problem`);
`select` compares the two and returns the backend together with the reasons for and against every
candidate. Layers call `select` once, when they are built or their bank changes shape, and keep the
`Selection` (their `repr` shows it). Adding a backend is one `register(Backend(...))` call.
"""

from __future__ import annotations

import contextlib
import importlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from .. import env
from ..errors import BackendUnavailableError

AUTO_ORDER = ("triton+cuda", "triton", "cuda", "torch")  # triton+cuda: only once the extension is built


@dataclass(frozen=True)
class Capability:
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    kinds: frozenset[str]  # "linear", "conv2d"
    max_rank: int | None = None  # bank rank capacity R
    max_slots: int | None = None
    compile_safe: bool = True
    needs_contiguous: bool = False


@dataclass(frozen=True)
class Problem:
    device: str  # "cpu", "cuda", ...
    dtype: torch.dtype
    kind: str
    rank: int
    slots: int


@dataclass
class Backend:
    name: str
    capability: Capability
    module: str  # import path of the module holding the ops; imported on first use
    probe: Callable[[], str | None] = lambda: None  # a reason it cannot run on this machine, or None
    auto: Callable[[], str | None] = lambda: None  # a reason `auto` passes it over (it may still be requested)
    _ops: ModuleType | None = field(default=None, repr=False)
    _unavailable: str | None = field(default=None, repr=False)
    _probed: bool = field(default=False, repr=False)

    def __deepcopy__(self, memo) -> Backend:  # a process-wide singleton: copies of a model share it
        return self

    def unavailable(self) -> str | None:
        if not self._probed:
            self._probed = True
            try:
                self._unavailable = self.probe()
                if self._unavailable is None:
                    self._ops = importlib.import_module(self.module)  # an optional backend, on first use
            except Exception as e:  # a backend that cannot import is recorded, never raised here
                self._unavailable = f"import failed: {type(e).__name__}: {e}"
        return self._unavailable

    @property
    def ops(self) -> ModuleType:
        reason = self.unavailable()
        if reason is not None:
            raise BackendUnavailableError(f"backend {self.name!r} is unavailable: {reason}")
        assert self._ops is not None
        return self._ops

    def refuses(self, p: Problem) -> str | None:
        """Why this backend cannot run `p` (first reason), or None if it can."""
        if (reason := self.unavailable()) is not None:
            return reason
        c = self.capability
        if p.device not in c.devices:
            return f"device {p.device} not in {sorted(c.devices)}"
        if p.dtype not in c.dtypes:
            return f"dtype {p.dtype} not supported"
        if p.kind not in c.kinds:
            return f"layer kind {p.kind} not supported"
        if c.max_rank is not None and p.rank > c.max_rank:
            return f"rank capacity {p.rank} > {c.max_rank}"
        if c.max_slots is not None and p.slots > c.max_slots:
            return f"slots {p.slots} > {c.max_slots}"
        return None


@dataclass(frozen=True)
class Selection:
    backend: Backend
    reasons: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.backend.name

    def __deepcopy__(self, memo) -> Selection:
        return self

    def __str__(self) -> str:
        return f"{self.name} [{'; '.join(self.reasons)}]"


@dataclass
class Elsewhere(Backend):
    """A requested backend on a layer whose device it does not run on (a model loaded on the CPU before `.to("cuda")`
    under FDLORA_BACKEND=triton): wrapping, loads and moves work, and the move reselects; a call raises `reason`."""

    reason: str = ""

    @property
    def ops(self) -> _Refusing:
        return _Refusing(self.reason)


class _Refusing:
    """The ops of an `Elsewhere` backend: every op exists (so layers set up as they would on the device) and
    raises the reason when called."""

    def __init__(self, reason: str) -> None:
        self._reason = reason

    def __getattr__(self, name: str):
        def refuse(*args, **kwargs):
            raise BackendUnavailableError(self._reason)

        return refuse


_BACKENDS: dict[str, Backend] = {}
_preference: str | None = None  # None: read FDLORA_BACKEND
_layers: weakref.WeakSet[Any] = weakref.WeakSet()  # live layers, reselected by set_backend


def register(backend: Backend) -> None:
    _BACKENDS[backend.name] = backend


def backends() -> dict[str, Backend]:
    return dict(_BACKENDS)


def preference() -> str:
    return _preference if _preference is not None else env.backend_preference()


def _check_name(name: str) -> str:
    name = name.lower()
    if name != "auto" and name not in _BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose one of: auto, {', '.join(_BACKENDS)}.")
    return name


def select(problem: Problem, prefer: str | None = None) -> Selection:
    """Pick the backend for `problem`: the preferred one, or the first capable one in AUTO_ORDER."""
    prefer = _check_name(prefer or preference())
    if prefer != "auto":
        b = _BACKENDS[prefer]
        refused = b.refuses(problem)
        if refused is None:
            return Selection(b, (f"requested {prefer!r}", f"{prefer}: ok"))
        if b.unavailable() is None and problem.device not in b.capability.devices:  # runs, but not on this device
            devices = " or ".join(sorted(b.capability.devices))
            return Selection(Elsewhere(b.name, b.capability, b.module, reason=(
                f"backend {prefer!r} (requested) does not run on {problem.device}, where this layer is. Move the "
                f"model to {devices} (the layers reselect on .to()), or use fdlora.set_backend('auto') (or unset "
                "FDLORA_BACKEND) to run it here.")), (f"requested {prefer!r}: no calls on {problem.device}",
                                                      f"{prefer}: {refused}"))
        raise BackendUnavailableError(
            f"backend {prefer!r} cannot run {problem}. Every backend: " + "; ".join(_trace(_verdicts(problem)))
            + ". Use fdlora.set_backend('auto') (or unset FDLORA_BACKEND) to fall back automatically."
        )
    verdicts = _verdicts(problem, AUTO_ORDER)
    for name in AUTO_ORDER:
        if name in verdicts and verdicts[name] is None:
            return Selection(_BACKENDS[name], (f"auto picked {name!r}", *_trace(verdicts)))
    raise BackendUnavailableError(f"no backend can run {problem}: " + "; ".join(_trace(verdicts)))


def _trace(verdicts: dict[str, str | None]) -> list[str]:
    return [f"{n}: {'ok' if r is None else r}" for n, r in verdicts.items()]


def _verdicts(problem: Problem, order: tuple[str, ...] = ()) -> dict[str, str | None]:
    """Each backend's refusal of `problem`: those in `order` until one can run it (the rest are not probed), else
    every backend (an error lists them all). Probing imports a backend, and importing the cuda backend builds its
    extension when it is not built (a minute): `auto` passes over a backend whose `auto()` gives a reason before
    probing it, so which backend a layer gets never depends on what an earlier call in the process built."""
    verdicts: dict[str, str | None] = {}
    for name in order:
        if name in _BACKENDS:
            verdicts[name] = _BACKENDS[name].auto() or _BACKENDS[name].refuses(problem)
            if verdicts[name] is None:
                return verdicts
    return {**verdicts, **{n: b.refuses(problem) for n, b in _BACKENDS.items() if n not in verdicts}}


def ops(name: str) -> ModuleType:
    """The op namespace of one backend: the per-call override tests and benchmarks use."""
    return _BACKENDS[_check_name(name)].ops


def track(layer: Any) -> None:
    _layers.add(layer)


def set_backend(name: str) -> None:
    """Choose the backend for every layer: "auto" | "triton" | "cuda" | "triton+cuda" | "torch". Live layers
    reselect now."""
    global _preference
    name = _check_name(name)
    previous = _preference
    _preference = name
    try:
        for layer in list(_layers):
            layer.select_backend()
    except Exception:
        _preference = previous
        for layer in list(_layers):
            layer.select_backend()
        raise


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Temporarily prefer a backend (tests, benchmarks); restores the previous preference."""
    global _preference
    previous = _preference
    set_backend(name)
    try:
        yield
    finally:
        _preference = previous
        for layer in list(_layers):
            layer.select_backend()
