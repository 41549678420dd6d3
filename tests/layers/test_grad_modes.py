"""Every public call works whatever grad mode the earlier calls ran in. Tensors fd-lora keeps and writes in place
later (banks, scale tables, merged copies and their stamps, per-sample weights, row slots, captured steps' inputs) are
normal tensors even when made under torch.inference_mode (fdlora.layers.state.lasting): an inference tensor cannot
be written in place outside inference mode ("Inplace update to inference tensor outside InferenceMode")."""

from __future__ import annotations

import pytest
import torch
from support.tiny_sequential import PATHS, close, lora, net, oracle
from torch.utils import _pytree as pytree

import fdlora
from fdlora.layers.fastpath import captured


@pytest.fixture
def cache():
    fdlora.set_merge_cache(1 << 30)
    yield
    fdlora.set_merge_cache("auto")


class StandIn:
    """CPU stand-in for CUDA graphs (as tests/layers/test_captured.py's): capture records the call, a replay runs it
    again and writes the static outputs in place as a graph does, outside autograd's checks."""

    @staticmethod
    def capturing(t) -> bool:
        return False

    def capture(self, run):
        run()
        out = run()
        return (run, out), out

    def replay(self, graph) -> None:
        run, out = graph
        inference = any(t.is_inference() for t in pytree.tree_leaves(out))
        with torch.inference_mode() if inference else torch.no_grad():
            for dst, src in zip(pytree.tree_leaves(out), pytree.tree_leaves(run())):
                dst.copy_(src)


CASES = [
    pytest.param("eager-cache", id="eager-merged-cache"),
    pytest.param("per-call", id="eager-no-cache"),
    pytest.param("frozen", id="frozen-stamped-cache"),
    pytest.param("captured", id="captured-steps-pinned-copies"),
    pytest.param("loaded-inside", id="injected-and-loaded-under-inference-mode"),
]


@pytest.mark.parametrize("how", CASES)
def test_public_calls_after_calls_under_inference_mode(how, cache):
    model = net()
    x = torch.randn(4, 32)
    a, b, c = lora(1), lora(2, rank=8, alpha=4.0), lora(3)

    def load():
        h = fdlora.inject(model, PATHS, max_slots=4, max_rank=8)
        h.add_adapter(a, "a")
        h.add_adapter(b, "b", activate=False)
        return h

    if how == "per-call":
        fdlora.set_merge_cache(0)
    if how == "loaded-inside":
        with torch.inference_mode():
            h = load()
    else:
        h = load()
    with torch.inference_mode():
        if how == "frozen":
            h.freeze()
        if how == "captured":
            fdlora.capture_steps(model, mechanism=StandIn())
        model(x)
        model(x)
        with h.per_sample(["a", None, "b", "a"]):
            model(x)
        with h.per_row(["a", None, "b", "a"]):
            model(x)
    if how == "captured":  # a real capture pins the copies it wrote (never freed, only marked stale)
        held = [layer.merged for layer in h.layers.values() if layer.merged.buf is not None]
        assert held and all(m.stamp is not None for m in held)
        for m in held:
            m.pinned = True
    with torch.no_grad():
        fdlora.set_merge_cache(1 << 29)
        h.set_adapters(["a", "b"], [0.5, -1.0])
        close(model(x), oracle(model, x, {"a": (a, 0.5), "b": (b, -1.0)}))
        with h.per_sample(["a", None, "b", "a"]):
            y = model(x)
        for i, want in enumerate(({"a": (a, 1.0)}, {}, {"b": (b, 1.0)}, {"a": (a, 1.0)})):
            close(y[i:i + 1], oracle(model, x[i:i + 1], want))
        with h.per_row(["b", "a", None, "b"]):
            y = model(x)
        for i, want in enumerate(({"b": (b, 1.0)}, {"a": (a, 1.0)}, {}, {"b": (b, 1.0)})):
            close(y[i:i + 1], oracle(model, x[i:i + 1], want))
        h.set_multiplier(2.0)
        close(model(x), oracle(model, x, {"a": (a, 1.0), "b": (b, -2.0)}))
        h.set_multiplier(1.0)
        h.delete_adapter("a")
        h.add_adapter(c, "c", activate=False)
        h.set_adapters(["b", "c"], [0.25, 0.75])
        close(model(x), oracle(model, x, {"b": (b, 0.25), "c": (c, 0.75)}))
        if how not in ("frozen", "captured"):
            h.grow(max_slots=6, max_rank=16)
            close(model(x), oracle(model, x, {"b": (b, 0.25), "c": (c, 0.75)}))
    y = model(x)  # grad mode: autograd through the base weights
    assert y.requires_grad
    with torch.no_grad():
        close(y, oracle(model, x, {"b": (b, 0.25), "c": (c, 0.75)}))
    y.sum().backward()
    if how == "captured":
        fdlora.release_steps(model)


def test_inference_mode_inputs_of_captured_steps_are_copied_into_normal_buffers():
    """A captured step's static inputs are copied into by every later call, in any mode."""
    model = net()
    fdlora.inject(model, PATHS, max_slots=2, max_rank=4).add_adapter(lora(1), "a")
    runner = fdlora.capture_steps(model, mechanism=StandIn())
    with torch.inference_mode():
        model(torch.randn(3, 32))
    (_, static, _), = runner.graphs.values()
    assert not any(t.is_inference() for t in static if isinstance(t, torch.Tensor))
    x = torch.randn(3, 32)
    with torch.no_grad():
        close(model(x), oracle(model, x, {"a": (lora(1), 1.0)}))
    fdlora.release_steps(model)
    assert captured.steps_of(model) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_captured_under_inference_mode_then_calls_outside_it(cache):
    """Real CUDA graphs captured and replayed under inference_mode pin their merged copies; set_merge_cache (which
    marks pinned copies stale through their stamps), set_adapters and replays outside it then work."""
    model = net().cuda()
    h = fdlora.inject(model, PATHS, max_slots=4, max_rank=8)
    a, b = lora(1), lora(2, rank=8, alpha=4.0)
    h.add_adapter(a, "a")
    h.add_adapter(b, "b", activate=False)
    x = torch.randn(4, 32, device="cuda")
    runner = fdlora.capture_steps(model)
    try:
        with torch.inference_mode():
            for _ in range(3):
                model(x)
        assert runner.captures == 1 and any(layer.merged.pinned for layer in h.layers.values())
        with torch.no_grad():
            fdlora.set_merge_cache(1 << 29)
            h.set_adapters(["a", "b"], [0.5, -1.0])
            y = model(x)
            close(y.cpu(), oracle(model, x.cpu(), {"a": (a, 0.5), "b": (b, -1.0)}))
        with torch.inference_mode():
            h.set_adapters(["b"], [0.3])
            y = model(x)
        with torch.no_grad():
            close(y.cpu(), oracle(model, x.cpu(), {"b": (b, 0.3)}))
        assert runner.captures == 1
    finally:
        fdlora.release_steps(model)
