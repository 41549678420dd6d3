"""Eager decode (fdlora.layers.fastpath.decode): per-row and per-sample adapters through one kept-ready launch.

GPU cases compare with a float64 oracle of the layer's own bank and scales, check that repeats
replay the kept launch, and that everything else stays on the regular ops; CPU cases check the
per-sample -> per-row analysis (ModelState.sample_rows).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fdlora
from fdlora.hub.adapter import LoraAdapter, ModuleLora

pytest.importorskip("triton")
from fdlora.kernels.triton import config as C  # noqa: E402
from fdlora.layers.fastpath import decode  # noqa: E402
from fdlora.layers.state import as_rows  # noqa: E402
from fdlora.testing import bound, max_err  # noqa: E402


@pytest.fixture(autouse=True)
def every_modelled_path(monkeypatch):
    """The Triton paths under test, on any GPU: `auto` keeps a GPU without calibration constants on the cuBLAS
    forms (fdlora.layers.fastpath.percall), which tests/layers/test_percall.py covers."""
    monkeypatch.setenv("FDLORA_DISPATCH", "model")


pytestmark = pytest.mark.triton  # Triton's kept launches: on the Triton backend, as auto picks it

CUDA = torch.cuda.is_available()
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


class One(nn.Module):
    def __init__(self, K: int, N: int) -> None:
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x):
        return self.proj(x)


def build(K: int, N: int, ranks: list[int], dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    net = One(K, N).to(device, dtype)
    fdlora.inject(net, ["proj"], max_slots=len(ranks) + 1, max_rank=32)
    for i, r in enumerate(ranks):
        g = torch.Generator().manual_seed(i)
        m = ModuleLora(torch.randn(r, K, generator=g) / K ** 0.5, torch.randn(N, r, generator=g) / r ** 0.5, 2.0 * r)
        fdlora.add_adapter(net, LoraAdapter({"proj": m}), f"a{i}")
    fdlora.set_adapters(net, ["a0"])
    return net


def oracle(net: One, x: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """float64: base + sum_s row_scale[m, s] (x A_s^T) B_s^T from the layer's own bank."""
    layer = net.proj
    base, b = layer.base, layer.bank
    S, R, K = b.A.shape
    x2 = x.reshape(-1, K).double()
    h = (x2 @ b.A.double().reshape(S * R, K).t()).view(-1, S, R) * row_scale.double()[:, :, None]
    y = x2 @ base.weight.double().t() + base.bias.double() + h.reshape(-1, S * R) @ b.B.double().reshape(-1, S * R).t()
    return y.view(*x.shape[:-1], -1)


