"""Adapters from anywhere: the canonical type, formats, Hub resolution and caching."""

from .adapter import LoraAdapter, ModuleLora, Provenance

__all__ = ["LoraAdapter", "ModuleLora", "Provenance"]
