"""Adapters from anywhere: the canonical type, formats, Hub resolution, the RAM cache and GPU slot pools.

    adapters, report = fdlora.hub.load_adapters("user/pixel-style")     # {component: LoraAdapter}, report
    pool = fdlora.hub.AdapterPool(handle)                                # more adapters than GPU slots
    pool.add("pixel", adapters["unet"]); pool.set_adapters(["pixel"])

Everything but the adapter types is imported on first use, so `import fdlora` stays cheap
(huggingface_hub and diffusers load only when a source is resolved or converted).
"""

from __future__ import annotations

import importlib

from .adapter import LoraAdapter, ModuleLora, Provenance

_LAZY = {
    "load_adapters": "load", "load_many": "load",
    "LoadReport": "report", "GroupStats": "report",
    "AdapterCache": "cache", "CacheKey": "cache", "default_cache": "cache", "pack_adapters": "cache",
    "to_device": "cache",
    "AdapterPool": "pool", "add_to_pools": "pool", "align_paths": "pool",
    "WEIGHT_RULE": "resolve",  # the submodule fdlora.hub.resolve has resolve() and fetch()
}

__all__ = ["LoraAdapter", "ModuleLora", "Provenance", *_LAZY]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fdlora.hub' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)  # huggingface_hub on use
    globals()[name] = value
    return value
