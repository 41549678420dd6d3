"""The Triton LoRA backward (fdlora.kernels.triton.train.lora_backward) against the float64 torch oracle.

On CPU the kernels run under TRITON_INTERPRET=1 in a child process (the variable must be set before triton
imports and must not leak into the rest of the suite); on a GPU the same cases run directly (marked gpu).
Bounds: fp32 1e-5 relative (IEEE dots), fp16/bf16 from the dtype's own rounding of the inputs and outputs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fdlora import env
from fdlora.kernels.ops import lora_train as ref

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.triton
CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

F32, BF16 = torch.float32, torch.bfloat16
# (id, M, K, N, r, dtype, with_W, strided, h's dtype: fp32, or bf16 as autocast saves it for an fp32 input)
CASES = [
    ("M33-K40-N24-r3-fp32", 33, 40, 24, 3, F32, False, False, F32),
    ("M17-K16-N50-r1-fp32-W", 17, 16, 50, 1, F32, True, False, F32),
    ("M40-K72-N33-r16-fp32-strided", 40, 72, 33, 16, F32, True, True, F32),
    ("M21-K24-N40-r20-fp16-W", 21, 24, 40, 20, torch.float16, True, False, F32),
    ("M18-K32-N16-r8-bf16", 18, 32, 16, 8, BF16, False, False, F32),
    ("M0-K16-N16-r4-fp32", 0, 16, 16, 4, F32, True, False, F32),
    ("M24-K32-N40-r8-fp32-autocast-h", 24, 32, 40, 8, F32, True, False, BF16),
]


def _inputs(M, K, N, r, dtype, with_W, strided, h_dtype, device):
    g = torch.Generator().manual_seed(M * 7 + K + r)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    gy = rnd(M, 2 * N)[:, ::2] if strided else rnd(M, N)
    u = rnd(M, K)
    A, B, W = rnd(r, K) / K ** 0.5, rnd(N, r), rnd(N, K) / K ** 0.5
    h = (u.double() @ A.double().t()).float()
    t = lambda x, d=dtype: x.to(device=device, dtype=d)  # noqa: E731
    return (t(gy), t(u), t(h, h_dtype), t(W) if with_W else None, t(A, torch.float32), t(B, torch.float32),
            torch.tensor(0.75, device=device))


def _check(case, device, fn=None):
    """`fn` (default: the Triton kernels) on the case's inputs against the float64 oracle."""
    _, M, K, N, r, dtype, with_W, strided, h_dtype = case
    if fn is None:
        from fdlora.kernels.triton.train.lora_backward import lora_backward as fn

    args = _inputs(M, K, N, r, dtype, with_W, strided, h_dtype, device)
    got = fn(*args)
    want = ref.lora_train_linear_backward(*[a.double() if a is not None else None for a in args])
    for name, a, b in zip(("grad_u", "grad_A", "grad_B"), got, want):
        assert a.shape == b.shape and not torch.isnan(a).any(), name
        if b.numel():
            err = ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            assert err < TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]:.0e}"
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32


@pytest.mark.skipif(not (HAS_TRITON and env.triton_interpret()), reason="runs under TRITON_INTERPRET=1 (see below)")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted(case):
    _check(case, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and CUDA), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda(case):
    _check(case, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and CUDA), reason="needs CUDA")
def test_cuda_op_dispatches_to_triton_and_matches_reference():
    """The registered op's CUDA kernel (Triton) against the same op on CPU (reference), through autograd."""
    import fdlora.kernels.train_ops  # noqa: F401

    torch.manual_seed(0)
    x = torch.randn(300, 256, dtype=torch.bfloat16)
    W = torch.randn(512, 256, dtype=torch.bfloat16) / 16
    A, B = torch.randn(16, 256) / 16, torch.randn(512, 16)
    grads = []
    for dev in ("cpu", "cuda"):
        xs = x.detach().to(dev).requires_grad_(True)  # detach: on CPU .to() would return the same leaf
        As, Bs = A.detach().to(dev).requires_grad_(True), B.detach().to(dev).requires_grad_(True)
        y, _ = torch.ops.fdlora.lora_train_linear(xs, None, None, W.to(dev), None, As, Bs,
                                                  torch.tensor(0.5, device=dev))
        y.float().square().mean().backward()
        grads.append([t.grad.float().cpu() for t in (xs, As, Bs)])
    for a, b in zip(*grads):
        assert ((a - b).abs().max() / b.abs().max()).item() < 3e-2


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(env.triton_interpret(), reason="this process already interprets")
def test_kernels_under_the_interpreter():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", __file__]
    proc = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= len(CASES), out[-3000:]


