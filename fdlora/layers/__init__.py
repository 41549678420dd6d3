"""Fused LoRA layers, their adapter banks and the undoable module swap."""

from __future__ import annotations

from typing import Any

from .bank import AdapterBank, padded_rank
from .fused import FusedLoraConv2d, FusedLoraLinear
from .state import Mode, ModelState


class _Registry:
    """Model -> its FdLoraHandle, kept on the model instance itself (`_fdlora_handle`), so that a
    deep copy of an injected model (or of a pipeline) carries its own copied handle along."""

    KEY = "_fdlora_handle"

    def get(self, model: Any, default: Any = None) -> Any:
        h = getattr(model, "__dict__", {}).get(self.KEY)
        return h if h is not None and h.model is model else default

    def __getitem__(self, model: Any) -> Any:
        h = self.get(model)
        if h is None:
            raise KeyError(model)
        return h

    def __contains__(self, model: Any) -> bool:
        return self.get(model) is not None

    def __setitem__(self, model: Any, handle: Any) -> None:
        model.__dict__[self.KEY] = handle

    def pop(self, model: Any, default: Any = None) -> Any:
        h = self.get(model, default)
        getattr(model, "__dict__", {}).pop(self.KEY, None)
        return h


registry_of_models = _Registry()

from .handle import FdLoraHandle  # noqa: E402
from .targets import match_targets  # noqa: E402

__all__ = ["AdapterBank", "FdLoraHandle", "FusedLoraConv2d", "FusedLoraLinear", "Mode", "ModelState",
           "match_targets", "padded_rank", "registry_of_models"]
