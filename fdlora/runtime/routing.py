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

from fdlora.errors import FdLoraError
from fdlora.layers import registry_of_models
from fdlora.layers.model.activation import SampleSpec
from fdlora.runtime.scope import lock_of
from fdlora.runtime.session import session_of

BATCH_KEYS = ("input_ids", "inputs_embeds", "pixel_values", "input_features", "input_values", "attention_mask")


def batch_size(args: Sequence[object], kwargs: Mapping[str, object]) -> int | None:
    """The batch of a model call: its first tensor argument, or the first of the usual input kwargs."""
    for t in (*args, *(kwargs.get(k) for k in BATCH_KEYS)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


def check_specs(specs: object, kw: str) -> list[SampleSpec]:
    if isinstance(specs, (str, Mapping)) or not isinstance(specs, Sequence):
        raise FdLoraError(f"{kw} must be a list with one entry per sample, got {specs!r}.")
    bad = [s for s in specs if not (s is None or isinstance(s, str) or (
        isinstance(s, Mapping) and all(isinstance(k, str) and isinstance(w, (int, float)) for k, w in s.items())))]
    if bad:
        raise FdLoraError(f"{kw} entries are adapter names, '__base__', None"
                          + (" or {name: weight}" if kw == "fd_lora_adapters" else "") + f"; got {bad[:3]}.")
    if kw == "adapter_names" and any(isinstance(s, Mapping) for s in specs):
        raise FdLoraError("adapter_names entries are names (PEFT); for per-sample blends use fd_lora_adapters=[{...}].")
    return list(specs)


def _owner(spec: SampleSpec) -> str | tuple[str, ...] | None:
    """What SavedModules keys on: one adapter name, None for the base, a tuple for a blend."""
    if spec is None or spec == "__base__":
        return None
    if isinstance(spec, str):
        return spec
    names = tuple(n for n, w in spec.items() if w)
    return names[0] if len(names) == 1 else names or None


@contextlib.contextmanager
def adapter_rows(model: nn.Module, specs: object, args: Sequence[object], kwargs: Mapping[str, object],
                 kw: str = "adapter_names") -> Iterator[None]:
    """Within the block, sample i of `model`'s calls uses specs[i].

    `adapter_names` (PEFT): a name applies at the adapter's current weight if it is active, else 1.0
    (a block-wise weight function counts as 1.0: per-sample weights are per adapter, not per layer).
    `fd_lora_adapters` (fdlora.per_sample): a name applies at 1.0; {name: weight} blends per sample.
    """
    specs = check_specs(specs, kw)
    with lock_of(model):  # the rows live in the model's state: one routed call at a time (see .scope)
        with _routed(model, specs, args, kwargs, kw):
            yield


@contextlib.contextmanager
def _routed(model: nn.Module, specs: list[SampleSpec], args: Sequence[object], kwargs: Mapping[str, object],
            kw: str) -> Iterator[None]:
    h = registry_of_models.get(model)
    if h is None:
        raise FdLoraError(f"{kw} given but {type(model).__name__} has no fd-lora adapters; load one with "
                          "fdlora.load_fd_lora(model, source) first.")
    n = batch_size(args, kwargs)
    if n is not None and n != len(specs):
        raise FdLoraError(f"{len(specs)} {kw} for a batch of {n}; give exactly one entry per sample "
                          "('__base__' for no adapter).")
    if kw == "adapter_names":
        def weight(a):
            w = h.state.active.get(a, 1.0)
            return 1.0 if callable(w) else float(w)

        specs = [None if a is None or a == "__base__" else {a: weight(a)} for a in specs]
    session = session_of(model)
    previous = session.sample_names
    session.sample_names = [_owner(s) for s in specs]
    try:
        with h.per_sample(specs):
            yield
    finally:
        session.sample_names = previous
