"""LoRA merged into a torchao weight-only base's per-call dequantization (fdlora.kernels.triton.merge.dequant_merge,
fdlora.layers.quant.dequant).

The kernel: int8 and float8 (e4m3fn, e5m2) values with a per-row or per-tensor fp32 scale, dequantized with the blend
merged in, against a float64 oracle (q * scale + sum_s scale_s B_s A_s) within a bound from eager PyTorch's error in
the output dtype; A/B rows past each slot's live rank (rounded up to 16), every weight of a zero-scale or empty slot,
and the output buffer are NaN, so a read or a skipped write fails; N and K are not multiples of the tile. With no
LoRA the output is `(q.float() * scale).to(dtype)` (torchao's `dequantize(dtype)`) bit for bit, in fp32 and fp16 (the
CPU interpreter truncates fp32 -> bf16 stores, so bf16 is checked on the GPU).

The layer: two nn.Linear layers quantized by torchao's own `quantize_` (int8 per row, per tensor, per group of 32;
float8 e4m3 per row; fp32 compute) with adapters loaded through fd-lora. Blend calls equal the float64 oracle and the
base(x) + delta path, never call the delta op, leave the quantized values and scales and the merged-weight cache
alone; per-sample, autograd, hooked and dynamically-quantized calls go the regular way. In this process the layers
are on the torch backend (torchao's dequantize + addmm_); a child process runs the same tests under
TRITON_INTERPRET=1, where per-row and per-tensor weights take the Triton kernel; `gpu` cases run both on CUDA.
"""

from __future__ import annotations

import importlib.util
import os
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
from fdlora.testing import bound, max_err

ROOT = Path(__file__).resolve().parents[2]
INTERPRET = env.triton_interpret()
HAS_TRITON = importlib.util.find_spec("triton") is not None
try:
    HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
