"""Fused LoRA layers, their adapter banks and the undoable module swap."""

from __future__ import annotations

from .bank import AdapterBank, padded_rank
from .fused import FusedLoraConv2d, FusedLoraLinear
from .handle import FdLoraHandle
from .registry import registry_of_models
from .state import Mode, ModelState
from .targets import match_targets

__all__ = ["AdapterBank", "FdLoraHandle", "FusedLoraConv2d", "FusedLoraLinear", "Mode", "ModelState",
           "match_targets", "padded_rank", "registry_of_models"]
