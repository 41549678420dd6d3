"""fd-lora: dynamic LoRA at merged speed. Public API only."""

from fdlora import quiet as _quiet  # noqa: F401,I001  (first: known third-party warnings off stderr; FDLORA_VERBOSE=1)
from fdlora.integrations.diffusers.hook import install as _install_diffusers_hook
from fdlora.layers.fastpath.captured import capture_steps, release_steps
from fdlora.layers.fastpath.merged import merge_cache_bytes, set_merge_cache
from fdlora.runtime.scope import adapters

from .api import (
    active_adapters,
    add_adapter,
    delete_adapter,
    disable,
    dispatch_counts,
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

_install_diffusers_hook()

__version__ = "0.1.0"

_HUB = ("load_adapters", "LoadReport", "AdapterPool", "AdapterCache")
# integration entry points (fdlora.integrations), imported on first use: the core install has no diffusers /
# transformers / peft, and a call that needs one raises MissingExtraError naming `pip install fd-lora[extra]`
# name -> (module under fdlora, the extra it needs); load_fd_lora takes diffusers models itself and hands every
# other model to the Transformers loader; training reads peft.LoraConfig
_PIPELINES = {"from_diffusers": (".integrations.diffusers", "diffusers"),
              "FdLoraModel": (".integrations.transformers", "transformers"),
              "from_peft": (".integrations.transformers", "transformers"),
              "load_fd_lora": (".integrations.diffusers.model", "transformers"),
              "merge_and_unload": (".integrations.transformers", "transformers"),
              "save_peft": (".integrations.transformers", "transformers"),
              "add_trainable_adapter": (".training", "transformers"),
              "lora_parameters": (".training", "transformers"),
              "trainable_parameters": (".training", "transformers"),
              "prefetch": (".integrations.prefetch", None),
              "warmup": (".integrations.warmup", None)}


def __getattr__(name: str):
    """Hub and integration entry points, imported on first use so `import fdlora` stays cheap (and works with
    the core install alone)."""
    if name in _HUB:
        from . import hub
        from .extras import needs_extras

        obj = getattr(hub, name)
        return obj if isinstance(obj, type) else needs_extras(obj)  # a kohya file without diffusers: one line
    if name in _PIPELINES:
        import importlib

        from .extras import needs_extras

        module, extra = _PIPELINES[name]
        obj = getattr(importlib.import_module(module, __name__), name)  # needs an optional extra
        obj = obj if isinstance(obj, type) else needs_extras(obj, extra)
        globals()[name] = obj
        return obj
    if name == "plan":  # the planner imports diffusers/transformers only when a plan is made
        from .plan import plan

        return plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
    "capture_steps",
    "delete_adapter",
    "disable",
    "dispatch_counts",
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
    "prefetch",
    "release_steps",
    "restore",
    "save_peft",
    "set_adapters",
    "set_backend",
    "set_merge_cache",
    "trainable_parameters",
    "use_backend",
    "warmup",
]
