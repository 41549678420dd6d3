"""Reference backend ops vs a float64 oracle, with bounds from eager PyTorch's own error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fdlora.kernels.ops import lora_conv_delta, lora_delta, lora_delta_rows, lora_expand_add, lora_shrink
from fdlora.testing import bound, eager_delta, max_err, oracle_delta

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_bank(S, R, K, N, ranks, dtype, gen):
    A = torch.zeros(S, R, K, dtype=dtype)
    B = torch.zeros(N, S, R, dtype=dtype)
    for s, r in enumerate(ranks):
        A[s, :r] = torch.randn(r, K, generator=gen).to(dtype) / K**0.5
        B[:, s, :r] = torch.randn(N, r, generator=gen).to(dtype)
    return A, B, torch.tensor(ranks + [0] * (S - len(ranks)), dtype=torch.int32)


CASES = [  # id, M, K, N, S, R, ranks, G
    ("odd-1slot-r1", 7, 13, 11, 1, 16, [1], 1),
    ("odd-3slot-mixed", 33, 29, 17, 3, 32, [4, 16, 32], 1),
    ("blend-zero-weight", 16, 64, 48, 4, 16, [8, 8, 16, 3], 1),
    ("segments-G3", 21, 24, 40, 3, 16, [2, 5, 16], 3),
    ("segments-G5-unaligned", 35, 17, 9, 2, 16, [16, 7], 5),
    ("r128", 5, 40, 24, 2, 128, [128, 100], 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lora_delta_matches_oracle(case, dtype):
    _, M, K, N, S, R, ranks, G = case
    gen = torch.Generator().manual_seed(hash(case[0]) % 2**31)
    A, B, rk = make_bank(S, R, K, N, ranks, dtype, gen)
    x = torch.randn(M, K, generator=gen).to(dtype)
    y0 = torch.randn(M, N, generator=gen).to(dtype)
    scale = torch.rand(S, generator=gen) * 2
    scale[-1] = 0.0 if S > 1 else scale[-1]  # a zero-weight slot
    gw = torch.rand(G, S, generator=gen)
    row_scale = (gw * scale).repeat_interleave(M // G, 0)
    ref = y0.double() + oracle_delta(x, A, B, row_scale)
    eager = y0 + eager_delta(x, A, B, row_scale)
    y = y0.clone()
    lora_delta(y, x, A, B, scale, gw, rk)
    assert y.dtype == dtype
    assert max_err(y, ref) <= bound(max_err(eager, ref), ref, dtype)
    # the split path gives the same answer
    y2 = y0.clone()
    lora_expand_add(y2, lora_shrink(x, A), B, scale, gw)
    assert torch.equal(y, y2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_lora_delta_rows_matches_oracle(dtype):
    gen = torch.Generator().manual_seed(3)
    M, K, N, S, R = 19, 24, 20, 5, 16
    A, B, rk = make_bank(S, R, K, N, [3, 16, 1, 8, 12], dtype, gen)
    x = torch.randn(M, K, generator=gen).to(dtype)
    y0 = torch.randn(M, N, generator=gen).to(dtype)
    scale = torch.rand(S, generator=gen) + 0.5
    row_slot = torch.randint(-1, S, (M,), generator=gen, dtype=torch.int32)
    row_slot[0] = -1
    onehot = (row_slot.long()[:, None] == torch.arange(S)).float() * scale
    ref = y0.double() + oracle_delta(x, A, B, onehot)
    eager = y0 + eager_delta(x, A, B, onehot)
    y = y0.clone()
    lora_delta_rows(y, x, A, B, scale, row_slot, rk)
    assert max_err(y, ref) <= bound(max_err(eager, ref), ref, dtype)
    assert torch.equal(y[0], y0[0])  # -1 rows untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("G", [1, 2])
def test_conv_delta_matches_oracle(dtype, G):
    gen = torch.Generator().manual_seed(G)
    Bt, C, H, W, N, S, R = 2, 3, 9, 7, 5, 2, 16
    A = torch.zeros(S, R, C, 3, 3, dtype=dtype)
    Bw = torch.zeros(N, S, R, dtype=dtype)
    A[0, :4] = torch.randn(4, C, 3, 3, generator=gen).to(dtype)
    A[1, :2] = torch.randn(2, C, 3, 3, generator=gen).to(dtype)
    Bw[:, 0, :4] = torch.randn(N, 4, generator=gen).to(dtype)
    Bw[:, 1, :2] = torch.randn(N, 2, generator=gen).to(dtype)
    x = torch.randn(Bt, C, H, W, generator=gen).to(dtype)
    y0 = torch.randn(Bt, N, 5, 4, generator=gen).to(dtype)
    scale = torch.tensor([0.5, 2.0])
    gw = torch.rand(G, S, generator=gen)
    ref = y0.double().clone()
    for b in range(Bt):
        w = (gw[b * G // Bt] * scale).double()
        for s in range(S):
            h = F.conv2d(x[b : b + 1].double(), A[s].double(), stride=2, padding=1)
            ref[b] += w[s] * F.conv2d(h, Bw[:, s].double()[:, :, None, None])[0]
    y = y0.clone()
    lora_conv_delta(y, x, A, Bw, scale, gw, (2, 2), (1, 1), (1, 1))
    tol = 8 * {torch.float32: 1.2e-7, torch.bfloat16: 7.9e-3}[dtype] * float(ref.abs().max())
    assert max_err(y, ref) <= tol
