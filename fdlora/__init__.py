"""fd-lora: dynamic LoRA at merged speed. Public API only."""

from ._moved import install as _install_moved
from ._moved import moved_attribute as _moved_attribute
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
from .pipelines.diffusers import from_diffusers
from .pipelines.diffusers.hook import install as _install_diffusers_hook
from .pipelines.scope import adapters
from .pipelines.transformers import FdLoraModel, from_peft, load_fd_lora, merge_and_unload, save_peft
from .training import add_trainable_adapter, lora_parameters, trainable_parameters

_install_diffusers_hook()
_install_moved()

__version__ = "0.1.0"

_HUB = ("load_adapters", "LoadReport", "AdapterPool", "AdapterCache")


def __getattr__(name: str):
    """Hub entry points, imported on first use so `import fdlora` stays cheap; moved modules by their old name."""
    if name in _HUB:
        from . import hub

        return getattr(hub, name)
    if name == "plan":  # the planner imports diffusers/transformers only when a plan is made
        from .plan import plan

        return plan
    return _moved_attribute(__name__, name)

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
    "add_trainable_adapter",
    "delete_adapter",
    "disable",
    "enable",
    "from_config",
    "from_diffusers",
    "from_peft",
    "handle",
    "inject",
    "load_fd_lora",
    "lora_parameters",
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
    "trainable_parameters",
    "use_backend",
]
