"""AdapterPool loads from a device copy made beforehand (what a prefetch or a CUDA load hands it), run here on CPU.

Oracle: the same adapter added to the same model by `fdlora.add_adapter` (banks and outputs equal exactly). Until the
bulk bank writer is marked built (fdlora.hub.pool.mark_bulk_ready, which fdlora.integrations.warmup does) the banks
are written by torch copies from views of the device copy, never by the kernel; after, by it. Either way a corrupt
alpha is refused with the adapter's name (the tensors were checked on the device; the scales still are).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fdlora
from fdlora.errors import NonFiniteError
from fdlora.hub import AdapterPool, LoraAdapter, ModuleLora, pack_adapters
from fdlora.hub import pool as pool_module
from fdlora.hub.cache import stage
from fdlora.layers import FdLoraHandle
from fdlora.layers.model import loading as loading_module

PATHS = ("a", "b", "c")


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({p: nn.Linear(12, 20) for p in PATHS})


def adapter(alpha: float | None = None, seed: int = 0) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    return LoraAdapter({p: ModuleLora(torch.randn(3, 12, generator=g), torch.randn(20, 3, generator=g), alpha)
                        for p in PATHS})


def served(model: nn.Module) -> FdLoraHandle:
    return fdlora.inject(model, list(PATHS), max_slots=2, max_rank=16)


def banks(model: nn.Module) -> dict:
    h = fdlora.handle(model)
    return {p: (l.bank.A.clone(), l.bank.B.clone(), l.bank.ranks.clone()) for p, l in h.layers.items()}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Calls of the bulk writer; nothing marked built to start with."""
    monkeypatch.setattr(pool_module, "_bulk_ready", set())
    calls = []
    prepare = loading_module.prepare  # (the writes from a device copy: fdlora.layers.storage.bulk)
    monkeypatch.setattr(loading_module, "prepare", lambda *a: (calls.append(a), prepare(*a))[1])
    return calls


@pytest.mark.parametrize("built", [False, True], ids=["torch-copies", "bulk-writer"])
def test_a_load_from_a_device_copy_equals_add_adapter(kernel_calls, built):
    want, model = net(), net()
    keep = served(want), served(model)  # (a pool holds its handle weakly)
    fdlora.add_adapter(want, adapter(alpha=6.0), "x")
    pool = AdapterPool.of(keep[1])
    if built:
        pool_module.mark_bulk_ready("cpu", torch.float32)
    host = pack_adapters({"": adapter(alpha=6.0)}, pin=False)[""]
    staged = stage(host, "cpu", check_finite=True)
    pool.commit(pool.make_room(pool.check("x", host, staged=staged)), activate=True)
    assert len(kernel_calls) == int(built)
    got, ref = banks(model), banks(want)
    assert got.keys() == ref.keys() and all(torch.equal(x, y) for p in got for x, y in zip(got[p], ref[p]))
    x = torch.randn(5, 12)
    assert all(torch.equal(model[p](x), want[p](x)) for p in PATHS)
    assert pool.known() == ["x"]


def test_a_staged_load_still_checks_the_scales(kernel_calls):
    model = net()
    h = served(model)
    pool = AdapterPool.of(h)
    host = pack_adapters({"": adapter(alpha=1e9)}, pin=False)[""]
    staged = stage(host, "cpu", check_finite=True)  # the tensors pass
    # (the name is in the message unless stage's pass over the buffer hit the unset padding of pack_adapters and
    # settled it with the host check, which names no adapter)
    with pytest.raises(NonFiniteError, match=r"a has alpha 1e\+09"):
        pool.check("bad", host, staged=staged)
    assert pool.known() == [] and not fdlora.handle(model).list_adapters()


def test_align_lists_module_names_only_for_clip_text_encoders(monkeypatch):
    """A model without a `text_model` child, given paths without that prefix, is never walked for its names; a
    CLIPTextModelWithProjection-like one gets the prefix added."""
    model = net()
    h = served(model)
    pool = AdapterPool.of(h)
    monkeypatch.setattr(type(model), "named_modules", lambda *a, **k: pytest.fail("walked the model"))
    a = adapter()
    assert pool.align(a) is a
    monkeypatch.undo()
    clip = nn.Module()
    clip.text_model = net()
    h = FdLoraHandle(clip)
    pool = AdapterPool.of(h)
    assert sorted(pool.align(a).modules) == [f"text_model.{p}" for p in PATHS]


@pytest.mark.parametrize("moved", [False, True], ids=["in-place", "bank-moved"])
def test_writes_made_ahead_are_made_again_for_a_bank_that_moved(kernel_calls, monkeypatch, moved):
    """A plan carrying its bank writes (made ahead, as a publication in pieces makes them between steps) launches
    them as made while every bank is where they were made for; after a bank moved (an offload hook reallocating its
    buffers) they are made again, for its new address. The kernel is a recorder here: the table is the check."""
    import dataclasses

    from fdlora.layers.storage import bulk
    from fdlora.steps import drain

    launched = []

    class Recorder:
        @staticmethod
        def scatter(table, src, dst):
            launched.append(table.clone())

    monkeypatch.setattr(bulk, "_scatter", lambda: Recorder)
    monkeypatch.setattr(bulk.env, "triton_interpret", lambda: True)
    model = net()
    h = served(model)
    pool = AdapterPool.of(h)
    pool_module.mark_bulk_ready("cpu", torch.float32)
    host = pack_adapters({"": adapter(alpha=6.0)}, pin=False)[""]
    plan, host = pool.make_room(pool.check("x", host, staged=stage(host, "cpu", check_finite=True)))
    plan = dataclasses.replace(plan, slot=h.state.slots.check_new("x"))
    plan = dataclasses.replace(plan, writes=drain(h.writes_steps(plan)))
    bank = h.layers["b"].bank
    if moved:
        bank._buffers["A"] = bank.A.clone()
    pool.commit((plan, host), activate=True)
    assert len(kernel_calls) == 1 + moved and len(launched) == 1
    a0, a_step = bank.addresses()[:2]
    assert a0 + plan.slot * a_step in launched[0][:, 1].tolist()  # (column 1: where slot `slot` of A starts)
    assert pool.known() == ["x"] and h.list_adapters() == ["x"] and all(h.layers[p].bank.used[plan.slot] for p in PATHS)
