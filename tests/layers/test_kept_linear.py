"""Eager blend calls without the merged-weight cache through the kept-ready merged path (prepare_linear): equal to
the regular op, replayed on later calls, correct when layers of different sizes share the scratch weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fdlora
from fdlora.hub.adapter import LoraAdapter, ModuleLora

pytest.importorskip("triton")
from fdlora.kernels.triton import config as C  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.triton, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
SIZES = [(256, 512), (512, 1024), (1024, 256)]  # (K, N): the second needs a larger scratch than the first


@pytest.fixture(autouse=True)
def every_modelled_path(monkeypatch):
    """The Triton paths under test, on any GPU: `auto` keeps a GPU without calibration constants on the cuBLAS
    forms (fdlora.layers.fastpath.percall), which tests/layers/test_percall.py covers."""
    monkeypatch.setenv("FDLORA_DISPATCH", "model")


def build():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(k, n) for k, n in SIZES]).cuda().half()
    g = torch.Generator().manual_seed(1)
    for name in ("a", "b"):
        mods = {str(i): ModuleLora(torch.randn(16, k, generator=g) * 0.05, torch.randn(n, 16, generator=g) * 0.05)
                for i, (k, n) in enumerate(SIZES)}
        fdlora.add_adapter(net, LoraAdapter(mods), name)
    fdlora.set_adapters(net, ["a", "b"], [0.6, 0.9])
    return net


def test_kept_merged_path_equals_the_regular_op_and_replays(monkeypatch):
    net = build()
    x = torch.randn(8192, SIZES[0][0], device="cuda", dtype=torch.float16)
    replays = []
    real = C.Prepared.__call__
    monkeypatch.setattr(C.Prepared, "__call__", lambda self, *t: replays.append(1) or real(self, *t))
    fdlora.set_merge_cache(0)
    try:
        with torch.no_grad():
            got = [net(x) for _ in range(3)]
            kept = [layer.__dict__.get("_kept") for layer in net]
            assert all(k is not None and k[1] is not None for k in kept)  # every layer took the kept path
            assert len(replays) >= 2 * len(SIZES)  # later calls replayed the bound merge
            for layer in net:
                layer.__dict__.pop("_kept")
            monkeypatch.setattr(type(net[0]), "_kept_linear", lambda self, x: None)  # the regular op
            want = net(x)
    finally:
        fdlora.set_merge_cache("auto")
    for y in got:
        assert torch.equal(y, want)
