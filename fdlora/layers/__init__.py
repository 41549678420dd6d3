"""Fused LoRA layers, their adapter banks and the undoable module swap."""

from __future__ import annotations

import weakref

from torch import nn

from .bank import AdapterBank, padded_rank
from .fused import FusedLoraConv2d, FusedLoraLinear
from .state import Mode, ModelState

registry_of_models: weakref.WeakKeyDictionary[nn.Module, object] = weakref.WeakKeyDictionary()

from .handle import FdLoraHandle  # noqa: E402
from .targets import match_targets  # noqa: E402

__all__ = ["AdapterBank", "FdLoraHandle", "FusedLoraConv2d", "FusedLoraLinear", "Mode", "ModelState",
           "match_targets", "padded_rank", "registry_of_models"]
