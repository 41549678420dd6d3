"""AdapterBank.write_many (the batched load path) leaves banks bit-identical to one-by-one writes."""

from __future__ import annotations

import torch

from fdlora.hub.adapter import ModuleLora
from fdlora.layers.storage.bank import AdapterBank


def banks():
    return [AdapterBank(3, 16, 12, (10,), torch.float16, "cpu"), AdapterBank(3, 16, 6, (4, 3, 3), torch.float32, "cpu")]


def lora(bank, r, seed):
    g = torch.Generator().manual_seed(seed)
    a_shape, n = tuple(bank.A.shape[2:]), bank.B.shape[0]
    B = torch.randn(n, r, *([1, 1] if len(a_shape) == 3 else []), generator=g)
    return ModuleLora(torch.randn(r, *a_shape, generator=g, dtype=torch.float64).float(), B.bfloat16(), None)


def state(bank):
    return [t.clone() for t in (bank.A, bank.B, bank.ranks)] + [list(bank.used), list(bank.host_ranks)]


def test_write_many_matches_write_including_a_shrinking_rank():
    one, many = banks(), banks()
    rounds = [[(0, 16, 1), (2, 5, 2)], [(0, 3, 3), (1, 9, 4)], [(2, 12, 5)]]  # slot 0 shrinks 16 -> 3
    for k, round_ in enumerate(rounds):
        for b1, b2 in zip(one, many):
            for slot, r, seed in round_:
                b1.write(slot, lora(b1, r, seed + 10 * k))
            v = b2.version
            AdapterBank.write_many([(b2, slot, lora(b2, r, seed + 10 * k)) for slot, r, seed in round_])
            assert b2.version > v
            for x, y in zip(state(b1), state(b2)):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert torch.count_nonzero(many[0].A[0, 3:]) == 0 and torch.count_nonzero(many[0].B[:, 0, 3:]) == 0


def test_clear_many_matches_clear_including_bias_and_dora_banks():
    """AdapterBank.clear_many (a delete or an eviction: one slot of every layer) leaves banks bit-identical to
    clear() bank by bank: A, B and ranks zeroed, host mirrors and versions moved; banks with a LoRA bias or a DoRA
    slot take clear() themselves."""
    def filled():
        out = banks() + [AdapterBank(3, 16, 12, (10,), torch.float32, "cpu")]
        for i, b in enumerate(out):
            for slot, r in ((0, 5), (1, 16), (2, 3)):
                b.write(slot, lora(b, r, 7 * i + slot))
        g = torch.Generator().manual_seed(3)
        out[2].write(1, ModuleLora(torch.randn(4, 10, generator=g), torch.randn(12, 4, generator=g), None,
                                   bias=torch.randn(12, generator=g)))
        out[0].write(2, ModuleLora(torch.randn(2, 10, generator=g), torch.randn(12, 2, generator=g), None,
                                   magnitude=torch.rand(12, generator=g) + 0.5))
        return out

    one, many = filled(), filled()
    for slot in (1, 2):
        for b in one:
            b.clear(slot)
        versions = [b.version for b in many]
        AdapterBank.clear_many(many, slot)
        assert all(b.version > v for b, v in zip(many, versions))
        for b1, b2 in zip(one, many):
            for x, y in zip(state(b1), state(b2)):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            assert b1.dora_eps == b2.dora_eps and torch.equal(b1._buffers["dversion"], b2._buffers["dversion"])
            assert (b1.bias is None) == (b2.bias is None) and (b1.bias is None or torch.equal(b1.bias, b2.bias))
    assert torch.count_nonzero(many[1].A[1:]) == 0 and many[1].host_ranks == [5, 0, 0]
