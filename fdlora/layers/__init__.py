"""Fused LoRA layers, their adapter banks and the undoable module swap."""

from __future__ import annotations

from fdlora.layers.model.handle import FdLoraHandle
from fdlora.layers.model.targets import match_targets
from fdlora.layers.modules.fused import FusedLoraConv2d, FusedLoraLinear
from fdlora.layers.storage.bank import AdapterBank, padded_rank

from .registry import registry_of_models
from .state import Mode, ModelState

__all__ = ["AdapterBank", "FdLoraHandle", "FusedLoraConv2d", "FusedLoraLinear", "Mode", "ModelState",
           "match_targets", "padded_rank", "registry_of_models"]