# The pieces of fdlora.kernels.triton.train.lora_backward_parts, each kernel alone against float64 products: ragged M and
# K / N, ranks 1..32, launch shapes with a row loop (f1), a ragged last row group (f2) or no loop (f0), both dot
# orientations (-t), g plain or as fp32 partials, grad_u written or added to in place. Inputs are bf16 values held
# in fp32 (the interpreter mis-computes bf16), so fp32's IEEE dots give 1e-5.
PART_CASES = [  # (id, M, K, N, r)
    ("M45-K70-N33-r16", 45, 70, 33, 16),
    ("M37-K40-N50-r8", 37, 40, 50, 8),
    ("M23-K48-N24-r32", 23, 48, 24, 32),
    ("M16-K16-N16-r5", 16, 16, 16, 5),
    ("M1-K20-N17-r1", 1, 20, 17, 1),
]
PART_TILES = ["16x16-w1-s1-f1", "16x16-w1-s1-f2", "16x32-w1-s1-f0-t", "32x16-w1-s1-f2-t"]
PART_PARAMS = [pytest.param(c, t, id=f"{c[0]}-{t}") for c in PART_CASES for t in PART_TILES]


def _part_inputs(M, K, N, r):
    g = torch.Generator().manual_seed(M * 3 + K + N + r)
    rnd = lambda *s: torch.randn(*s, generator=g).to(BF16).float()  # noqa: E731
    return rnd(M, N), rnd(M, K), rnd(M, r), rnd(N, r), rnd(r, K)


def _close(name, got, want, tol=1e-5):
    assert got.shape == want.shape and not torch.isnan(got).any(), name
    if want.numel():
        err = ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        assert err < tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.skipif(not (HAS_TRITON and env.triton_interpret()), reason="runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("case,tile", PART_PARAMS)
def test_parts_interpreted(case, tile):
    from fdlora.kernels.triton.train import lora_backward_parts as P

    _, M, K, N, r = case
    t = P.Tile.parse(tile)
    gy, u, h, Bs, As = _part_inputs(M, K, N, r)
    scale = torch.tensor(0.75)
    g64 = gy.double() @ Bs.double()
    g, grad_B = P.gy_piece(gy, h, Bs, scale, t)
    _close("g", g, g64)
    _close("grad_B", grad_B, 0.75 * gy.double().t() @ h.double())
    gp, _ = P.gy_piece(gy, h, Bs, scale, t, keep_partials=True)
    assert gp.dim() == 3 and gp.dtype == torch.float32
    _close("g partials", gp.sum(0), g64)
    for how, gin in (("plain", g), ("partials", gp)):
        _close(f"grad_A ({how} g)", P.grad_a(gin, u, t), g.double().t() @ u.double())
        out = torch.full((M, K), float("nan"))  # every element must be written
        _close(f"grad_u ({how} g)", P.grad_u(gin, As, out, False, t), g.double() @ As.double())
        base = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
        _close(f"grad_u += ({how} g)", P.grad_u(gin, As, base.clone(), True, t),
               base.double() + g.double() @ As.double())


@pytest.mark.skipif(not (HAS_TRITON and env.triton_interpret()), reason="runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("case,tile", [pytest.param(c, t, id=f"{c[0]}-{t}") for c in PART_CASES
                                       for t in ("16x16-w1-s1-f1", "16x16-w1-s1-f2", "32x16-w1-s1-f0")])
