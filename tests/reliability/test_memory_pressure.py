"""Out of memory where the budget saw room (fragmentation, another process): the merged-weight cache gives the
reservation back and the layer runs the per-call path, with one warning, instead of failing the step."""

from __future__ import annotations

import logging

import torch

import fdlora
from fdlora import LoraAdapter, ModuleLora
from fdlora.layers import merged


def test_a_copy_that_cannot_be_allocated_falls_back_and_the_step_runs(monkeypatch, caplog):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    mods = {p: ModuleLora(torch.randn(4, k) * 0.3, torch.randn(n, 4) * 0.3) for p, k, n in (("0", 16, 32),
                                                                                             ("2", 32, 16))}
    fdlora.add_adapter(m, LoraAdapter(mods), "a")
    x = torch.randn(5, 16)
    fdlora.set_merge_cache(0)
    with torch.no_grad():
        want = m(x)  # the per-call path
    fdlora.set_merge_cache(1 << 30)
    real, refused = torch.empty_like, [m[2].base.weight]

    def refuse(t, *a, **k):
        if any(t is r for r in refused):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(t, *a, **k)

    monkeypatch.setattr(torch, "empty_like", refuse)
    try:
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fdlora"):
            got = m(x)
            again = m(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-6)
        assert m[0].merged.buf is not None and m[2].merged.buf is None  # one layer cached, the other per-call
        assert fdlora.merge_cache_bytes() == m[0].merged.buf.numel() * 4  # no bytes counted for the failed copy
        assert sum("out of device memory" in r.message for r in caplog.records) == 1
    finally:
        monkeypatch.setattr(torch, "empty_like", real)
        fdlora.set_merge_cache("auto")
        refused.clear()
        del m
    assert merged.BUDGET.used.get(torch.device("cpu"), 0) == 0
