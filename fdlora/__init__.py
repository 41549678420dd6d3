"""fd-lora: dynamic LoRA at merged speed. Public API only."""

from .api import (
    active_adapters,
    add_adapter,
    delete_adapter,
    disable,
    enable,
    handle,
    inject,
    per_row,
    per_sample,
    restore,
    set_adapters,
)
from .errors import FdLoraError
from .hub.adapter import LoraAdapter, ModuleLora, Provenance
from .kernels import set_backend, use_backend
from .layers import FdLoraHandle, FusedLoraConv2d, FusedLoraLinear
from .pipelines.attach import install as _install_diffusers_hook
from .pipelines.scope import adapters

_install_diffusers_hook()

__version__ = "0.1.0"

__all__ = [
    "FdLoraError",
    "FdLoraHandle",
    "FusedLoraConv2d",
    "FusedLoraLinear",
    "LoraAdapter",
    "ModuleLora",
    "Provenance",
    "active_adapters",
    "adapters",
    "add_adapter",
    "delete_adapter",
    "disable",
    "enable",
    "handle",
    "inject",
    "per_row",
    "per_sample",
    "restore",
    "set_adapters",
    "set_backend",
    "use_backend",
]
