"""The Triton LoRA backward (fdlora.kernels.triton.lora_backward) against the float64 torch oracle.

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
from fdlora.kernels.reference import lora_train as ref

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
        from fdlora.kernels.triton.lora_backward import lora_backward as fn

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
