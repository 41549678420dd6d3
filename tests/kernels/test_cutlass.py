"""The CUTLASS LoRA-fused GEMM (fdlora/kernels/cutlass) against a float64 oracle, and its error when it is not built.

The GPU cases need an sm_90 device and the library built by benchmarks/build_cutlass.sh (FDLORA_CUTLASS_LIB
or the cache); they skip otherwise. The bank is what fdlora's banks hold: zeros past each slot's rank.
"""

from __future__ import annotations

import pytest
import torch
from triton_cases import HAS_CUDA

from fdlora import env
from fdlora.errors import BackendUnavailableError
from fdlora.kernels.cutlass import lib
from fdlora.kernels.reference import lora_linear as reference_linear


def test_missing_library_names_the_build_step(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FDLORA_CUTLASS_LIB", str(tmp_path / "absent.so"))
    monkeypatch.setattr(lib, "_lib", None)
    with pytest.raises(BackendUnavailableError, match="build_cutlass.sh"):
        lib.load()


def _built() -> bool:
    return HAS_CUDA and torch.cuda.get_device_capability() == (9, 0) and env.cutlass_lib().is_file()


CASES = [  # M, K, N, R, ranks (S = len), bias, dtype
    (300, 200, 136, 8, [8], True, torch.bfloat16),
    (1, 64, 8, 16, [16], True, torch.float16),
    (777, 1040, 520, 16, [16, 5, 0], True, torch.bfloat16),
    (1000, 512, 264, 32, [32, 17], False, torch.float16),
    (2048, 1280, 1280, 16, [16] * 4, True, torch.bfloat16),
    (515, 4104, 1288, 64, [64], True, torch.float16),
    (64, 128, 2056, 24, [24, 3], False, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-R{c[3]}x{len(c[4])}-{c[6]}")
def test_lora_gemm_matches_oracle(case) -> None:
    if not _built():
        pytest.skip("needs an sm_90 GPU and the library from benchmarks/build_cutlass.sh")
    M, K, N, R, ranks, with_bias, dtype = case
    S = len(ranks)
    g = torch.Generator(device="cuda").manual_seed(M + K + N)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    W = torch.randn(N, K, device="cuda", generator=g).div_(K**0.5).to(dtype)
    bias = torch.randn(N, device="cuda", generator=g).to(dtype) if with_bias else None
    A = torch.randn(S, R, K, device="cuda", generator=g).div_(K**0.5).to(dtype)
    B = torch.randn(N, S, R, device="cuda", generator=g).div_(R**0.5).to(dtype)
    for s, r in enumerate(ranks):
        A[s, r:] = 0
        B[:, s, r:] = 0
    scale = torch.rand(S, device="cuda", generator=g) + 0.5
    weight = torch.rand(S, device="cuda", generator=g) + 0.25
    ranks_t = torch.tensor(ranks, device="cuda", dtype=torch.int32)

    y = lib.lora_gemm(x, W, bias, A, B, scale, weight, ranks_t, torch.full((M, N), float("nan"), device="cuda",
                                                                         dtype=dtype))
    oracle = x.double() @ W.double().T + (0 if bias is None else bias.double())
    base = oracle.clone()
    for s, r in enumerate(ranks):
        oracle += float(scale[s] * weight[s]) * ((x.double() @ A[s, :r].double().T) @ B[:, s, :r].double().T)
    eager = reference_linear(x, W, bias, A, B, scale, weight.view(1, -1), ranks_t)
    err = (y.double() - oracle).abs().max().item()
    tol = 2 * (eager.double() - oracle).abs().max().item() + 1e-3
    assert err <= tol, f"max error {err:.3e} > {tol:.3e} (2 x eager's own error)"
    if any(ranks):  # the delta is really there: dropping it would fail
        assert (oracle - base).abs().max().item() > 4 * tol
