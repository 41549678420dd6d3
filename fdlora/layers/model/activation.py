"""Which adapters act, and how strongly: blend weights, per-sample and per-row scopes, enable / disable.

The methods are FdLoraHandle's (fdlora.layers.model.handle), which mixes `Activation` in. Switching writes the
model's scale table in place (a device tensor): no shapes change, nothing recompiles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from fdlora.errors import FdLoraError
from fdlora.layers.state import Mode, lasting

SampleSpec = str | None | Mapping[str, float]
Weight = float | Callable[[str], float] | None


class Activation:
    """FdLoraHandle's switching: set_adapters, the multiplier, per-sample and per-row scopes."""

    def set_adapters(self, names: str | Sequence[str], weights: Weight | Sequence[Weight] | None = None) -> None:
        """Activate `names` with `weights` (default 1.0 each); every other adapter goes inactive.

        A weight is a number, or a function of the layer path returning one (block-wise weights).
        Numbers cost one small table write whatever the model size; functions are evaluated once per
        layer here, never in forward.
        """
        names = [names] if isinstance(names, str) else list(names)
        if weights is None or isinstance(weights, (int, float)) or callable(weights):
            weights = [1.0 if weights is None else weights] * len(names)
        weights = list(weights)
        if len(weights) != len(names):
            raise FdLoraError(f"{len(names)} adapter names but {len(weights)} weights; give one weight per name.")
        for n in names:
            self.state.slots.slot(n)
        self.state.active = {n: 1.0 if w is None else w if callable(w) else float(w)
                             for n, w in zip(names, weights)}
        self._write_weights()

    def _write_weights(self) -> None:
        st = self.state
        per_layer = any(callable(x) for x in st.active.values())
        with lasting():
            w = torch.zeros(len(self.layers), st.slots.capacity) if per_layer else torch.zeros(st.slots.capacity)
        for n, x in st.active.items():
            slot = st.slots.by_name[n]
            if callable(x):
                w[:, slot] = torch.tensor([float(x(layer.path)) for layer in self.layers.values()])
            else:
                w[..., slot] = x
        st.table.weights = w
        st.table.flush()

    def set_multiplier(self, multiplier: float) -> None:
        """Scale every adapter by `multiplier` (diffusers' per-call `scale`): one table write."""
        self.state.table.multiplier = float(multiplier)
        self.state.table.flush()

    def active_adapters(self) -> list[str]:
        return list(self.state.active) if self.state.enabled else []

    def list_adapters(self) -> list[str]:
        return list(self.state.slots.by_name)

    def disable(self) -> None:
        self.state.enabled = False
        self.state.mode = Mode.OFF

    def enable(self) -> None:
        self.state.enabled = True
        self.state.mode = Mode.BLEND

    def sample_weights(self, adapters: Sequence[SampleSpec]) -> torch.Tensor:
        """[G, S] weights for per-sample specs (a name, None / "__base__", or {name: weight} each).
        Built as one host list (a decode step calls this once per token)."""
        slot, S = self.state.slots.slot, self.state.slots.capacity
        rows = []
        for spec in adapters:
            row = [0.0] * S
            if not (spec is None or spec == "__base__"):
                for n, w in ({spec: 1.0} if isinstance(spec, str) else spec).items():
                    row[slot(n)] = float(w)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.float32).view(len(rows), S)

    @contextlib.contextmanager
    def per_sample(self, adapters: Sequence[SampleSpec] | Mapping[int, Sequence[SampleSpec]]) -> Iterator[None]:
        """Within the block, sample i of a batch uses `adapters[i]`: a name, None, or {name: weight}.

        A mapping {batch size: specs} serves several batch sizes in one call (a pipeline's text
        encoders see the prompts, its denoiser the CFG-doubled, per-image-repeated batch).
        """
        by_batch = adapters if isinstance(adapters, Mapping) else {len(adapters): adapters}
        weights = {b: self.sample_weights(specs) for b, specs in by_batch.items()}
        with self._mode(Mode.SAMPLES):
            self.state.set_sample_weights(weights)
            yield

    @contextlib.contextmanager
    def per_row(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within the block, row m of every [M, K] input uses `adapters[m]` (None / "__base__": no adapter)."""
        slots = [-1 if a is None or a == "__base__" else self.state.slots.slot(a) for a in adapters]
        with self._mode(Mode.ROWS):
            self.state.set_row_slot(torch.tensor(slots, dtype=torch.int32))
            yield

    @contextlib.contextmanager
    def _mode(self, mode: Mode) -> Iterator[None]:
        previous = self.state.mode
        self.state.mode = mode if self.state.enabled else Mode.OFF
        try:
            yield
        finally:
            self.state.mode = previous
