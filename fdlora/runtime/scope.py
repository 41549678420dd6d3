"""Request scope: adapters for one call, and calls that never see each other's adapters.

fd-lora's adapter state lives in the model (banks and scale tables), like the weights. A pipeline
therefore serialises the calls that touch it: every generation, `set_adapters` and
`fdlora.adapters(...)` block holds the pipeline's re-entrant lock, so two threads generating with
different adapters run one after the other, each with exactly its own adapters. (Generations on one
GPU queue up anyway; what this buys is that they cannot bleed into each other.)

Transformers models served by fd-lora do the same with a lock of their own (`lock_of(model)`): every
forward / generate of an `FdLoraModel` (with or without `adapter_names`) and every load, delete and
switch holds it, because the per-sample weights and row slots of one call live in the model's shared
state (fdlora.layers.state.ModelState). Calls are correct under threads but serialized; running them
truly concurrently needs per-call state in the layers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fdlora.layers.state import CopyableLock

_CREATE = threading.Lock()


def lock_of(obj: Any) -> CopyableLock:
    """The re-entrant lock serializing fd-lora calls on `obj` (a pipeline or a model), created on first use."""
    lock = obj.__dict__.get("_fdlora_lock")
    if lock is None:
        with _CREATE:
            lock = obj.__dict__.setdefault("_fdlora_lock", CopyableLock())
    return lock


pipe_lock = lock_of


@contextlib.contextmanager
def adapters(pipe: Any, spec: str | Sequence[str] | Mapping[str, float]) -> Iterator[None]:
    """Within the block (and this thread), `pipe` uses `spec`: a name, a list of names, or {name: weight}.

    The previous active set and weights come back on exit, also on error.
    """
    if isinstance(spec, str):
        spec = {spec: 1.0}
    elif not isinstance(spec, Mapping):
        spec = dict.fromkeys(spec, 1.0)
    with pipe_lock(pipe):
        handles = pipe.fd_lora_handles()
        saved = {c: (dict(h.state.active), h.state.enabled) for c, h in handles.items()}
        try:
            pipe.set_adapters(list(spec), list(spec.values()))
            yield
        finally:
            for c, h in handles.items():
                active, enabled = saved[c]
                h.set_adapters(list(active), list(active.values()))
                h.enable() if enabled else h.disable()
