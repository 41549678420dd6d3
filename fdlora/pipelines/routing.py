"""`adapter_names=[...]` (PEFT's mixed batches) onto fd-lora's per-sample mode: no loop over adapters.

Entry i of `adapter_names` is the adapter of sample i ("__base__" or None: no adapter). It becomes
one row of per-sample group weights, and every fused layer groups its [M, K] rows into
len(adapter_names) contiguous blocks, so the same spec serves a prefill ([B*T] rows), a decode step
([B] rows), an lm_head that keeps only the last position, an encoder and a decoder alike.

Generate expands samples in place (`repeat_interleave`: beams, num_return_sequences), which keeps
each sample's copies contiguous, so the spec needs no expansion; a row count that is not a
multiple of the batch raises in the layer. This assumes batch-major activations ([B, T, ...]), as
every Transformers decoder/encoder layout has.

Each named adapter applies at its current blend weight if it is active (fdlora.set_adapters), at
1.0 otherwise: PEFT's "each adapter at its current scaling".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from ..errors import FdLoraError
from ..layers import registry_of_models
from .session import session_of

BATCH_KEYS = ("input_ids", "inputs_embeds", "pixel_values", "input_features", "input_values", "attention_mask")


def batch_size(args: Sequence[object], kwargs: Mapping[str, object]) -> int | None:
    """The batch of a model call: its first tensor argument, or the first of the usual input kwargs."""
    for t in (*args, *(kwargs.get(k) for k in BATCH_KEYS)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def check_names(adapter_names: object) -> list[str | None]:
    if isinstance(adapter_names, str) or not isinstance(adapter_names, Sequence):
        raise FdLoraError(f"adapter_names must be a list with one adapter name per sample, got {adapter_names!r}.")
    bad = [n for n in adapter_names if n is not None and not isinstance(n, str)]
    if bad:
        raise FdLoraError(f"adapter_names entries are adapter names, '__base__' or None; got {bad[:3]}.")
    return list(adapter_names)


@contextlib.contextmanager
def adapter_rows(model: nn.Module, adapter_names: object, args: Sequence[object],
                 kwargs: Mapping[str, object]) -> Iterator[None]:
    """Within the block, sample i of `model`'s calls uses adapter_names[i]."""
    names = check_names(adapter_names)
    h = registry_of_models.get(model)
    if h is None:
        raise FdLoraError(f"adapter_names given but {type(model).__name__} has no fd-lora adapters; load one with "
                          "fdlora.load_fd_lora(model, source) first.")
    n = batch_size(args, kwargs)
    if n is not None and n != len(names):
        raise FdLoraError(f"{len(names)} adapter_names for a batch of {n}; give exactly one name per sample "
                          "('__base__' for no adapter).")
    active = h.state.active
    specs = [None if a is None or a == "__base__" else {a: active.get(a, 1.0)} for a in names]
    session = session_of(model)
    previous = session.sample_names
    session.sample_names = names
    try:
        with h.per_sample(specs):
            yield
    finally:
        session.sample_names = previous
