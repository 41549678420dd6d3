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


@pytest.mark.parametrize("dispatch", ["auto", "cublas"])
def test_eager_calls_before_compiling_leave_no_guards(dispatch, monkeypatch):
    """A model run eagerly first (its layers keep a hot-path entry and a record of the path each took) compiles to a
    graph that guards on neither: switching adapters afterwards never recompiles, and the outputs are the eager
    ones."""
    monkeypatch.setenv("FDLORA_DISPATCH", dispatch)
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    h = fdlora.inject(model, ["0", "2"], max_slots=3)
    h.add_adapter(adapter(0), "a")
    h.add_adapter(adapter(1), "b")
    x = torch.randn(5, 16)
    cases = (("a", 1.0), ("b", 0.5), (["a", "b"], [0.3, 0.7]), ([], []))
    with torch.no_grad():
        eager = []
        for names, w in cases:
            h.set_adapters(names, w)
            eager.append(model(x))
            model(x)  # a repeat: the hot path
        h.freeze()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        try:
            with torch._dynamo.config.patch(error_on_recompile=True):
                for (names, w), want in zip(cases, eager):
                    h.set_adapters(names, w)
                    torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)
        finally:
            torch._dynamo.reset()
