"""Issue 28, layers side: rank capacity is capped and given back; an interrupted load leaves nothing behind."""

from __future__ import annotations

import pytest
import torch
from support import tiny

import fdlora
from fdlora.errors import CapacityError
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.layers.storage.bank import AdapterBank

Q = "encoder.layers.0.self_attn.q_proj"


def adapter(rank: int, seed: int = 0, paths=(Q,)) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    return LoraAdapter({p: ModuleLora(torch.randn(rank, 32, generator=g) / 6, torch.randn(32, rank, generator=g))
                        for p in paths})


def bank_bytes(h) -> int:
    return sum(layer.bank.A.nbytes + layer.bank.B.nbytes for layer in h.layers.values())


@pytest.fixture
def clip():
    model = tiny.clip_te(seed=3)
    h = fdlora.inject(model, ["q_proj", "k_proj"], max_rank=16)
    yield model, h
    h.restore()


def test_grow_and_handle_refuse_ranks_above_the_limit(clip, monkeypatch):
    model, h = clip
    monkeypatch.setenv("FDLORA_MAX_RANK", "64")
    before = bank_bytes(h)
    with pytest.raises(CapacityError, match="FDLORA_MAX_RANK=4096"):
        h.grow(max_rank=4096)
    with pytest.raises(CapacityError, match="rank limit 64"):
        h.add_adapter(adapter(80))
    assert bank_bytes(h) == before and h.max_rank == 16
    with pytest.raises(CapacityError, match="rank limit"):
        fdlora.layers.FdLoraHandle(torch.nn.Linear(4, 4), max_rank=128)


def test_banks_shrink_when_the_largest_adapter_leaves(clip):
    model, h = clip
    x = torch.randint(0, 50, (2, 7))
    h.add_adapter(adapter(4, seed=1), "small")
    ref = model(x).last_hidden_state
    small = bank_bytes(h)
    h.grow(max_rank=256)
    h.add_adapter(adapter(200, seed=2), "big")
    assert bank_bytes(h) > 8 * small
    h.delete_adapter("big")
    assert h.max_rank == 16 and bank_bytes(h) == small  # back to the capacity asked for at inject
    h.set_adapters(["small"])
    torch.testing.assert_close(model(x).last_hidden_state, ref, rtol=0, atol=0)


def test_frozen_banks_keep_their_shape(clip):
    model, h = clip
    h.grow(max_rank=64)
    h.add_adapter(adapter(48), "big")
    h.freeze()
    h.delete_adapter("big")
    assert h.max_rank == 64
    h.unfreeze()
    h.add_adapter(adapter(4), "small")
    h.delete_adapter("small")
    assert h.max_rank == 16


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError], ids=["ctrl-c", "error"])
def test_interrupted_commit_rolls_back(clip, monkeypatch, exc):
    model, h = clip
    x = torch.randint(0, 50, (2, 7))
    h.add_adapter(adapter(4, seed=1), "keep")
    ref = model(x).last_hidden_state
    snap = [(layer.bank.A.clone(), layer.bank.B.clone()) for layer in h.layers.values()]

    def interrupted(writes):
        writes[0][0].write(writes[0][1], writes[0][2])  # half the work done, then the signal arrives
        raise exc()

    monkeypatch.setattr(AdapterBank, "write_many", staticmethod(interrupted))
    with pytest.raises(exc):
        h.add_adapter(adapter(8, seed=5, paths=(Q, Q.replace("q_proj", "k_proj"))), "new")
    monkeypatch.undo()
    assert h.list_adapters() == ["keep"]
    assert all(torch.equal(layer.bank.A, a) and torch.equal(layer.bank.B, b)
               for layer, (a, b) in zip(h.layers.values(), snap))
    h.add_adapter(adapter(8, seed=5), "new")  # the retry finds the name free
    h.set_adapters(["keep"])
    torch.testing.assert_close(model(x).last_hidden_state, ref, rtol=0, atol=0)
