"""Concurrent calls on one fd-lora Transformers model: each gets exactly its own adapters (issue 28).

The per-sample rows of a call live in the model's state, so the model serializes its calls
(fdlora.runtime.scope.lock_of). Every threaded output here is compared with the same call run
alone, bit for bit; a thread loading and deleting an unrelated adapter runs meanwhile, and a call
naming an adapter deleted under it raises UnknownAdapterError instead of computing anything.
"""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from integrations.transformers.models import built, ids
from support.threads import run_threads

import fdlora
from fdlora.errors import UnknownAdapterError

NAMES = ["one", "two", "__base__"]


@pytest.fixture(scope="module")
def model():
    b = built("llama")
    m = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    fdlora.load_fd_lora(m, b.dirs["two"], "two")
    m.generation_config.pad_token_id = 0
    return m


def _churn(model, stop: threading.Event, counts: list[int]):
    """Load and delete an adapter no request names, while the requests run."""
    d = built("llama").dirs["two"]

    def run():
        while not stop.is_set():
            model.load_adapter(d, "churn")
            model.delete_adapter("churn")
            counts[0] += 1
    return run


def test_concurrent_forward_and_generate_never_bleed(model, figures):
    rng = random.Random(0)
    forwards = [[(ids(3, 5, seed=rng.randrange(1000)), [rng.choice(NAMES) for _ in range(3)]) for _ in range(25)]
                for _ in range(4)]
    generates = [[(ids(2, 4, seed=rng.randrange(1000)), [rng.choice(NAMES) for _ in range(2)]) for _ in range(5)]
                 for _ in range(2)]
    gen_kw = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():  # the same calls, alone
        want_f = [[model(x, adapter_names=n).logits for x, n in calls] for calls in forwards]
        want_g = [[model.generate(x, adapter_names=n, **gen_kw) for x, n in calls] for calls in generates]
    got_f = [[None] * 25 for _ in forwards]
    got_g = [[None] * 5 for _ in generates]

    def forward_thread(t):
        def run():
            with torch.no_grad():
                for i, (x, n) in enumerate(forwards[t]):
                    got_f[t][i] = model(x, adapter_names=n).logits
        return run

    def generate_thread(t):
        def run():
            with torch.no_grad():
                for i, (x, n) in enumerate(generates[t]):
                    got_g[t][i] = model.generate(x, adapter_names=n, **gen_kw)
        return run

    stop, churned = threading.Event(), [0]
    churn = threading.Thread(target=_churn(model, stop, churned))
    churn.start()
    try:
        run_threads([forward_thread(t) for t in range(4)] + [generate_thread(t) for t in range(2)])
    finally:
        stop.set()
        churn.join(timeout=60)
    bleed = [(t, i) for t in range(4) for i in range(25) if not torch.equal(got_f[t][i], want_f[t][i])]
    bleed += [("gen", t, i) for t in range(2) for i in range(5) if not torch.equal(got_g[t][i], want_g[t][i])]
    figures["concurrent_requests"] = 4 * 25 + 2 * 5
    figures["bleed"] = len(bleed)
    assert not bleed, f"{len(bleed)} calls got another call's adapters: {bleed[:5]}"
    assert sorted(fdlora.handle(model).list_adapters()) == ["one", "two"]


def test_request_naming_a_deleted_adapter_fails_clearly(model):
    d = built("llama").dirs["two"]
    model.load_adapter(d, "doomed")
    x = ids(2, 5, seed=3)
    deleted, outcome = threading.Event(), []

    def deleter():
        model.delete_adapter("doomed")
        deleted.set()

    def request():
        deleted.wait(30)
        try:
            with torch.no_grad():
                outcome.append(model(x, adapter_names=["doomed", "one"]).logits)
        except UnknownAdapterError as e:
            outcome.append(e)

    run_threads([deleter, request])
    assert isinstance(outcome[0], UnknownAdapterError), f"got an output instead of an error: {outcome[0]!r}"
    assert "doomed" in str(outcome[0])


def test_delete_waits_for_a_generate_in_flight(model):
    """A delete issued while a generate uses the adapter waits for it; the generate's tokens are its own."""
    d = built("llama").dirs["two"]
    model.load_adapter(d, "late")
    x = ids(2, 4, seed=5)
    kw = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        want = model.generate(x, adapter_names=["late", "one"], **kw)
    started, out = threading.Event(), []

    def gen():
        with torch.no_grad():
            out.append(model.generate(x, adapter_names=["late", "one"], **kw))

    def delete():
        started.wait(30)
        model.delete_adapter("late")

    handle = model.register_forward_pre_hook(lambda *_: started.set())  # runs inside the locked call
    try:
        run_threads([gen, delete])
    finally:
        handle.remove()
    assert torch.equal(out[0], want)
    assert "late" not in fdlora.handle(model).list_adapters()
