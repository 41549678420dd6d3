"""What the Transformers/PEFT integration keeps per model, beside the fd-lora handle.

    configs       adapter name -> the LoraConfig it came with (save_peft writes it back unchanged)
    saved         modules_to_save path -> its SavedModules switch (full module copies per adapter)
    sample_names  the per-sample adapter names of the call in flight (adapter_names=...), read by
                  SavedModules; the fused layers get the same rows through handle.per_sample

A session belongs to one handle: when the handle is restored or replaced, the session is stale and
`session_of` starts a new one.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from fdlora.layers import FdLoraHandle, registry_of_models


@dataclass(eq=False)
class Session:
    handle_ref: weakref.ref[FdLoraHandle]  # weak: `_sessions` is keyed weakly by the model, which the handle holds
    configs: dict[str, object] = field(default_factory=dict)
    saved: dict[str, nn.Module] = field(default_factory=dict)
    sample_names: Sequence[str | None] | None = None

    @property
    def handle(self) -> FdLoraHandle:
        return self.handle_ref()

    @property
    def alive(self) -> bool:
        return registry_of_models.get(self.handle.model) is self.handle


_sessions: weakref.WeakKeyDictionary[nn.Module, Session] = weakref.WeakKeyDictionary()


def session_of(model: nn.Module, create: bool = True) -> Session | None:
    """The session of `model`'s current handle (a new one if the handle changed); None without a handle."""
    h = registry_of_models.get(model)
    if h is None:
        return None
    s = _sessions.get(model)
    if s is None or s.handle is not h:
        if not create:
            return None
        s = _sessions[model] = Session(weakref.ref(h))
    return s
