"""AdapterBank.write_many (the batched load path) leaves banks bit-identical to one-by-one writes."""

from __future__ import annotations

import torch

from fdlora.hub.adapter import ModuleLora
from fdlora.layers.bank import AdapterBank


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