except ModuleNotFoundError:  # the core-install job's import blocker raises instead of answering None
    HAS_TORCHAO = False
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QDTYPES = {"int8": torch.int8, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao not installed (pip install 'fd-lora[quant]')")


# --- the kernel ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    N: int  # not a multiple of the tile (BN = 16 interpreted, 64 on the GPU) where it can be
    K: int  # nor K (BK = 32 interpreted, 128 on the GPU)
    R: int  # bank rank capacity
    ranks: tuple[int, ...]  # live rank per slot, 0 = empty
    scales: tuple[float, ...]  # blend scale per slot, 0 = inactive
    q: str  # "int8", "e4m3", "e5m2"
    per: str  # "row" or "tensor"
    dtype: str  # output and A / B dtype
    b_scale: float = 1.0  # B's size: the LoRA must stand out above the dtype's rounding of W


CASES = [
    Case("int8-row-N40-K72-r16-fp32", 40, 72, 16, (16,), (0.5,), "int8", "row", "fp32"),
    Case("int8-tensor-N33-K100-R32-ranks5.32.12-zero-scale-fp32", 33, 100, 32, (5, 32, 12), (1.3, -0.7, 0.0), "int8",
         "tensor", "fp32"),
    Case("e4m3-row-N17-K50-ranks3.9-S2-fp16", 17, 50, 16, (3, 9), (0.25, 2.0), "e4m3", "row", "fp16"),
    Case("e5m2-row-N48-K40-R64-ranks1.0.64.20-empty-and-zero-fp32", 48, 40, 64, (1, 0, 64, 20), (0.8, 0.5, -0.3, 0.0),
         "e5m2", "row", "fp32"),
    Case("e4m3-tensor-N20-K36-r16-fp32", 20, 36, 16, (16,), (-1.1,), "e4m3", "tensor", "fp32"),
    Case("int8-row-N24-K96-all-scales-zero-fp16", 24, 96, 16, (16, 8), (0.0, 0.0), "int8", "row", "fp16"),
]
GPU_CASES = [
    # (b_scale: the largest W is ~1.3 (int8) / ~1.6 (e4m3), so bf16's allowed error is ~0.05-0.06; the LoRA's largest
    # entry must clear twice that, and with A ~ 1/sqrt(K) it shrinks as K grows)
    Case("int8-row-N72-K416-ranks16.7-S2-bf16", 72, 416, 16, (16, 7), (0.9, -0.4), "int8", "row", "bf16", b_scale=100),
    Case("int8-row-flux-N3072-K3072-r16-S4-blend-bf16", 3072, 3072, 16, (16, 16, 16, 16), (0.7, 0.5, 0.3, 0.2),
         "int8", "row", "bf16", b_scale=128),
    Case("e4m3-row-flux-N3072-K12288-r16-S4-one-active-bf16", 3072, 12288, 16, (16, 16, 16, 16), (1.0, 0.0, 0.0, 0.0),
         "e4m3", "row", "bf16", b_scale=128),
    Case("e4m3-tensor-N100-K200-r16-bf16", 100, 200, 16, (16,), (0.6,), "e4m3", "tensor", "bf16", b_scale=8),
]


def weight(c: Case, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [N, K], fp32 scale [N, 1] or [1, 1]) as torchao keeps them; rows' scales span four decades."""
    g = torch.Generator().manual_seed(c.N)
    if c.q == "int8":
        q = torch.randint(-127, 128, (c.N, c.K), generator=g, dtype=torch.int8)
    else:
        q = (torch.randn(c.N, c.K, generator=g) * 40).to(QDTYPES[c.q])
    rows = c.N if c.per == "row" else 1
    s = torch.logspace(-4, 0, rows)[torch.randperm(rows, generator=g)].reshape(rows, 1) / 100
    return q.to(device), s.to(device)


def bank(c: Case, device: str):
    """(A [S, R, K], B [N, S, R] as the kernel sees them (NaN where it must not read), the clean pair, scale, ranks)."""
    g = torch.Generator().manual_seed(7)
    S, dt = len(c.ranks), DTYPES[c.dtype]
    A = torch.randn(S, c.R, c.K, generator=g) / c.K ** 0.5
    B = torch.randn(c.N, S, c.R, generator=g) * c.b_scale / 100
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
    from fdlora.kernels.triton.merge import dequant_merge

    dt = DTYPES[c.dtype]
    q, qs = weight(c, device)
    A, B, clean_A, clean_B, scale, ranks = bank(c, device)
    S = len(c.ranks)
    ones = torch.ones(1, S, device=device)
    out = torch.full((c.N, c.K), float("nan"), dtype=dt, device=device)
    got = dequant_merge.dequant_merge(q, qs, A, B, scale, ones, ranks, dt, out=out)
    assert got is out
    W64 = q.double().cpu() * qs.double().cpu()
    want = W64 + torch.einsum("s,nsr,srk->nk", scale.double().cpu(), clean_B.double().cpu(), clean_A.double().cpu())
    base = (q.float() * qs).to(dt)  # eager PyTorch in dt: torchao's dequantize(dt), plus each slot's scaled B A in dt
    eager = base + sum((clean_B[:, s].float() * c.scales[s]).to(dt) @ clean_A[s] for s in range(S))
    allowed = bound(max_err(eager.cpu(), want), want, dt)
    err = max_err(got.cpu(), want)
    assert err <= allowed, (c.id, err, allowed)
    if any(c.scales):
        assert max_err(base.cpu(), want) > 2 * allowed, "the LoRA must visibly change W' (a kernel without it fails)"
    nolora = dequant_merge.dequant_merge(q, qs, A, B, scale, ones, ranks, dt, lora=False)
    if dt != torch.bfloat16 or device == "cuda":
        assert torch.equal(nolora, base), "without the LoRA the kernel is torchao's dequantize(dtype), bit for bit"
        if not any(c.scales):
            assert torch.equal(got, base)


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


def test_kernel_refuses_what_it_cannot_read():
    pytest.importorskip("triton")
    from fdlora.errors import FdLoraError
    from fdlora.kernels.triton.merge import dequant_merge

    A, B, q = torch.zeros(1, 16, 64), torch.zeros(8, 1, 16), torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(FdLoraError, match="2-D int8 / float8"):
        dequant_merge.check(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8), A, B)
    with pytest.raises(FdLoraError, match="per-group scales"):
        dequant_merge.check(q, torch.ones(8, 2), A, B)
    with pytest.raises(FdLoraError, match="do not fit"):
        dequant_merge.check(q[:, :32], torch.ones(8), A, B)
    assert dequant_merge.check(q, torch.ones(8, 1), A, B) == (8, 64, 1)
    assert dequant_merge.check(q, torch.ones(1, 1), A, B) == (8, 64, 0)


# --- the layer ----------------------------------------------------------------------------------------------------
SIZES = [(64, 96), (96, 64)]  # (in, out) per layer
PATHS = ["0", "1"]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[gpu, needs_cuda])]
CONFIGS = ["int8-row", "int8-tensor", "int8-group32", "float8-row"]


def torchao_config(name: str):
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, PerGroup, PerTensor

    return {"int8-row": Int8WeightOnlyConfig, "int8-tensor": lambda: Int8WeightOnlyConfig(granularity=PerTensor()),
            "int8-group32": lambda: Int8WeightOnlyConfig(granularity=PerGroup(32)),
            "float8-row": Float8WeightOnlyConfig}[name]()