def test_x_pass_interpreted(case, tile):
    """grad_A and grad_u from one pass over u: every element of grad_u written (NaN-poisoned empty), grad_A summed
    over ragged row groups; then the fused backward against the oracle, with and without the base W."""
    from fdlora.kernels.triton.train import lora_backward_parts as P
    from fdlora.testing import poisoned_empty

    _, M, K, N, r = case
    gy, u, h, B, A = _part_inputs(M, K, N, r)
    g = gy @ B
    with poisoned_empty():
        grad_u, grad_A = P.x_pass(g, u, A, P.Tile.parse(tile))
    _close("grad_u", grad_u, g.double() @ A.double())
    _close("grad_A", grad_A, g.double().t() @ u.double())
    scale = torch.tensor(0.75)
    for W in (None, torch.randn(N, K, generator=torch.Generator().manual_seed(2)) / K ** 0.5):
        got = P.half_backward_fused(gy, u, h * 0.75, W, A, B * 0.75, None)
        want = ref.lora_train_linear_backward(*[None if t is None else t.double() for t in (gy, u, h, W, A, B, scale)])
        for name, a, b in zip(("grad_u", "grad_A", "grad_B"), got, want):
            _close(f"{name} (W={'yes' if W is not None else 'none'})", a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and CUDA), reason="needs CUDA")
@pytest.mark.parametrize("K,N", [(4096, 1024), (1000, 700)])
def test_fused_backward_cuda_bf16(K, N):
    """What eager steps run for large layers (train_ops.half_backward from FUSED_MIN elements of u): the fused pass
    against the cuBLAS half path on the same saved tensors, bf16, at a Llama-3-8B shape and a ragged one."""
    from fdlora.kernels import train_ops

    g = torch.Generator("cuda").manual_seed(0)
    M = max(train_ops.FUSED_MIN // K + 3, 64)
    gy = torch.randn(M, N, device="cuda", generator=g).to(BF16)
    x = torch.randn(M, K, device="cuda", generator=g).to(BF16)
    A = torch.randn(16, K, device="cuda", generator=g) / K ** 0.5
    B = torch.randn(N, 16, device="cuda", generator=g) / 4
    W = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(BF16)
    Ac, sA, _, sB = ref.half_casts(A, B, torch.tensor(2.0, device="cuda"), BF16)
    hs = torch.nn.functional.linear(x, sA)
    assert train_ops._fused() is not False
    got = train_ops.half_backward(gy, x, hs, W, Ac, sB, None)
    want = ref.lora_train_linear_backward_half(gy, x, hs, W, Ac, sB, None)
    for name, a, b in zip(("grad_x", "grad_A", "grad_B"), got, want):
        _close(name, a.double(), b.double(), 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and CUDA), reason="needs CUDA")
@pytest.mark.parametrize("tile", ["16x16-w1-s1-f2", "128x128-w4-s3-f2", "64x256-w4-s3-f0-t", "128x128-w8-s3-f1"])
@pytest.mark.parametrize("case", PART_CASES, ids=[c[0] for c in PART_CASES])
def test_parts_cuda_bf16(case, tile):
    """The same pieces compiled, in bf16 (g rounded to bf16 once, as the half path's GEMM writes it)."""
    from fdlora.kernels.triton.train import lora_backward_parts as P

    _, M, K, N, r = case
    t = P.Tile.parse(tile)
    gy, u, h, Bs, As = (x.to("cuda", BF16) for x in _part_inputs(M, K, N, r))
    scale = torch.tensor(0.75, device="cuda")
    g, grad_B = P.gy_piece(gy, h, Bs, scale, t)
    gd = (gy.double() @ Bs.double()).to(BF16).double()
    _close("g", g, gy.double() @ Bs.double(), 1e-2)
    _close("grad_B", grad_B, 0.75 * gy.double().t() @ h.double())
    gp, _ = P.gy_piece(gy, h, Bs, scale, t, keep_partials=True)
    for how, gin in (("plain", g), ("partials", gp)):
        _close(f"grad_A ({how} g)", P.grad_a(gin, u, t), gd.t() @ u.double(), 1e-2)
        out = torch.full((M, K), float("nan"), device="cuda", dtype=BF16)
        _close(f"grad_u ({how} g)", P.grad_u(gin, As, out, False, t), gd @ As.double(), 1e-2)


