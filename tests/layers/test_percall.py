"""The per-call cuBLAS forms (fdlora.layers.fastpath.percall) against a float64 oracle built from the adapters'
own weights: blend (one and several adapters, weights), per-sample (scratch at many rows, delta at few), per-row
(and row slots rewritten in place), with the hot path's repeats and a weight change after it. CPU under
FDLORA_DISPATCH=cublas in fp32; the same on CUDA (marked gpu) in fp16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fdlora
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.kernels.registry import use_backend
from fdlora.layers.fastpath import percall

CUDA = torch.cuda.is_available()
K, N = 48, 40
RANKS = (4, 8, 16)
ALPHAS = (4.0, 4.0, 32.0)


class One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x):
        return self.proj(x)


def loras() -> list[ModuleLora]:
    out = []
    for i, (r, a) in enumerate(zip(RANKS, ALPHAS)):
        g = torch.Generator().manual_seed(10 + i)
        out.append(ModuleLora(torch.randn(r, K, generator=g) / K ** 0.5, torch.randn(N, r, generator=g), a))
    return out


def build(device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    net = One().to(device, dtype)
    fdlora.inject(net, ["proj"], max_slots=4, max_rank=16)
    for i, m in enumerate(loras()):
        fdlora.add_adapter(net, LoraAdapter({"proj": m}), f"a{i}")
    return net


def oracle(net: One, x: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """float64: x W^T + b + sum_s w[m, s] * alpha_s / r_s * (x A_s^T) B_s^T, rows m of x flattened."""
    base = net.proj.base
    x2 = x.reshape(-1, K).double().cpu()
    y = x2 @ base.weight.double().cpu().t() + base.bias.double().cpu()
    for s, m in enumerate(loras()):
        y += row_weights[:, s:s + 1].double() * (m.alpha / m.rank) * (x2 @ m.A.double().t() @ m.B.double().t())
    return y.view(*x.shape[:-1], N)


def check(net, x, row_weights, dtype):
    with torch.no_grad():  # inference (diffusers' pipelines and generate run so); autograd takes the regular paths
        y = net(x)
    ref = oracle(net, x, row_weights)
    tol = (1e-5 if dtype is torch.float32 else 2e-2) * ref.abs().max().item()
    err = (y.double().cpu() - ref).abs().max().item()
    assert err <= tol, (err, tol)
    paths = fdlora.dispatch_counts(net)
    assert any(p.startswith("cublas") for p in paths), paths
    return paths


CASES = [pytest.param("cpu", torch.float32, id="cpu-fp32"),
         pytest.param("cuda", torch.float16, id="cuda-fp16", marks=[pytest.mark.gpu, pytest.mark.skipif(
             not CUDA, reason="needs CUDA")])]


@pytest.fixture(autouse=True)
def cublas(monkeypatch):
    """The torch forms: FDLORA_DISPATCH=cublas, no merged copies, and on CUDA the Triton backend (with the CUDA
    extension's backends, its bound forms take the host-limited calls: tests/kernels/test_cuda_backend.py)."""
    monkeypatch.setenv("FDLORA_DISPATCH", "cublas")
    fdlora.set_merge_cache(0)
    with use_backend("triton" if CUDA else "auto"):
        yield
    fdlora.set_merge_cache("auto")


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows", [3, 512])  # delta, scratch
def test_blend(device, dtype, rows):
    net = build(device, dtype)
    x = torch.randn(2, rows, K, device=device, dtype=dtype)
    fdlora.set_adapters(net, ["a1"])
    paths = check(net, x, torch.tensor([[0.0, 1.0, 0.0]]).expand(2 * rows, 3), dtype)
    assert any(("scratch" in p) == (rows == 512) for p in paths), paths
    for _ in range(2):  # repeats: the hot path
        check(net, x, torch.tensor([[0.0, 1.0, 0.0]]).expand(2 * rows, 3), dtype)
    fdlora.set_adapters(net, ["a0", "a2"], [0.7, -0.4])  # a slider moved: the new weights, not the kept ones
    check(net, x, torch.tensor([[0.7, 0.0, -0.4]]).expand(2 * rows, 3), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows", [1, 512])  # delta (decode), scratch (one merged weight per sample)
def test_per_sample(device, dtype, rows):
    net = build(device, dtype)
    x = torch.randn(4, rows, K, device=device, dtype=dtype)
    specs = ["a0", {"a1": 0.5, "a2": 1.5}, None, "a2"]
    w = torch.tensor([[1.0, 0, 0], [0, 0.5, 1.5], [0, 0, 0], [0, 0, 1.0]]).repeat_interleave(rows, 0)
    with fdlora.per_sample(net, specs):
        paths = check(net, x, w, dtype)
        check(net, x, w, dtype)
    assert any(("scratch" in p) == (rows == 512) for p in paths), paths


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("specs", [["a0", {"a1": 0.5, "a2": 1.5}, None, "a2"], ["a0", "a1", "a0", "a1"]],
                         ids=["runs", "periodic (CFG)"])
def test_per_blend_scratch_where_the_gpu_is_the_limit(device, dtype, specs, monkeypatch):
    """GEMMs above GPU_BOUND_FLOPS: one addmm per distinct blend, one GEMM per run (a strided batched one per
    position of a periodic batch)."""
    monkeypatch.setattr(percall, "GPU_BOUND_FLOPS", 0)
    net = build(device, dtype)
    rows = 512
    x = torch.randn(4, rows, K, device=device, dtype=dtype)
    slot = {"a0": 0, "a1": 1, "a2": 2}
    w = torch.zeros(4, 3)
    for i, sp in enumerate(specs):
        for n, v in ({} if sp is None else {sp: 1.0} if isinstance(sp, str) else sp).items():
            w[i, slot[n]] = v
    with fdlora.per_sample(net, specs):
        paths = check(net, x, w.repeat_interleave(rows, 0), dtype)
        check(net, x, w.repeat_interleave(rows, 0), dtype)
    assert "per-blend scratch" in next(iter(paths)), paths


@pytest.mark.parametrize("device,dtype", CASES)
def test_per_row_and_rows_rewritten(device, dtype):
    net = build(device, dtype)
    x = torch.randn(6, K, device=device, dtype=dtype)
    names = ["a0", "a2", None, "a1", "a1", "a0"]
    slot = {"a0": 0, "a1": 1, "a2": 2}

    def weights(ns):
        w = torch.zeros(len(ns), 3)
        for i, n in enumerate(ns):
            if n is not None:
                w[i, slot[n]] = 1.0
        return w

    with fdlora.per_row(net, names):
        paths = check(net, x, weights(names), dtype)
        assert "per-row" in next(iter(paths)), paths
    flipped = list(reversed(names))
    with fdlora.per_row(net, flipped):  # same shape: the row slots are rewritten in place; the kept call reads them
        check(net, x, weights(flipped), dtype)


def test_rule_prefers_fewer_extra_bytes():
    assert percall.scratch_wins(8192, 640, 640, 1)  # SDXL self-attention at 1024²: a temporary W' per call
    assert not percall.scratch_wins(154, 2048, 640, 1)  # cross-attention on the text (77 tokens x 2)
    assert not percall.scratch_wins(32, 4096, 4096, 1)  # LLM decode
    assert not percall.scratch_wins(8192, 640, 640, 64)  # many samples of few rows each

