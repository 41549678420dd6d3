"""Make fused layers look like the Linear they wrap to model code that inspects it.

Transformers code reads attributes of its linears directly (T5's feed-forward checks
`self.wo.weight.dtype` on every call; PEFT's LoraLayer forwards `.weight` for the same reason).
A fused layer keeps its base module as `.base`; this gives it the base's `weight` / `bias` objects as
plain attributes (not registered again, so state_dict and parameters() are unchanged).
TODO(issue 7): a `weight` / `bias` property on fdlora.layers.fused._FusedLora makes this unnecessary.
"""

from __future__ import annotations

import torch

from ..layers import FdLoraHandle


def expose_base_params(handle: FdLoraHandle) -> None:
    for layer in handle.layers.values():
        for name in ("weight", "bias"):
            value = getattr(layer.base, name, None)
            if isinstance(value, torch.Tensor) and name not in type(layer).__dict__:
                object.__setattr__(layer, name, value)
