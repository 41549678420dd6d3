"""Per-row and per-sample adapters through routed experts made of ordinary modules (Switch-Transformers).

Switch-Transformers keeps each expert as its own module (nn.Linear wi / wo inside a ModuleDict) and
calls expert e on the tokens routed to it, gathered out of the batch: the rows a fused Linear sees
there are no longer batch-major, so the per-row slots / per-sample weights of the call cannot apply
by position. `RoutedExperts` replaces the experts container with the same loop as transformers' own
forward, run with each expert's token indices known: the token rows' slot weights
(`ModelState.token_weights`) are gathered with the tokens and the expert runs inside
`ModelState.gathered`, where every fused layer sees one sample per row. Blend mode is row-independent
and runs the container as it is.

The wrapper shares the container's children (same `_modules` dict), so every module path stays the
same and the fused layers inside are swapped in and out as usual; fdlora.layers.model.moe_targets puts it in when
fused layers arrive inside a served container and takes it out on restore. Which containers are
served is data (`FORWARDS`: class name -> the loop).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fdlora.layers.state import Mode, ModelState


def _switch(wrapper: RoutedExperts, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
            routing_weights: torch.Tensor) -> torch.Tensor:
    """transformers 5's SwitchTransformersExperts.forward, each expert called inside its tokens' row weights."""
    rows = wrapper.state.token_weights(hidden_states.shape[0], hidden_states.device)
    final = torch.zeros_like(hidden_states)
    expert_mask = selected_experts.permute(2, 1, 0)
    for expert_idx in torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero():
        idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
        current = hidden_states[None, top_x].reshape(-1, hidden_states.shape[-1])
        with wrapper.state.gathered(None if rows is None else rows[top_x]):
            out = wrapper[f"expert_{expert_idx[0]}"](current) * routing_weights[top_x, idx, None]
        final.index_add_(0, top_x, out.to(hidden_states.dtype))
    return final


FORWARDS: dict[str, Callable[..., torch.Tensor]] = {"SwitchTransformersExperts": _switch}


class RoutedExperts(nn.ModuleDict):
    """A routed-experts container whose experts see their tokens' adapters (see the module docstring)."""

    def __init__(self, original: nn.Module, state: ModelState) -> None:
        super().__init__()
        self.__dict__["_modules"] = original._modules  # the same children: module paths do not change
        object.__setattr__(self, "original", original)
        object.__setattr__(self, "state", state)
        self.num_experts = getattr(original, "num_experts", len(original._modules))

    def forward(self, *args, **kwargs) -> torch.Tensor:
        if self.state.mode not in (Mode.ROWS, Mode.SAMPLES):
            return self.original(*args, **kwargs)
        return FORWARDS[type(self.original).__name__](self, *args, **kwargs)
