"""The hot path (fdlora.layers.fastpath.hot): a repeated eager call runs what the full decision chose last time, and every
change the decision depends on sends the call through it again (outputs against the float64 oracle)."""

from __future__ import annotations

import pytest
import torch
from support.tiny_sequential import PATHS, close, lora, net, oracle
from torch import nn

import fdlora
from fdlora.layers.fastpath import hot


@pytest.fixture
def cache():
    fdlora.set_merge_cache(1 << 30)
    yield
    fdlora.set_merge_cache("auto")


def kept(model, x, path="0"):
    """The callable layer `path` would run straight away for input x (None: the full decision runs)."""
    return hot.get(fdlora.handle(model).layers[path], x)


def injected():
    """(model, its handle with 4 slots, adapters a and b not loaded yet, an input)."""
    model = net()
    return model, fdlora.inject(model, PATHS, max_slots=4, max_rank=8), lora(1), lora(2), torch.randn(5, 32)


def test_repeated_calls_take_it_and_every_state_change_leaves_it(cache):
    model, h, a, b, x = injected()
    with torch.no_grad():
        h.add_adapter(a, "a")
        assert kept(model, x) is None
        close(model(x), oracle(model, x, {"a": (a, 1.0)}))
        assert kept(model, x) is not None
        close(model(x), oracle(model, x, {"a": (a, 1.0)}))  # through the hot path
        for change, want, stays in [
            (lambda: h.set_adapters(["a"], [0.4]), {"a": (a, 0.4)}, False),  # a slider move
            # a load into a slot the blend does not weigh (a prefetch's publication): the merged copy still holds
            (lambda: h.add_adapter(b, "b", activate=False), {"a": (a, 0.4)}, True),
            (lambda: h.set_adapters(["a", "b"], [0.5, -1.0]), {"a": (a, 0.5), "b": (b, -1.0)}, False),
            (lambda: h.disable(), {}, False),
            (lambda: h.enable(), {"a": (a, 0.5), "b": (b, -1.0)}, False),
            (lambda: h.delete_adapter("b"), {"a": (a, 0.5)}, False),
        ]:
            change()
            assert (kept(model, x) is not None) == stays
            close(model(x), oracle(model, x, want))
            close(model(x), oracle(model, x, want))
        with h.per_sample(["a", None, "a", None, "a"]):
            assert kept(model, x) is None
            y = model(x)
        close(y[::2], oracle(model, x[::2], {"a": (a, 1.0)}))
        close(y[1::2], oracle(model, x[1::2], {}))
        close(model(x), oracle(model, x, {"a": (a, 0.5)}))


def test_input_weight_and_hook_changes_leave_it(cache):
    model = net()
    h = fdlora.inject(model, PATHS, max_slots=2, max_rank=4)
    a = lora(1)
    h.add_adapter(a, "a")
    x = torch.randn(5, 32)
    base = h.layers["0"].base
    with torch.no_grad():
        model(x)
        assert kept(model, x) is not None
        assert kept(model, x.double()) is None  # another dtype
        assert kept(model, x[:3]) is not None  # F.linear on the merged weight holds for any row count
        close(model(x[:3]), oracle(model, x[:3], {"a": (a, 1.0)}))
        close(model(x[None]), oracle(model, x, {"a": (a, 1.0)})[None])

        base.weight.mul_(0.5)  # in place: the version counter
        assert kept(model, x) is None
        close(model(x), oracle(model, x, {"a": (a, 1.0)}))
        base.weight = nn.Parameter(torch.randn_like(base.weight))  # a new weight object under the layer
        assert kept(model, x) is None
        close(model(x), oracle(model, x, {"a": (a, 1.0)}))
        model(x)
        assert kept(model, x) is not None
        base._hf_hook = object()  # an offload hook arrived (accelerate)
        assert kept(model, x) is None
        del base._hf_hook
        assert kept(model, x) is not None
        fdlora.set_merge_cache(0)  # the copy is released: the hot entry goes with it
        assert h.layers["0"].merged.hot is None
        close(model(x), oracle(model, x, {"a": (a, 1.0)}))
    fdlora.set_merge_cache(1 << 30)
    with torch.no_grad():
        model(x)
    xg = x.clone().requires_grad_(True)
    assert kept(model, xg) is None  # autograd through the call: the full decision (reference path)
    y = model(xg)
    y.sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    close(y.detach(), oracle(model, x, {"a": (a, 1.0)}))


def test_a_state_write_replaces_the_token():
    model = net()
    st = fdlora.inject(model, PATHS, max_slots=2, max_rank=4).state
    for write in (lambda: setattr(st, "static", st.static), lambda: st.table.flush(), lambda: st.touch(),
                  lambda: st.set_row_slot(torch.zeros(3, dtype=torch.int32)),
                  lambda: st.set_row_slot(torch.zeros(4, dtype=torch.int32))):
        token = st.table.token
        write()
        assert st.table.token is not token


def test_a_per_call_spec_repeated_every_step_keeps_its_token_and_another_does_not(cache):
    """adapter_names / fdlora.per_sample enter and leave per-sample mode on every call: the same spec again gets the
    same token (layers stay hot across decode steps); another spec, or a blend change in between, a new one."""
    model = net()
    h = fdlora.inject(model, PATHS, max_slots=4, max_rank=8)
    a, b = lora(1), lora(2)
    h.add_adapter(a, "a")
    h.add_adapter(b, "b", activate=False)
    x = torch.randn(4, 32)

    def check(y, specs):
        for i, s in enumerate(specs):
            close(y[i:i + 1], oracle(model, x[i:i + 1], {} if s is None else {s: ({"a": a, "b": b}[s], 1.0)}))

    with torch.no_grad():
        specs = ["a", None, "b", "a"]
        with h.per_sample(specs):
            token = h.state.table.token
            check(model(x), specs)
        blend = h.state.table.token
        assert blend is not token
        for _ in range(2):
            with h.per_sample(specs):
                assert h.state.table.token is token
                check(model(x), specs)
            assert h.state.table.token is blend
        other = ["b", None, "b", "a"]
        with h.per_sample(other):
            assert h.state.table.token not in (token, blend)
            check(model(x), other)
        h.set_adapters(["a"], [0.5])
        with h.per_sample(specs):
            assert h.state.table.token is not token
            check(model(x), specs)


@pytest.mark.parametrize("between", ["nothing", "slider", "weight-edit"])
def test_a_load_with_its_writes_made_ahead_rearms_only_entries_that_still_hold(cache, between):
    """A load whose writes (and hot-path check) were made ahead, as a publication in pieces makes them between steps:
    with nothing in between, the blend's entries stay armed, as after a plain load; after a blend move or an in-place
    edit of W between the check and the write, none is re-armed from the stale check (outputs: float64 oracle)."""
    import dataclasses

    from fdlora.steps import drain

    model, h, a, b, x = injected()
    with torch.no_grad():
        h.add_adapter(a, "a")
        model(x)
        assert kept(model, x) is not None
        plan = h.plan(b, "b")
        plan = dataclasses.replace(plan, writes=drain(h.writes_steps(plan, rekey=True)))
        weight = 1.0
        if between == "slider":
            weight = 0.3
            h.set_adapters(["a"], [weight])
        elif between == "weight-edit":
            model[0].weight.mul_(1.5)
        h.commit(plan, activate=False)
        assert (kept(model, x) is not None) == (between == "nothing")
        close(model(x), oracle(model, x, {"a": (a, weight)}))
        assert kept(model, x) is not None
        close(model(x), oracle(model, x, {"a": (a, weight)}))
