"""LoRA ops and the backends that run them (torch reference, Triton, CUDA)."""

from . import backends as _backends  # noqa: F401  (registers the built-in backends)
from .registry import Backend, Capability, Problem, Selection, backends, ops, select, set_backend, use_backend

__all__ = ["Backend", "Capability", "Problem", "Selection", "backends", "ops", "select", "set_backend", "use_backend"]
