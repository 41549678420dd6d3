"""Model -> its FdLoraHandle (kept on the model instance, so deep copies carry their own handle)."""

from __future__ import annotations

from typing import Any


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
        handle.held_by_model(True)  # the handle holds its model weakly from now on: no reference cycle

    def pop(self, model: Any, default: Any = None) -> Any:
        h = self.get(model, default)
        gone = getattr(model, "__dict__", {}).pop(self.KEY, None)
        if gone is not None and getattr(gone, "model", None) is model:
            gone.held_by_model(False)
        return h


registry_of_models = _Registry()