def test_tile_names_round_trip():
    pytest.importorskip("triton")
    from fdlora.kernels.triton.train.lora_backward_parts import Tile

    for name in PART_TILES + ["128x128-w4-s3-f2", "64x256-w8-s4-f0-t"]:
        assert Tile.parse(name).name == name
    with pytest.raises(ValueError, match="BMxBL"):
        Tile.parse("128x128-w4")


# lora_train_linear_backward_half composed from cuBLAS orientations and Triton pieces (lora_backward_parts'
# half_backward_plan, what the sweep times), against the float64 oracle on the half pair's saved tensors (fp32 here:
# the Triton pieces run interpreted on CPU).
TRI = "tri:16x16-w1-s1-f2"
PLANS = [
    ("all-mm", {}),
    ("mm-orientations", {"gy": "mm_t", "gA": "mm_t"}),
    ("split-M", {"gy": "bmm8", "gA": "bmm4"}),
    ("mixed-orientation-split", {"gy": "mm_gt", "gA": "bmm8"}),
    ("triton", {"gy": TRI, "gA": "tri:16x32-w1-s1-f1-t", "gu": "tri:32x16-w1-s1-f0"}),
    ("triton-partials", {"gy": TRI + "+p", "gA": TRI, "gu": "tri:16x16-w1-s1-f0"}),
    ("triton-gu-only", {"gy": "mm_bt", "gu": TRI}),
]
PLAN_CASES = [("M40-K72-N33-r16-W", 40, 72, 33, 16, True), ("M48-K24-N40-r8", 48, 24, 40, 8, False),
              ("M24-K32-N16-r32-W", 24, 32, 16, 32, True)]


@pytest.mark.skipif(not (HAS_TRITON and env.triton_interpret()), reason="runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("plan", [p[1] for p in PLANS], ids=[p[0] for p in PLANS])
@pytest.mark.parametrize("case", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_half_backward_plans(case, plan):
    _, M, K, N, r, with_W = case
    gy, x, h, B, A = _part_inputs(M, K, N, r)
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(2)) / K ** 0.5 if with_W else None
    scale = torch.tensor(0.75)
    h = x @ A.t()
    from fdlora.kernels.triton.train.lora_backward_parts import half_backward_plan

    fn = half_backward_plan(plan)
    got = fn(gy, x, h, W, A, B * scale, scale)
    want = ref.lora_train_linear_backward(*[t.double() if t is not None else None for t in (gy, x, h, W, A, B, scale)])
    for name, a, b in zip(("grad_u", "grad_A", "grad_B"), got, want):
        _close(name, a, b)
    none_u = fn(gy, x, h, W, A, B * scale, scale, need_u=False)
    assert none_u[0] is None
    _close("grad_A (need_u=False)", none_u[1], want[1])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_half_backward_plan_checks():
    from fdlora.kernels.triton.train.lora_backward_parts import half_backward_plan

    with pytest.raises(ValueError, match="neither"):
        half_backward_plan({"gA": "nope"})
    with pytest.raises(ValueError, match="partials"):
        half_backward_plan({"gy": TRI + "+p", "gA": "mm"})
    with pytest.raises(ValueError, match="unknown pieces"):
        half_backward_plan({"g": "mm"})


@pytest.mark.skipif(not (HAS_TRITON and env.triton_interpret()), reason="runs under TRITON_INTERPRET=1")
def test_parts_sweep_smoke(tmp_path):
    """benchmarks/probes/sweep_train_backward_parts.py --smoke: every candidate checked and timed at a tiny shape."""
    import importlib.util as iu

    path = Path(__file__).parents[2] / "benchmarks" / "probes" / "sweep_train_backward_parts.py"
    spec = iu.spec_from_file_location("sweep_train_backward_parts", path)
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--smoke", "--out", str(tmp_path / "s.json")])
    row = out["rows"][0]
    for piece, rows in row["pieces"].items():
        assert all("us" in v for v in rows.values()), (piece, rows)
    assert all(p["ms"] == p["ms"] for p in row["plans"].values()), row["plans"]
    assert (tmp_path / "s.json").exists()
