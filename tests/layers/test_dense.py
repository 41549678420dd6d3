"""The few-row eager path (fdlora.layers.dense): per-row and per-sample adapters through cuBLAS.

GPU cases compare with a float64 oracle of the same bank and scale table, and with the Triton
kernels' result; the CPU cases check when the path stays out of the way.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fdlora
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.layers import dense
from fdlora.testing import bound, max_err

CUDA = torch.cuda.is_available()
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class One(nn.Module):
    def __init__(self, K: int, N: int) -> None:
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x):
        return self.proj(x)


def build(K: int, N: int, ranks: list[int], dtype: torch.dtype, device: str, max_rank: int = 32):
    torch.manual_seed(0)
    net = One(K, N).to(device, dtype)
    fdlora.inject(net, ["proj"], max_slots=len(ranks) + 1, max_rank=max_rank)
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
    layer = net.proj
    b = layer.bank
    S, R, K = b.A.shape
    x2 = x.reshape(-1, K)
    h = (x2 @ b.A.reshape(S * R, K).t()).view(-1, S, R) * row_scale.to(x.dtype)[:, :, None]
    return (layer.base(x2) + h.reshape(-1, S * R) @ b.B.reshape(-1, S * R).t()).view(*x.shape[:-1], -1)


@pytest.fixture
def taken(monkeypatch):
    """Counts calls that the dense path served."""
    calls = []
    real = dense.forward

    def spy(*a, **kw):
        y = real(*a, **kw)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(dense, "forward", spy)
    return calls


CASES = [  # id, K, N, ranks (slot order), shape of x, per-row or per-sample spec
    pytest.param(96, 80, [4, 16, 1], (7, 96), ("rows", ["a2", None, "a0", "a1", "a1", None, "a2"]), id="rows-7"),
    pytest.param(128, 64, [16, 32], (32, 128), ("rows", ["a0", "a1", None, "a1"] * 8), id="rows-32-r32"),
    pytest.param(96, 80, [8, 8, 8], (4, 3, 96), ("samples", ["a1", None, {"a0": 0.5, "a2": -1.5}, "a2"]),
                 id="samples-4x3-blend"),
    pytest.param(64, 48, [16, 1], (5, 64), ("samples", ["a1", "a0", "__base__", "a1", "a0"]), id="samples-5"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("K, N, ranks, shape, spec", CASES)
def test_matches_oracle_and_the_kernels(K, N, ranks, shape, spec, dtype, taken, monkeypatch):
    dt = DTYPES[dtype]
    net = build(K, N, ranks, dt, "cuda")
    h = fdlora.handle(net)
    x = torch.randn(*shape, device="cuda", dtype=dt)
    kind, names = spec
    scope = fdlora.per_row if kind == "rows" else fdlora.per_sample
    with torch.no_grad(), scope(net, names):
        got = net(x)
        monkeypatch.setattr(dense, "DENSE_ROWS", 0)  # the Triton kernels, for the same call
        kernels = net(x)
        monkeypatch.setattr(dense, "DENSE_ROWS", 64)
    assert taken[0] is True and taken[1] is False
    layer = net.proj
    S = layer.bank.slots
    weights = h.sample_weights(names)  # [G, S]: one-hot rows (per-row: one sample per row)
    rows = x.numel() // K
    row_scale = (weights * layer.scale_unit.cpu()).repeat_interleave(rows // len(names), dim=0)[:, :S].cuda()
    ref = oracle(net, x, row_scale)
    tol = bound(max_err(eager(net, x, row_scale), ref), ref, dt)
    assert max_err(got, ref) <= tol
    assert max_err(kernels, ref) <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_stays_out_when_frozen_too_many_rows_or_too_wide(taken, monkeypatch):
    net = build(64, 48, [16, 16], torch.float16, "cuda")
    names = ["a0", "a1"] * 4
    x = torch.randn(8, 64, device="cuda", dtype=torch.float16)
    with torch.no_grad(), fdlora.per_row(net, names):
        net(x)
        assert taken[-1] is True
        fdlora.handle(net).freeze()  # CUDA graphs / compile: the launches must not depend on the live extent
        net(x)
        assert taken[-1] is False
        fdlora.handle(net).unfreeze()
        monkeypatch.setattr(dense, "MAX_EXTRA", 0.01)  # live slots too wide for this layer
        net.proj.__dict__.pop("_dense", None)  # the width verdict is kept per bank version
        net(x)
        assert taken[-1] is False
    with torch.no_grad(), fdlora.per_row(net, names * 9):  # 72 rows > DENSE_ROWS
        net(torch.randn(72, 64, device="cuda", dtype=torch.float16))
        assert taken[-1] is False


def test_cpu_inputs_take_the_backend(taken):
    net = build(16, 8, [4], torch.float32, "cpu")
    with fdlora.per_row(net, ["a0", None]):
        y = net(torch.randn(2, 16))
    assert taken == [False] and y.shape == (2, 8)
