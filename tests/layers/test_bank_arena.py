"""Banks made by one `wrap` are views into a few zeroed buffers (fdlora.layers.storage.bank.arena): same results as
separately allocated banks, and copies / pickles hold only their own bytes."""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

import fdlora
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.layers.storage.bank import AdapterBank, arena


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(24 + i, 24 + i + 1) for i in range(12)]).eval()


def adapter(m: nn.Module, seed: int) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    return LoraAdapter({n: ModuleLora(torch.randn(4, l.in_features, generator=g), torch.randn(l.out_features, 4,
                                                                                               generator=g))
                        for n, l in m.named_children()})


def test_wrapped_banks_share_a_few_zeroed_buffers_and_compute_the_same():
    m = model()
    h = fdlora.inject(m, [str(i) for i in range(12)], max_slots=3, max_rank=16)
    banks = [layer.bank for layer in h.layers.values()]
    storages = {b.A.untyped_storage().data_ptr() for b in banks} | {b.B.untyped_storage().data_ptr() for b in banks}
    assert len(storages) <= 2 and all(b.A._base is not None for b in banks)  # 24 tensors, at most 2 buffers
    assert all(b.A.data_ptr() % 16 == 0 and b.B.is_contiguous() for b in banks)
    assert all(not b.A.any() and not b.B.any() and not b.ranks.any() for b in banks)
    ref = model()  # the same model with banks allocated one by one (no arena)
    href = fdlora.FdLoraHandle(ref, max_slots=3, max_rank=16)
    for p in h.layers:
        href.wrap([p])
    for i, name in enumerate(["a", "b", "c"]):
        h.add_adapter(adapter(m, i), name)
        href.add_adapter(adapter(ref, i), name)
    h.delete_adapter("b")
    href.delete_adapter("b")
    h.set_adapters(["a", "c"], [0.5, 0.7])
    href.set_adapters(["a", "c"], [0.5, 0.7])
    x = torch.randn(5, 24)
    assert torch.equal(m(x), ref(x))


def test_copies_and_pickles_of_arena_banks_are_compact_and_independent():
    with arena():
        banks = [AdapterBank(2, 16, 64, (48,), torch.float32, "cpu") for _ in range(8)]
    alone = AdapterBank(2, 16, 64, (48,), torch.float32, "cpu")
    assert len(pickle.dumps(banks[3])) < 1.2 * len(pickle.dumps(alone))  # not the whole shared buffer
    c = copy.deepcopy(banks[3])
    assert c.A._base is None and c.A.shape == banks[3].A.shape
    c.A.fill_(1)
    assert not banks[3].A.any() and not banks[4].A.any()
