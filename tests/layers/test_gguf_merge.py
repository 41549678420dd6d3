"""LoRA merged into a GGUF base's per-call dequantization (fdlora.kernels.triton.merge.gguf_merge, fdlora.layers.quant.gguf).

The kernel: Q8_0 bytes made by gguf's own quantizer, dequantized with the blend merged in, against a float64 oracle
(diffusers' dequantization, whose d * q is rounded to fp16, plus sum_s scale_s B_s A_s) within a bound from eager
PyTorch's error in the output dtype; A/B rows past each slot's live rank (rounded up to 16), every weight of a
zero-scale or empty slot, and the output buffer are NaN, so a read or a skipped write fails. With no LoRA the output is
diffusers' `dequantize_gguf_tensor(w).to(dtype)` bit for bit.

The layer: two diffusers GGUFLinear layers (Q8_0, Q4_0; fp32 compute) with adapters loaded through fd-lora. Blend
calls equal the float64 oracle and the base(x) + delta path, never call the delta op, leave the stored bytes and the
merged-weight cache alone; per-sample, autograd and hooked calls go the regular way. In this process the layers are on
the torch backend (diffusers' dequantization + addmm_); a child process runs the same tests under TRITON_INTERPRET=1,
where Q8_0 layers take the Triton kernel; `gpu` cases run both on CUDA.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import pickle
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import fdlora
from fdlora import env
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.layers.quant import dequant
from fdlora.layers.quant import gguf as layer_gguf
from fdlora.testing import bound, max_err

pytest.importorskip("gguf")
pytest.importorskip("diffusers")

import gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
INTERPRET = env.triton_interpret()
HAS_TRITON = importlib.util.find_spec("triton") is not None
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
Q8_0 = gguf.GGMLQuantizationType.Q8_0
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def q8_0(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q8_0 bytes [N, K / 32 * 34] from gguf.quants.quantize, their float64 dequantization as diffusers computes it:
    d * q rounded to fp16). Rows span six decades, so the blocks' scales do too."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.logspace(-3, 1, K)[torch.randperm(K, generator=g)]
    Wq = torch.from_numpy(gguf.quants.quantize(w.numpy(), Q8_0))
    blocks = Wq.view(-1, 34)
    d = blocks[:, :2].contiguous().view(torch.float16).double()
    q = blocks[:, 2:].contiguous().view(torch.int8).double()
    W = (d * q).half().double().reshape(N, K)
    assert torch.allclose(W, torch.from_numpy(gguf.quants.dequantize(Wq.numpy(), Q8_0)).double(), rtol=2 ** -10)
    return Wq, W


def diffusers_dequant(Wq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    return dequantize_gguf_tensor(GGUFParameter(Wq, quant_type=Q8_0)).to(dtype)


# --- the kernel ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    N: int
    K: int  # a multiple of 32 (Q8_0 blocks), not of the tile (BK = 64 interpreted, 128 on the GPU) where it can be
    R: int  # bank rank capacity
    ranks: tuple[int, ...]  # live rank per slot, 0 = empty
    scales: tuple[float, ...]  # blend scale per slot, 0 = inactive
    dtype: str  # output and A / B dtype
    b_scale: float = 1.0  # B's size: the LoRA must stand out above the dtype's rounding of W (up to ~50 here)


CASES = [
    Case("N40-K96-r16-fp32", 40, 96, 16, (16,), (0.5,), "fp32"),
    Case("N33-K160-R32-ranks5.32.12-zero-scale-fp32", 33, 160, 32, (5, 32, 12), (1.3, -0.7, 0.0), "fp32"),
    Case("N17-K64-ranks3.9-S2-fp16", 17, 64, 16, (3, 9), (0.25, 2.0), "fp16"),
    Case("N48-K32-R64-ranks1.0.64.20-empty-and-zero-fp16", 48, 32, 64, (1, 0, 64, 20), (0.8, 0.5, -0.3, 0.0), "fp16"),
    Case("N24-K96-all-scales-zero-fp32", 24, 96, 16, (16, 8), (0.0, 0.0), "fp32"),
]
GPU_CASES = [
    Case("N72-K416-ranks16.7-S2-bf16", 72, 416, 16, (16, 7), (0.9, -0.4), "bf16", b_scale=8),
    Case("flux-N3072-K3072-r16-S4-blend-bf16", 3072, 3072, 16, (16, 16, 16, 16), (0.7, 0.5, 0.3, 0.2), "bf16",
         b_scale=32),
    Case("flux-N3072-K12288-r16-S4-one-active-bf16", 3072, 12288, 16, (16, 16, 16, 16), (1.0, 0.0, 0.0, 0.0),
         "bf16", b_scale=32),
]


def bank(c: Case, device: str):
    """(A [S, R, K], B [N, S, R] as the kernel sees them (NaN where it must not read), the clean pair, scale, ranks)."""
    g = torch.Generator().manual_seed(7)
    S, dt = len(c.ranks), DTYPES[c.dtype]
    A = torch.randn(S, c.R, c.K, generator=g) / c.K ** 0.5
    B = torch.randn(c.N, S, c.R, generator=g) * c.b_scale
    seen_A, seen_B = A.clone(), B.clone()
    for s, (r, sc) in enumerate(zip(c.ranks, c.scales)):
        A[s, r:], B[:, s, r:] = 0, 0  # the bank's zero padding
        live = 0 if sc == 0 or r == 0 else -(-r // 16) * 16  # what the kernel may read: whole 16-row granules
        seen_A[s], seen_B[:, s] = A[s], B[:, s]
        seen_A[s, live:], seen_B[:, s, live:] = float("nan"), float("nan")
    put = lambda t: t.to(dt).to(device)  # noqa: E731
    scale = torch.tensor(c.scales, dtype=torch.float32, device=device)
    ranks = torch.tensor(c.ranks, dtype=torch.int32, device=device)
    return put(seen_A), put(seen_B), put(A), put(B), scale, ranks


def _kernel_case(c: Case, device: str) -> None:
    from fdlora.kernels.triton.merge import gguf_merge

    dt = DTYPES[c.dtype]
    Wq, W64 = q8_0(c.N, c.K, seed=c.N)
    A, B, clean_A, clean_B, scale, ranks = bank(c, device)
    S = len(c.ranks)
    ones = torch.ones(1, S, device=device)
    Wq = Wq.to(device)
    out = torch.full((c.N, c.K), float("nan"), dtype=dt, device=device)
    got = gguf_merge.gguf_q8_0_merge(Wq, A, B, scale, ones, ranks, dt, out=out)
    assert got is out
    want = W64 + torch.einsum("s,nsr,srk->nk", scale.double().cpu(), clean_B.double().cpu(), clean_A.double().cpu())
    base = diffusers_dequant(Wq, dt)  # eager PyTorch in dt: diffusers' W, plus each slot's scaled B A in dt
    eager = base + sum((clean_B[:, s].float() * c.scales[s]).to(dt) @ clean_A[s] for s in range(S))
    allowed = bound(max_err(eager.cpu(), want), want, dt)
    err = max_err(got.cpu(), want)
    assert err <= allowed, (c.id, err, allowed)
    if any(c.scales):
        assert max_err(base.cpu(), want) > 2 * allowed, "the LoRA must visibly change W' (a kernel without it fails)"
    else:  # no live slot: diffusers' dequantization itself
        assert torch.equal(got, base)
    nolora = gguf_merge.gguf_q8_0_merge(Wq, A, B, scale, ones, ranks, dt, lora=False)
    assert torch.equal(nolora, base), "without the LoRA the kernel is diffusers' dequantization, bit for bit"


@pytest.mark.skipif(not (HAS_TRITON and INTERPRET), reason="runs under TRITON_INTERPRET=1 (the child process below)")
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_kernel_interpreted(c):
    _kernel_case(c, "cpu")


@gpu
@needs_cuda
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=lambda c: c.id)
def test_kernel_cuda(c):
    pytest.importorskip("triton")
    _kernel_case(c, "cuda")


def test_kernel_refuses_bytes_that_are_not_q8_0_rows():
    pytest.importorskip("triton")
    from fdlora.errors import FdLoraError
    from fdlora.kernels.triton.merge import gguf_merge

    A, B = torch.zeros(1, 16, 64), torch.zeros(8, 1, 16)
    with pytest.raises(FdLoraError, match=r"uint8 \[N, K / 32 \* 34\]"):
        gguf_merge.check(torch.zeros(8, 60, dtype=torch.uint8), A, B)
    with pytest.raises(FdLoraError, match="do not fit"):
        gguf_merge.check(torch.zeros(8, 34, dtype=torch.uint8), A, B)
    assert gguf_merge.check(torch.zeros(8, 68, dtype=torch.uint8), A, B) == (8, 64)


# --- the layer ----------------------------------------------------------------------------------------------------
SIZES = [(64, 96), (96, 64)]  # (in, out) per layer
PATHS = ["0", "1"]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[gpu, needs_cuda])]
QTYPES = ["Q8_0", "Q4_0"]


def gguf_net(qtype: str, device: str) -> nn.Module:
    """Two diffusers GGUFLinear layers over gguf-quantized random weights (fp32 compute), with float biases."""
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    torch.manual_seed(0)
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    layers = []
    for k, n in SIZES:
        float_lin = nn.Linear(k, n)
        m = GGUFLinear(k, n, bias=True, compute_dtype=torch.float32)
        m.weight = GGUFParameter(torch.from_numpy(gguf.quants.quantize(float_lin.weight.detach().numpy(), qt)),
                                 quant_type=qt)
        m.bias = nn.Parameter(float_lin.bias.detach().clone(), requires_grad=False)
        layers.append(m)
    return nn.Sequential(*layers).to(device)


def adapter(seed: int, rank: int, alpha: float) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    return LoraAdapter({p: ModuleLora(torch.randn(rank, k, generator=g) / 4, torch.randn(n, rank, generator=g) / 4,
                                      alpha) for p, (k, n) in zip(PATHS, SIZES)})


ADS = {"a": adapter(1, 4, 8.0), "b": adapter(2, 12, 6.0)}


def oracle(model: nn.Module, x: torch.Tensor, weights: dict[str, float]) -> torch.Tensor:
    """Float64: diffusers' dequantized W of each layer plus sum w * alpha/r * B A, then the bias."""
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    h = x.double().cpu()
    for p, layer in zip(PATHS, model):
        base = layer.base
        W = dequantize_gguf_tensor(base.weight).double().cpu()
        for name, w in weights.items():
            m = ADS[name].modules[p]
            W += w * m.scaling() * (m.B.double() @ m.A.double())
        h = h @ W.t() + base.bias.double().cpu()
    return h


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all()
    return float((y.detach().double().cpu() - ref).abs().max() / ref.abs().max())