def torchao_net(config: str, device: str) -> nn.Module:
    """Two nn.Linear layers (fp32, float biases) quantized in place by torchao's quantize_."""
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(k, n) for k, n in SIZES)).to(device)
    quantize_(model, torchao_config(config))
    return model


def adapter(seed: int, rank: int, alpha: float) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    return LoraAdapter({p: ModuleLora(torch.randn(rank, k, generator=g) / 4, torch.randn(n, rank, generator=g) / 4,
                                      alpha) for p, (k, n) in zip(PATHS, SIZES)})


ADS = {"a": adapter(1, 4, 8.0), "b": adapter(2, 12, 6.0)}


@torch.no_grad()
def oracle(model: nn.Module, x: torch.Tensor, weights: dict[str, float]) -> torch.Tensor:
    """Float64: torchao's dequantized W of each layer (q * scale, exact in fp32 here) plus sum w * alpha/r * B A, then
    the bias."""
    h = x.double().cpu()
    for p, layer in zip(PATHS, model):
        base = layer.base
        W = base.weight.dequantize(torch.float32).double().cpu()
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
    """The merged-weight cache on (off on CPU by default): a torchao layer must still keep no copy."""
    fdlora.set_merge_cache(1 << 30)
    yield
    fdlora.set_merge_cache("auto")


def setup(config: str, device: str):
    model = torchao_net(config, device)
    h = fdlora.inject(model, PATHS, max_slots=4, max_rank=16)
    for name, ad in ADS.items():
        h.add_adapter(ad, name, activate=False)
    return model, h


def expected_route(layer, config: str) -> str:
    kernel = layer.selection.name in ("triton", "triton+cuda") and config != "int8-group32"
    return dequant.KERNEL if kernel else dequant.TORCH


def no_delta(monkeypatch, model) -> None:
    """Make the per-call delta ops raise: a call that reaches them did not take the merge path."""
    def refuse(*a, **k):
        raise AssertionError("the per-call delta ran")

    for layer in model:
        for op in ("lora_delta", "lora_delta_rows", "lora_linear"):
            if hasattr(layer._ops, op):
                monkeypatch.setattr(layer._ops, op, refuse)


def without_merge(model: nn.Module, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    """The same call on the regular path (base(x) + the per-call delta)."""
    with monkeypatch.context() as m:
        m.setattr(dequant, "forward", lambda layer, x: None)
        return model(x)


def stored(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(lay.base.weight.qdata.clone(), lay.base.weight.scale.clone()) for lay in model]


def untouched(model: nn.Module, before: list) -> bool:
    return all(torch.equal(lay.base.weight.qdata.view(torch.uint8), q.view(torch.uint8))
               and torch.equal(lay.base.weight.scale, s) for lay, (q, s) in zip(model, before))


BLENDS = [pytest.param({"a": 1.0}, id="one"), pytest.param({"a": 0.7, "b": -0.4}, id="blend2")]


@needs_torchao
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("weights", BLENDS)
def test_blend_merges_into_the_dequantized_weight(config, device, weights, monkeypatch, cache_on):
    model, h = setup(config, device)
    x = torch.randn(2, 40, SIZES[0][0], device=device)  # 80 rows: the merge moves fewer bytes than the delta
    before = stored(model)
    h.set_adapters(list(weights), list(weights.values()))
    with torch.no_grad():
        y_delta = without_merge(model, x, monkeypatch)
        base = model[1].base(model[0].base(x))
        with monkeypatch.context() as m:
            no_delta(m, model)
            y = model(x)
    for layer in model:
        assert layer._dequant == (expected_route(layer, config), dequant)
        assert layer.merge_path == layer._dequant.how, layer.path
        assert layer.merged.buf is None and not layer.merged.groups
    assert fdlora.merge_cache_bytes() == 0
    assert untouched(model, before)
    want = oracle(model, x, weights)
    assert rel(y, want) < 1e-5
    assert rel(y, y_delta.double().cpu()) < 1e-5
    assert rel(base, oracle(model, x, {})) < 1e-5  # the oracle's W is the one torchao's own linear computes with
    assert rel(base, want) > 1e-2, "the LoRA must visibly change the output"


@needs_torchao
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ["int8-row", "int8-group32"])
def test_few_rows_keep_the_delta_unless_the_kernel_merges(config, device):
    """2 rows: merging moves more bytes than the delta, so the torch route keeps base + delta; the kernel, which
    replaces torchao's own per-call conversion, merges whatever the rows."""
    model, h = setup(config, device)
    h.set_adapters(["a"], [1.0])
    x = torch.randn(2, SIZES[0][0], device=device)
    with torch.no_grad():
        y = model(x)
    for layer in model:
        assert layer.merge_path == (dequant.KERNEL if layer._dequant.how == dequant.KERNEL else dequant.DELTA)
    assert rel(y, oracle(model, x, {"a": 1.0})) < 1e-5
    assert not dequant.merge_pays(2, 96, 64) and dequant.merge_pays(80, 96, 64)