def eager(net: One, x: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """The same sum in x's dtype (PEFT-style): the error scale the bound derives from."""
    b = net.proj.bank
    S, R, K = b.A.shape
    x2 = x.reshape(-1, K)
    h = (x2 @ b.A.reshape(S * R, K).t()).view(-1, S, R) * row_scale.to(x.dtype)[:, :, None]
    return (net.proj.base(x2) + h.reshape(-1, S * R) @ b.B.reshape(-1, S * R).t()).view(*x.shape[:-1], -1)


@pytest.fixture
def spy(monkeypatch):
    """Records per call whether the decode path served it and whether a kept launch was replayed."""
    seen = {"decode": [], "replayed": []}
    real, call = decode.forward, C.Prepared.__call__

    def forward(*a, **kw):
        y = real(*a, **kw)
        seen["decode"].append(y is not None)
        return y

    def replay(self, *t):
        ok = call(self, *t)
        seen["replayed"].append(ok)
        return ok

    monkeypatch.setattr(decode, "forward", forward)
    monkeypatch.setattr(C.Prepared, "__call__", replay)
    return seen


CASES = [  # K, N, ranks, x shape, (scope, spec); per-sample specs have one adapter per sample at one weight
    pytest.param(96, 80, [4, 16, 1], (7, 96), ("rows", ["a2", None, "a0", "a1", "a1", None, "a2"]), id="rows-7"),
    pytest.param(256, 128, [16, 32], (32, 1, 256), ("rows", ["a0", "a1", None, "a1"] * 8), id="rows-32x1-r32"),
    pytest.param(96, 80, [8, 8, 8], (4, 1, 96), ("samples", ["a1", None, {"a0": 0.5}, {"a1": 1.0}]),
                 id="samples-4x1-weighted"),
    pytest.param(64, 48, [16, 1], (5, 64), ("samples", ["a1", "a0", "__base__", "a1", "a0"]), id="samples-5"),
]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("K, N, ranks, shape, spec", CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_matches_oracle_and_replays(K, N, ranks, shape, spec, dtype, spy):
    dt = DTYPES[dtype]
    net = build(K, N, ranks, dt, "cuda")
    h = fdlora.handle(net)
    kind, names = spec
    scope = fdlora.per_row if kind == "rows" else fdlora.per_sample
    outs = []
    with torch.no_grad(), scope(net, names):
        for i in range(5):  # fresh x and y each call, as in a decode loop
            x = torch.randn(*shape, device="cuda", dtype=dt, generator=torch.Generator("cuda").manual_seed(i))
            outs.append((x, net(x)))
    assert all(spy["decode"]) and len(spy["decode"]) == 5
    assert spy["replayed"] and all(spy["replayed"])  # the later calls replayed the kept launch
    layer = net.proj
    weights = h.sample_weights(names)  # [G, S]; per-row: one sample per row
    row_scale = (weights * layer.scale_unit.cpu()).cuda()
    for x, got in outs:
        ref = oracle(net, x, row_scale)
        assert max_err(got, ref) <= bound(max_err(eager(net, x, row_scale), ref), ref, dt)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_regular_ops_for_blends_prefill_frozen_and_misaligned_inputs(spy):
    net = build(128, 64, [16, 16], torch.float16, "cuda")
    x = torch.randn(4, 1, 128, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        with fdlora.per_sample(net, [{"a0": 0.5, "a1": 0.5}, "a0", None, "a1"]):  # a blend: not per-row
            blend = net(x)
        assert spy["decode"] == [False]
        with fdlora.per_sample(net, ["a0", "a1"]):  # 2 samples of 3 rows (prefill)
            net(torch.randn(2, 3, 128, device="cuda", dtype=torch.float16))
        assert spy["decode"][-1] is False
        fdlora.handle(net).freeze()
        with fdlora.per_row(net, ["a0", "a1", None, "a1"]):
            frozen = net(x)
        assert spy["decode"][-1] is False
        fdlora.handle(net).unfreeze()
        with fdlora.per_row(net, ["a0", "a1", None, "a1"]):
            for _ in range(3):
                assert torch.equal(net(x), frozen)
            buf = torch.empty(4 * 128 + 1, device="cuda", dtype=torch.float16)
            odd = buf[1:].view(4, 1, 128)  # 2-byte offset: another specialization than the kept launch's
            odd.copy_(x)
            assert max_err(net(odd), frozen) <= 1e-3
        assert spy["replayed"][-1] is False and spy["decode"][-1] is True
    fdlora.set_adapters(net, ["a0", "a1"], [0.5, 0.5])
    with torch.no_grad():
        ref = net(x)
    assert max_err(blend[0], ref[0]) <= 2e-3


def test_cpu_inputs_take_the_backend(spy):
    net = build(16, 8, [4], torch.float32, "cpu")
    with fdlora.per_row(net, ["a0", None]):
        y = net(torch.randn(2, 16))
    assert spy["decode"] == [False] and y.shape == (2, 8)


@pytest.mark.parametrize("gw, rows", [
    ([[0, 0.7, 0], [0, 0, 0], [1, 0, 0], [0, 0.7, 0]], ([1, -1, 0, 1], [1.0, 0.7, 0.0])),
    ([[0, 0.7, 0], [0, 0.5, 0]], None),  # one adapter at two weights
    ([[0.5, 0.7, 0]], None),  # a blend
    ([[0, 0, 0]], ([-1], [0.0, 0.0, 0.0])),
], ids=["names", "two-weights", "blend", "base-only"])
def test_per_sample_weights_as_rows(gw, rows):
    got = as_rows(torch.tensor(gw, dtype=torch.float32))
    if rows is None:
        assert got is None
    else:
        assert got[0].tolist() == rows[0] and got[1].tolist() == pytest.approx(rows[1])


def test_sample_rows_scales_follow_the_table():
    net = build(16, 8, [4, 8], torch.float32, "cpu")
    h = fdlora.handle(net)
    with h.per_sample(["a1", None, "a0"]):
        rs, scales = h.state.sample_rows(3, torch.device("cpu"))
        assert rs.tolist() == [1, -1, 0]
        layer = net.proj
        assert torch.allclose(scales[layer.index], layer.scale_unit)  # weight 1.0 each
        h.set_multiplier(2.0)
        _, scales = h.state.sample_rows(3, torch.device("cpu"))
        assert torch.allclose(scales[layer.index], layer.scale_unit)
        assert torch.allclose(scales[layer.index][:2], 2.0 * torch.tensor([2.0, 2.0]))  # alpha / r = 2, times 2
        assert h.state.sample_rows(4, torch.device("cpu")) is None  # no spec for 4 samples


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_one_adapter_without_the_cache_runs_as_per_row_decode(spy):
    net = build(96, 80, [8, 16], torch.float16, "cuda")
    fdlora.set_adapters(net, ["a1"], [0.7])
    fdlora.set_merge_cache(0)
    try:
        with torch.no_grad():
            outs = []
            for i in range(4):
                x = torch.randn(6, 1, 96, device="cuda", dtype=torch.float16,
                                generator=torch.Generator("cuda").manual_seed(i))
                outs.append((x, net(x)))
            assert all(spy["decode"]) and spy["replayed"] and all(spy["replayed"])
            row_scale = torch.zeros(6, 3)
            row_scale[:, 1] = net.proj.scale_blend[1].cpu()
            for x, got in outs:
                ref = oracle(net, x, row_scale.cuda())
                assert max_err(got, ref) <= bound(max_err(eager(net, x, row_scale.cuda()), ref), ref, torch.float16)
            fdlora.set_adapters(net, ["a0", "a1"], [0.5, 0.5])  # a blend of two: the regular ops
            net(outs[0][0])
            assert spy["decode"][-1] is False
    finally:
        fdlora.set_merge_cache("auto")
