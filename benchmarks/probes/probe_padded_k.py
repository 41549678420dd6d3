# Measures: per-call LoRA forms against the cuBLAS base GEMM, GPU time, L2 flushed: merge into scratch per segment,
# base + per-segment delta (addmm, beta=1), the delta written first and the base GEMM accumulated onto it (beta=1 in
# the base GEMM's epilogue), and the LoRA as extra K columns of one GEMM (padded weight).
"""The padded-K form of a per-call LoRA: the weight stored as [W | B_1 .. B_n] (N x (K + n r)), the input widened to
[x | mask_i(x A_i^T)] (each row's shrink in its own segment's columns, zeros elsewhere), so one cuBLAS GEMM computes
the base and every segment's delta, with no per-segment copy of W and no second pass over the output. Compared, per
layer shape and segment count (rows split evenly into n adapters), with the base GEMM alone, merge into scratch per
segment (W + s B_i A_i, then the segment's GEMM), base + per-segment delta (shrink, then addmm into y: a second pass
over y), and delta first (shrink, expand written into y, then the base GEMM with beta = 1: y is read once more in the
base GEMM's epilogue instead of read and written by a small GEMM). Every
form is checked against a float64 reference on sampled rows, then timed as one CUDA graph replay with L2 flushed.

    python benchmarks/probes/probe_padded_k.py --out /tmp/padded_k.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's helpers (bench_llm.graphed)

SHAPES = [  # model, M (rows of the whole batch), K, N
    ("sdxl", 2048, 1280, 1280), ("sdxl", 2048, 1280, 10240), ("sdxl", 2048, 5120, 1280),
    ("sdxl", 8192, 640, 640), ("sdxl", 8192, 640, 5120), ("sdxl", 8192, 2560, 640),
    ("flux", 4608, 3072, 3072), ("flux", 4608, 3072, 12288), ("flux", 4608, 12288, 3072),
    ("llama", 2048, 4096, 4096), ("llama", 2048, 4096, 14336), ("llama", 2048, 14336, 4096),
    ("llama", 2048, 4096, 1024), ("sdxl", 154, 2048, 640), ("sdxl", 154, 2048, 1280),
]


def forms(x, W, A, B, scale, n):
    M, K = x.shape
    N, R = W.shape[0], A.shape[1]
    seg = M // n
    Wp = torch.empty(N, K + n * R, dtype=W.dtype, device=W.device)
    Wp[:, :K] = W
    for i in range(n):
        Wp[:, K + i * R:K + (i + 1) * R] = B[i]
    Wv = Wp[:, :K]
    Acat = torch.cat([A[i] for i in range(n)], 0) * scale  # (n R, K)
    mask = torch.zeros(M, n * R, dtype=x.dtype, device=x.device)
    for i in range(n):
        mask[i * seg:(i + 1) * seg, i * R:(i + 1) * R] = 1
    xp = torch.empty(M, K + n * R, dtype=x.dtype, device=x.device)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    scratch = torch.empty_like(W)
    S = torch.empty(M, n * R, dtype=x.dtype, device=x.device)

    def base():
        torch.mm(x, W.t(), out=y)

    def base_strided():
        torch.mm(x, Wv.t(), out=y)

    def merge_scratch():
        for i in range(n):
            torch.addmm(W, B[i], A[i], alpha=scale, out=scratch)
            torch.mm(x[i * seg:(i + 1) * seg], scratch.t(), out=y[i * seg:(i + 1) * seg])

    def addmm_delta():
        torch.mm(x, W.t(), out=y)
        for i in range(n):
            s = x[i * seg:(i + 1) * seg] @ A[i].t()
            y[i * seg:(i + 1) * seg].addmm_(s, B[i].t(), alpha=scale)

    def delta_first():
        for i in range(n):
            ys = y[i * seg:(i + 1) * seg]
            torch.addmm(ys, x[i * seg:(i + 1) * seg] @ A[i].t(), B[i].t(), beta=0, alpha=scale, out=ys)
        y.addmm_(x, W.t())  # the base GEMM, beta = 1

    def padded():
        xp[:, :K].copy_(x)
        torch.mm(x, Acat.t(), out=S)
        torch.mul(S, mask, out=xp[:, K:]) if n > 1 else xp[:, K:].copy_(S)
        torch.mm(xp, Wp.t(), out=y)

    def padded_gemm_only():
        torch.mm(xp, Wp.t(), out=y)

    def widen_only():  # what layers reading one x (q, k, v; gate, up) would share: x' built once for the group
        xp[:, :K].copy_(x)
        torch.mm(x, Acat.t(), out=S)
        torch.mul(S, mask, out=xp[:, K:]) if n > 1 else xp[:, K:].copy_(S)

    return {"base": base, "base_strided": base_strided, "merge_scratch": merge_scratch,
            "addmm_delta": addmm_delta, "delta_first": delta_first, "padded": padded,
            "padded_gemm_only": padded_gemm_only, "widen_only": widen_only}, y


def reference(x, W, A, B, scale, n, rows):
    M = x.shape[0]
    seg = M // n
    out = []
    for r in rows:
        i = r // seg
        xr = x[r].double()
        out.append(xr @ W.double().t() + scale * ((xr @ A[i].double().t()) @ B[i].double().t()))
    return torch.stack(out)


def graph_ms(fn) -> float:
    import triton.testing as tt
    from bench_llm import graphed

    return tt.do_bench(graphed(fn), warmup=10, rep=60, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--segments", default="1,2,4")
    ap.add_argument("--rank", type=int, default=16)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
    dev, dt, R = "cuda", torch.bfloat16, a.rank
    rows_out = []
    for model, M, K, N in SHAPES:
        g = torch.Generator(dev).manual_seed(0)
        x = torch.randn(M, K, device=dev, dtype=dt, generator=g)
        W = torch.randn(N, K, device=dev, dtype=dt, generator=g) / K**0.5
        for n in (n for n in map(int, a.segments.split(",")) if M % n == 0):
            A = torch.randn(n, R, K, device=dev, dtype=dt, generator=g) / K**0.5
            B = torch.randn(n, N, R, device=dev, dtype=dt, generator=g) / R**0.5
            fns, y = forms(x, W, A, B, 0.5, n)
            rows = torch.randint(0, M, (16,), generator=torch.Generator().manual_seed(1)).tolist()
            ref = reference(x, W, A, B, 0.5, n, rows)
            row = {"model": model, "M": M, "K": K, "N": N, "segments": n, "rank": R, "err": {}, "us": {}}
            for name, fn in fns.items():
                fn()
                if name not in ("padded_gemm_only", "widen_only"):  # parts of `padded`, checked there
                    exp = ref if name not in ("base", "base_strided") else reference(x, W, A, B, 0.0, n, rows)
                    row["err"][name] = float((y[rows].double() - exp).abs().max() / exp.abs().max())
                row["us"][name] = round(1000 * graph_ms(fn), 2)
            base = row["us"]["base"]
            row["x_base"] = {k: round(v / base, 3) for k, v in row["us"].items()}
            rows_out.append(row)
            print(f"{model:6s} M={M:5d} K={K:5d} N={N:5d} n={n}  base {base:7.1f} us  " + "  ".join(
                f"{k} {v:.3f}" for k, v in row["x_base"].items() if k != "base"), flush=True)
            bad = {k: e for k, e in row["err"].items() if e > 2e-2}
            if bad:
                print("  CHECK FAILED", bad, flush=True)
            del A, B, fns, y
        del x, W
        torch.cuda.empty_cache()
    if a.out:
        out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
               "timing": "one CUDA graph replay per call, L2 flushed (triton.testing.do_bench), median",
               "rows": rows_out}
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
