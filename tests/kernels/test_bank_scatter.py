"""write_staged (one bank_scatter launch per dtype pair) leaves banks bit-identical to AdapterBank.write_many.

CPU runs under TRITON_INTERPRET=1 in a child process (test_triton_interpret.py); CUDA runs are marked gpu.
"""

from __future__ import annotations

import pytest
import torch
from triton_cases import DEVICES, skip_unless

from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.hub.cache import pack_adapters, stage
from fdlora.layers.storage.bank import AdapterBank
from fdlora.layers.storage.bulk import write_staged


def banks(device, dtype):
    return {"lin": AdapterBank(3, 16, 24, (20,), dtype, device), "wide": AdapterBank(3, 32, 9, (40,), dtype, device),
            "conv": AdapterBank(3, 16, 6, (4, 3, 3), dtype, device)}


def adapter(ranks: dict[str, int], seed: int, src_dtype) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    shapes = {"lin": ((20,), 24, []), "wide": ((40,), 9, []), "conv": ((4, 3, 3), 6, [1, 1])}
    mods = {}
    for p, r in ranks.items():
        a_shape, n, tail = shapes[p]
        mods[p] = ModuleLora(torch.randn(r, *a_shape, generator=g).to(src_dtype),
                             torch.randn(n, r, *tail, generator=g).to(src_dtype), float(r))
    return LoraAdapter(mods)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_write_staged_matches_write_many(device: str, src_dtype) -> None:
    skip_unless(device)
    fast, slow = banks(device, torch.float16), banks(device, torch.float16)
    rounds = [({"lin": 16, "wide": 32, "conv": 5}, 0), ({"lin": 3, "wide": 7}, 1), ({"conv": 16, "lin": 9}, 2),
              ({"lin": 4, "wide": 32}, 0)]  # slot 0 again: lin's rank shrinks 16 -> 4
    for k, (ranks, slot) in enumerate(rounds):
        host = pack_adapters({"": adapter(ranks, k, src_dtype)}, pin=False)[""]
        staged = stage(host, device)
        assert staged is not None
        write_staged([(fast[p], slot, m) for p, m in host.modules.items()], staged)
        AdapterBank.write_many([(slow[p], slot, m) for p, m in host.modules.items()])
    for p in fast:
        for name in ("A", "B", "ranks"):
            assert torch.equal(getattr(fast[p], name), getattr(slow[p], name)), f"{p}.{name}"
        assert fast[p].used == slow[p].used and fast[p].host_ranks == slow[p].host_ranks
    assert torch.count_nonzero(fast["lin"].A[0, 4:]) == 0 and torch.count_nonzero(fast["lin"].B[:, 0, 4:]) == 0
