"""The cuBLAS LoRA backward (fdlora.kernels.reference.lora_train.lora_train_linear_backward_blas: what CUDA runs for
half-precision activations) against the float64 oracle, on the half-precision cases of the Triton kernel's table, on
CPU and (marked gpu) through the registered op on CUDA."""

from __future__ import annotations

import pytest
import torch

from fdlora.kernels.reference import lora_train as ref

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
