"""Switching adapters, weights, and loading into a free slot never recompiles a frozen model."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

import fdlora
from fdlora.hub.adapter import LoraAdapter, ModuleLora


def adapter(seed):
    g = torch.Generator().manual_seed(seed)
    return LoraAdapter({p: ModuleLora(torch.randn(4, 16, generator=g), torch.randn(16, 4, generator=g) * 0.1)
                        for p in ("0", "2")})


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_switching_never_recompiles(backend):
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    h = fdlora.inject(model, ["0", "2"], max_slots=3)
    h.add_adapter(adapter(0), "a")
    h.freeze()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(5, 16)
    expected = []
    with torch.no_grad():
        compiled(x)
        old = torch._dynamo.config.error_on_recompile
        torch._dynamo.config.error_on_recompile = True
        try:
            steps = [
                lambda: h.set_adapters("a", 0.3),
                lambda: h.add_adapter(adapter(1), "b"),  # a new adapter into a free slot
                lambda: h.set_adapters(["a", "b"], [0.5, 1.5]),
                lambda: h.set_adapters([], []),
                lambda: h.delete_adapter("a"),
                lambda: h.set_multiplier(0.5),
            ]
            for step in steps:
                step()
                got = compiled(x)
                ref = model(x)
                expected.append(torch.allclose(got, ref, atol=1e-6))
        finally:
            torch._dynamo.config.error_on_recompile = old
    assert all(expected)