@needs_torchao
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ["int8-row", "float8-row"])
def test_per_sample_autograd_and_hooked_calls_take_the_regular_path(config, device):
    model, h = setup(config, device)
    x = torch.randn(2, 40, SIZES[0][0], device=device)
    h.set_adapters(["a", "b"], [0.7, -0.4])

    def fresh():
        for layer in model:
            layer.__dict__["merge_path"] = None

    fresh()
    with torch.no_grad(), h.per_sample(["a", "b"]):
        y = model(x)
    assert all(layer.merge_path is None for layer in model)
    assert rel(y[:1], oracle(model, x[:1], {"a": 1.0})) < 1e-5
    assert rel(y[1:], oracle(model, x[1:], {"b": 1.0})) < 1e-5

    xg = x.clone().requires_grad_()
    y = model(xg)
    y.sum().backward()
    assert all(layer.merge_path is None for layer in model)
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    assert rel(y, oracle(model, x, {"a": 0.7, "b": -0.4})) < 1e-5

    base0 = model[0].base
    for attr in ("_diffusers_hook", "_hf_hook"):  # a hook manages the base (offload, layerwise casting)
        base0.__dict__[attr] = types.SimpleNamespace(hooks={})
        with torch.no_grad():
            y = model(x)
        assert model[0].merge_path is None
        assert rel(y, oracle(model, x, {"a": 0.7, "b": -0.4})) < 1e-5
        del base0.__dict__[attr]
    seen = []
    hook = base0.register_forward_hook(lambda m, a, out: seen.append(out.shape))  # a plain hook must still run
    with torch.no_grad():
        y = model(x)
    hook.remove()
    assert seen and model[0].merge_path is None
    assert rel(y, oracle(model, x, {"a": 0.7, "b": -0.4})) < 1e-5


@needs_torchao
def test_an_adapter_switch_and_a_disabled_model_follow():
    """W' is made per call from the device-side scales: switching and disabling need nothing else."""
    model, h = setup("int8-row", "cpu")
    x = torch.randn(2, 40, SIZES[0][0])
    with torch.no_grad():
        for weights in ({"a": 1.0}, {"b": 0.5}, {"a": 0.2, "b": 0.9}):
            h.set_adapters(list(weights), list(weights.values()))
            assert rel(model(x), oracle(model, x, weights)) < 1e-5
        h.disable()
        assert rel(model(x), oracle(model, x, {})) < 1e-5


@needs_torchao
def test_dynamic_activation_quantization_and_plain_layers_take_no_route():
    """With activation quantization torchao runs an int8 GEMM (no per-call W to merge into); plain float layers have
    the merged-weight cache."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = nn.Sequential(*(nn.Linear(k, n) for k, n in SIZES))
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    fdlora.inject(model, PATHS)
    assert all(layer._dequant is None for layer in model)
    plain = nn.Sequential(*(nn.Linear(k, n) for k, n in SIZES))
    fdlora.inject(plain, PATHS)
    assert all(layer._dequant is None for layer in plain)


@needs_torchao
def test_x_in_another_dtype_takes_the_regular_path():
    """torchao's float8 matmul needs x in the weight's dtype; one rule for both kinds: W' only in the weight's."""
    model, h = setup("int8-row", "cpu")
    h.set_adapters(["a"], [1.0])
    for layer in model:
        layer.__dict__["merge_path"] = None
    x = torch.randn(2, 40, SIZES[0][0], dtype=torch.bfloat16)  # over fp32 weights: torchao's int8 linear follows x
    with torch.no_grad():
        y = model(x)
    assert all(layer.merge_path is None for layer in model)
    assert y.dtype == torch.bfloat16 and rel(y, oracle(model, x, {"a": 1.0})) < 2e-2


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERPRET, reason="this process already interprets")
def test_under_the_interpreter():
    """The tests above again with TRITON_INTERPRET=1: the kernel cases, and the layers on the Triton backend
    (per-row and per-tensor weights through the kernel)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", str(Path(__file__))]
    proc = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreter tests failed (rc={proc.returncode}):\n{out[-6000:]}"
    passed = re.search(r"(\d+) passed", out)
    want = len(CASES) + 1 + (len(CONFIGS) * len(BLENDS) + 2 + 2 + 3 if HAS_TORCHAO else 0)
    assert passed and int(passed.group(1)) >= want, out[-3000:]
