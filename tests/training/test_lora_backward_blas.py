"""The cuBLAS LoRA backward (fdlora.kernels.ops.lora_train.lora_train_linear_backward_blas: what CUDA runs for
half-precision activations) against the float64 oracle, on the half-precision cases of the Triton kernel's table, on
CPU and (marked gpu) through the registered op on CUDA."""

from __future__ import annotations

import pytest
import torch

from fdlora.kernels.ops import lora_train as ref

from .test_lora_backward_kernel import CASES, _check

HALF = [c for c in CASES if c[5] in (torch.float16, torch.bfloat16)] + [
    ("M64-K48-N80-r16-bf16-W-strided", 64, 48, 80, 16, torch.bfloat16, True, True, torch.float32),
    ("M0-K16-N16-r4-fp16-W", 0, 16, 16, 4, torch.float16, True, False, torch.float32)]


@pytest.mark.parametrize("case", HALF, ids=[c[0] for c in HALF])
def test_cpu(case):
    _check(case, "cpu", ref.lora_train_linear_backward_blas)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", HALF, ids=[c[0] for c in HALF])
def test_cuda_op(case):
    import fdlora.kernels.train_ops  # noqa: F401

    _check(case, "cuda", torch.ops.fdlora.lora_train_linear_backward)


@pytest.mark.parametrize("case", HALF, ids=[c[0] for c in HALF])
def test_half_pair_cpu(case):
    """The eager half-precision pair (forward keeps h, A and s B in half precision; backward reuses them) against
    the float64 oracle: the forward's y and h, then the backward from what the forward returned."""
    _, M, K, N, r, dtype, with_W, strided, _ = case
    g = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=g).to(dtype)
    if strided:
        x = torch.randn(M, 2 * K, generator=g).to(dtype)[:, ::2]
    A, B = torch.randn(r, K, generator=g) / K ** 0.5, torch.randn(N, r, generator=g)
    W = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype) if with_W else None
    y0 = None if with_W else torch.randn(M, N, generator=g).to(dtype)
    scale, gy = torch.tensor(0.75), torch.randn(M, N, generator=g).to(dtype)
    y, h, As, Bs = ref.lora_train_linear_half(x, x, y0, W, None, A, B, scale)
    want_y, want_h = ref.lora_train_linear(*[t.double() if t is not None else None
                                             for t in (x, x, y0, W, None, A, B, scale)])
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for name, a, b in (("y", y, want_y), ("h", h, want_h)):
        if b.numel():
            assert ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() < tol, name
    assert h.dtype == As.dtype == dtype and Bs.dtype == y.dtype
    got = ref.lora_train_linear_backward_half(gy, x, h, W, As, Bs, scale)
    want = ref.lora_train_linear_backward(*[t.double() if t is not None else None for t in (gy, x, h, W, A, B, scale)])
    for name, a, b in zip(("grad_u", "grad_A", "grad_B"), got, want):
        assert a.shape == b.shape and not torch.isnan(a).any(), name
        if b.numel():
            assert ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() < tol, name
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32
