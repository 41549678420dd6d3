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
from .config import from_config
from .errors import FdLoraError
from .hub.adapter import LoraAdapter, ModuleLora, Provenance
from .kernels import set_backend, use_backend
from .layers import FdLoraHandle, FusedLoraConv2d, FusedLoraLinear
from .layers.merged import merge_cache_bytes, set_merge_cache
from .pipelines.attach import install as _install_diffusers_hook
from .pipelines.peft_convert import from_diffusers, from_peft
from .pipelines.save import merge_and_unload, save_peft
from .pipelines.scope import adapters
from .pipelines.transformers import FdLoraModel, load_fd_lora

_install_diffusers_hook()

__version__ = "0.1.0"

_HUB = ("load_adapters", "LoadReport", "AdapterPool", "AdapterCache")


def __getattr__(name: str):
    """Hub entry points, imported on first use so `import fdlora` stays cheap."""
    if name in _HUB:
        from . import hub

        return getattr(hub, name)
    if name == "plan":  # the planner imports diffusers/transformers only when a plan is made
        from .plan import plan

        return plan
    raise AttributeError(f"module 'fdlora' has no attribute {name!r}")

__all__ = [
    "AdapterCache",
    "AdapterPool",
    "LoadReport",
    "load_adapters",
    "FdLoraError",
    "FdLoraHandle",
    "FdLoraModel",
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
    "from_config",
    "from_diffusers",
    "from_peft",
    "handle",
    "inject",
    "load_fd_lora",
    "merge_and_unload",
    "merge_cache_bytes",
    "per_row",
    "per_sample",
    "plan",
    "restore",
    "save_peft",
    "set_adapters",
    "set_backend",
    "set_merge_cache",
    "use_backend",
]
