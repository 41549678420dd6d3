"""GPU time of each GEMM of a trainable layer's eager LoRA forward + backward (the half-precision pair of
fdlora.kernels.ops.lora_train), one by one and in the alternative forms, at bench_train's shapes: which one
misses the memory roofline, and whether a weight gradient written in fp32 by the GEMM itself (out_dtype, the current
form) costs more than a GEMM in the activations' dtype plus a cast (what autograd runs for PEFT).

Per shape (M tokens, K in, N out, r 16, bf16 activations), median us over `--repeats` CUDA-event timings and the
bytes each form must move at least, as GB/s:

    h       u As^T                       [M, K] @ [K, r]
    delta   y.addmm_(h, Bs^T)            in place, vs torch.addmm(y, h, Bs^T) (a copy of y first)
    g       gy Bs                        [M, N] @ [N, r]
    gB      gy^T h -> fp32               out_dtype, vs bf16 GEMM + .float(), vs (h^T gy)^T with out_dtype
    gA      g^T u -> fp32                out_dtype, vs bf16 GEMM + .float(), vs (u^T g)^T with out_dtype
    gu      g As (+ gy W in place)       the LoRA part of grad_x, and the base part added into it

    python benchmarks/probes/profile_train_gemm.py --out $OUT/profile_train_gemm.json       # GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fdlora.testing import step_ms  # noqa: E402

# (case, M, K, N): bench_train's ViT-L/16 batch 64 (qkv, fc1, fc2), Llama-3-8B layer rows, SDXL attention (1024^2)
SHAPES = [("vit-qkv", 12608, 1024, 1024), ("vit-fc1", 12608, 1024, 4096), ("vit-fc2", 12608, 4096, 1024),
          ("llama-q", 8192, 4096, 4096), ("llama-kv", 8192, 4096, 1024), ("llama-up", 8192, 4096, 14336),
          ("llama-down", 8192, 14336, 4096), ("sdxl-640", 4096, 640, 640), ("sdxl-1280", 1024, 1280, 1280),
          ("sdxl-text-kv", 77, 2048, 1280)]


def median_us(fn, repeats: int) -> float:
    """Median us of single calls between CUDA events (fdlora.testing.step_ms), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    return statistics.median(step_ms(fn, "cuda") for _ in range(repeats)) * 1e3


def forms(M: int, K: int, N: int, r: int = 16, dt=torch.bfloat16) -> dict:
    """name -> (callable, minimum bytes moved)."""
    g_ = torch.Generator("cuda").manual_seed(0)
    t = lambda *s: torch.randn(*s, device="cuda", generator=g_).to(dt)  # noqa: E731
    u, gy, y, W = t(M, K), t(M, N), t(M, N), t(N, K) / K ** 0.5
    As, Bs, h, g = t(r, K) / K ** 0.5, t(N, r), t(M, r), t(M, r)
    e = 2  # bytes per element
    f32 = torch.float32
    return {
        "h": (lambda: u @ As.t(), e * M * K),
        "delta_inplace": (lambda: y.addmm_(h, Bs.t()), 2 * e * M * N),
        "delta_copy": (lambda: torch.addmm(y, h, Bs.t()), 4 * e * M * N),
        "g": (lambda: gy @ Bs, e * M * N),
        "gB_out_dtype": (lambda: torch.mm(gy.t(), h, out_dtype=f32), e * M * N),
        "gB_bf16_cast": (lambda: (gy.t() @ h).float(), e * M * N),
        "gB_T_out_dtype": (lambda: torch.mm(h.t(), gy, out_dtype=f32).t(), e * M * N),
        "gA_out_dtype": (lambda: torch.mm(g.t(), u, out_dtype=f32), e * M * K),
        "gA_bf16_cast": (lambda: (g.t() @ u).float(), e * M * K),
        "gA_T_out_dtype": (lambda: torch.mm(u.t(), g, out_dtype=f32).t(), e * M * K),
        "gu": (lambda: g @ As, e * M * K),
        "gu_plus_base": (lambda: (g @ As).addmm_(gy, W), e * (M * N + 2 * M * K)),
        "base_grad_x": (lambda: gy @ W, e * (M * N + M * K)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = []
    for case, M, K, N in SHAPES:
        row = {"case": case, "M": M, "K": K, "N": N, "us": {}, "GBps": {}}
        for name, (fn, nbytes) in forms(M, K, N).items():
            us = median_us(fn, a.repeats)
            row["us"][name], row["GBps"][name] = round(us, 1), round(nbytes / us / 1e3, 1)
        rows.append(row)
        print(case, M, K, N, " ".join(f"{k}={v}" for k, v in row["us"].items()))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