@pytest.fixture
def cache_on():
    """The merged-weight cache on (off on CPU by default): a GGUF layer must still keep no copy."""
    fdlora.set_merge_cache(1 << 30)
    yield
    fdlora.set_merge_cache("auto")


def setup(qtype: str, device: str):
    model = gguf_net(qtype, device)
    h = fdlora.inject(model, PATHS, max_slots=4, max_rank=16)
    for name, ad in ADS.items():
        h.add_adapter(ad, name, activate=False)
    return model, h


def expected_route(layer, qtype: str) -> str:
    kernel = qtype == "Q8_0" and layer.selection.name in ("triton", "triton+cuda")
    return layer_gguf.KERNEL if kernel else layer_gguf.TORCH


def no_delta(monkeypatch, model) -> None:
    """Make the per-call delta ops raise: a call that reaches them did not take the merge path."""
    def refuse(*a, **k):
        raise AssertionError("the per-call delta ran")

    for layer in model:
        for op in ("lora_delta", "lora_delta_rows", "lora_linear"):
            if hasattr(layer._ops, op):
                monkeypatch.setattr(layer._ops, op, refuse)


BLENDS = [pytest.param({"a": 1.0}, id="one"), pytest.param({"a": 0.7, "b": -0.4}, id="blend2")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("weights", BLENDS)
def test_blend_merges_into_the_dequantized_weight(qtype, device, weights, monkeypatch, cache_on):
    model, h = setup(qtype, device)
    # 80 rows: the merge moves fewer bytes than the delta (a generator of its own: no dependence on test order)
    x = torch.randn(2, 40, SIZES[0][0], generator=torch.Generator().manual_seed(0)).to(device)
    stored = [layer.base.weight.as_tensor().clone() for layer in model]
    h.set_adapters(list(weights), list(weights.values()))
    with torch.no_grad():
        y_delta = model_without_merge(model, x, monkeypatch)
        with monkeypatch.context() as m:
            no_delta(m, model)
            y = model(x)
    for layer in model:
        assert layer._dequant == (expected_route(layer, qtype), layer_gguf)
        assert layer.gguf_path == layer.merge_path == layer._dequant.how, layer.path
        assert layer.merged.buf is None and not layer.merged.groups
    assert fdlora.merge_cache_bytes() == 0
    assert all(torch.equal(layer.base.weight.as_tensor(), s) for layer, s in zip(model, stored))
    want = oracle(model, x, weights)
    assert rel(y, want) < 1e-5
    assert rel(y, y_delta.double().cpu()) < 1e-5
    assert rel(oracle(model, x, {}).float(), want) > 1e-2, "the LoRA must visibly change the output"


def model_without_merge(model: nn.Module, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    """The same call on the regular path (base(x) + the per-call delta)."""
    with monkeypatch.context() as m:
        m.setattr(layer_gguf, "forward", lambda layer, x: None)
        return model(x)


@pytest.mark.parametrize("device", DEVICES)
def test_few_rows_keep_the_delta_unless_the_kernel_merges(device):
    """2 rows: merging moves more bytes than the delta, so the torch route keeps base + delta; the Q8_0 kernel, which
    replaces diffusers' dequantization anyway, merges whatever the rows."""
    model, h = setup("Q8_0", device)
    h.set_adapters(["a"], [1.0])
    x = torch.randn(2, SIZES[0][0], device=device)
    with torch.no_grad():
        y = model(x)
    for layer in model:
        assert layer.gguf_path == (layer_gguf.KERNEL if layer._dequant.how == layer_gguf.KERNEL else layer_gguf.DELTA)
    assert rel(y, oracle(model, x, {"a": 1.0})) < 1e-5
    assert not layer_gguf.merge_pays(2, 96, 64) and layer_gguf.merge_pays(80, 96, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", QTYPES)
def test_per_sample_autograd_and_hooked_calls_take_the_regular_path(qtype, device):
    model, h = setup(qtype, device)
    x = torch.randn(2, 40, SIZES[0][0], device=device)
    h.set_adapters(["a", "b"], [0.7, -0.4])

    def fresh():
        for layer in model:
            layer.__dict__["gguf_path"] = None

    fresh()
    with torch.no_grad(), h.per_sample(["a", "b"]):
        y = model(x)
    assert all(layer.gguf_path is None for layer in model)
    assert rel(y[:1], oracle(model, x[:1], {"a": 1.0})) < 1e-5
    assert rel(y[1:], oracle(model, x[1:], {"b": 1.0})) < 1e-5

    xg = x.clone().requires_grad_()
    y = model(xg)
    y.sum().backward()
    assert all(layer.gguf_path is None for layer in model)
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    assert rel(y, oracle(model, x, {"a": 0.7, "b": -0.4})) < 1e-5

    for attr in ("_diffusers_hook", "_hf_hook"):  # a hook manages the base (offload, layerwise casting)
        model[0].base.__dict__[attr] = types.SimpleNamespace(hooks={})
        with torch.no_grad():
            y = model(x)
        assert model[0].gguf_path is None
        assert rel(y, oracle(model, x, {"a": 0.7, "b": -0.4})) < 1e-5
        del model[0].base.__dict__[attr]


@pytest.mark.parametrize("device", DEVICES)
def test_an_adapter_switch_and_a_disabled_model_follow(device):
    """W' is made per call from the device-side scales: switching and disabling need nothing else."""
    model, h = setup("Q8_0", device)
    x = torch.randn(2, 40, SIZES[0][0], device=device)
    with torch.no_grad():
        for weights in ({"a": 1.0}, {"b": 0.5}, {"a": 0.2, "b": 0.9}):
            h.set_adapters(list(weights), list(weights.values()))
            assert rel(model(x), oracle(model, x, weights)) < 1e-5
        h.disable()
        assert rel(model(x), oracle(model, x, {})) < 1e-5


def test_the_kept_launch_is_not_copied():
    """The launch a layer keeps (bound to its weight's bytes and its bank) is derived state: copies and pickles of a
    layer start without it (diffusers' GGUFParameter itself does not deep-copy, so the holder is checked alone)."""
    kept = dequant.Kept()
    kept.key, kept.ready = (1, 2), object()
    for twin in (copy.deepcopy(kept), pickle.loads(pickle.dumps(kept))):
        assert type(twin) is dequant.Kept and twin.key is None and twin.ready is None


def test_plain_layers_take_no_merge_route():
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    fdlora.inject(model, PATHS)
    assert all(layer._dequant is None for layer in model)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERPRET, reason="this process already interprets")
def test_under_the_interpreter():
    """The tests above again with TRITON_INTERPRET=1: the kernel cases, and the layers on the Triton backend (Q8_0
    through the kernel)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", str(Path(__file__))]
    proc = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreter tests failed (rc={proc.returncode}):\n{out[-6000:]}"
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= len(CASES) + 11, out[-3000:]
