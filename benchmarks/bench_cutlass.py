"""The CUTLASS LoRA-fused GEMM (fdlora/kernels/cutlass) against cuBLAS, CUTLASS's own GEMM and fd-lora's other paths.

Checks every case against a float64 oracle first (odd shapes, bias, ranks below the slot capacity, blends), then
times, per layer shape and LoRA (r16, r64, a 4 x r16 blend): cuBLAS base (F.linear), CUTLASS's plain GEMM
(cluster 1x1 and 2x1, and stream-K), the CUTLASS LoRA GEMM, and the Triton dispatch's "merged" and
"cublas_delta" paths.
GPU time as bench_fused.py: a CUDA graph over 4 input sets x 3 (so x and W are not all L2-resident), median of 7
replays. (cutlass_s9_*.json came from an earlier copy of that timer: median of 7 rounds of 5 replays.)

    python benchmarks/bench_cutlass.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fused import graph_us  # noqa: E402

from fdlora.kernels.cutlass import lib  # noqa: E402
from fdlora.kernels.reference import lora_linear as reference_linear  # noqa: E402

SHAPES = {  # name: (M, K, N)
    "flux_3072": (4608, 3072, 3072),
    "flux_3072_12288": (4608, 3072, 12288),
    "flux_12288_3072": (4608, 12288, 3072),
    "sdxl_1280": (8192, 1280, 1280),
    "sdxl_640": (16384, 640, 640),
    "sdxl_1280_5120": (8192, 1280, 5120),
    "sdxl_5120_1280": (8192, 5120, 1280),
}
LORAS = {"r16": (1, 16), "r64": (1, 64), "blend4x16": (4, 16)}  # (S, R)
SETS = 4


def bank(S: int, R: int, K: int, N: int, dtype: torch.dtype, ranks: list[int] | None = None, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    A = torch.randn(S, R, K, device="cuda", generator=g).div_(K**0.5).to(dtype)
    B = torch.randn(N, S, R, device="cuda", generator=g).div_(R**0.5).to(dtype)
    scale = torch.rand(S, device="cuda", generator=g) + 0.5
    weight = torch.rand(S, device="cuda", generator=g) + 0.25
    ranks_t = torch.tensor(ranks if ranks is not None else [R] * S, device="cuda", dtype=torch.int32)
    for s, r in enumerate(ranks_t.tolist()):  # a bank keeps the columns past a slot's rank at zero
        A[s, r:] = 0
        B[:, s, r:] = 0
    return A, B, scale, weight, ranks_t


def oracle(x, W, bias, A, B, scale, weight, ranks):
    y = x.double() @ W.double().T + (0 if bias is None else bias.double())
    for s, r in enumerate(ranks.tolist()):
        h = x.double() @ A[s, :r].double().T
        y += float(scale[s] * weight[s]) * (h @ B[:, s, :r].double().T)
    return y


def check(M, K, N, S, R, dtype, with_bias, ranks=None) -> dict:
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    W = torch.randn(N, K, device="cuda", generator=g).div_(K**0.5).to(dtype)
    bias = torch.randn(N, device="cuda", generator=g).to(dtype) if with_bias else None
    A, B, scale, weight, ranks_t = bank(S, R, K, N, dtype, ranks)
    want = oracle(x, W, bias, A, B, scale, weight, ranks_t)
    got = lib.lora_gemm(x, W, bias, A, B, scale, weight, ranks_t, torch.empty(M, N, device="cuda", dtype=dtype))
    eager = reference_linear(x, W, bias, A, B, scale, weight.view(1, -1), ranks_t)
    err = (got.double() - want).abs().max().item()
    err_eager = (eager.double() - want).abs().max().item()
    delta = (want - (x.double() @ W.double().T + (0 if bias is None else bias.double()))).abs().max().item()
    ok = err <= 2 * err_eager + 1e-3 and torch.isfinite(got).all().item()
    return {"M": M, "K": K, "N": N, "S": S, "R": R, "ranks": ranks_t.tolist(), "dtype": str(dtype), "bias": with_bias,
            "max_err": err, "eager_err": err_eager, "delta_max": delta, "ok": ok}


def time_shape(name, M, K, N, dtype, loras) -> list[dict]:
    from fdlora.kernels.triton.lora_linear import run_path

    sets = []
    for i in range(SETS):
        g = torch.Generator(device="cuda").manual_seed(i)
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        W = torch.randn(N, K, device="cuda", generator=g).div_(K**0.5).to(dtype)
        bias = torch.randn(N, device="cuda", generator=g).to(dtype)
        sets.append((x, W, bias, torch.empty(M, N, device="cuda", dtype=dtype)))
    base = {
        "cublas": graph_us([lambda s=s: F.linear(s[0], s[1], s[2]) for s in sets]),
        "cutlass_plain_1x1": graph_us([lambda s=s: lib.gemm(s[0], s[1], s[2], s[3], 1) for s in sets]),
        "cutlass_plain_2x1": graph_us([lambda s=s: lib.gemm(s[0], s[1], s[2], s[3], 2) for s in sets]),
        "cutlass_plain_streamk": graph_us([lambda s=s: lib.gemm(s[0], s[1], s[2], s[3], 3) for s in sets]),
    }
    rows = []
    for lora in loras:
        S, R = LORAS[lora]
        banks = [bank(S, R, K, N, dtype, seed=i) for i in range(SETS)]
        t = dict(base)
        t["cutlass_lora"] = graph_us([lambda s=s, b=b: lib.lora_gemm(*s[:3], *b, s[3]) for s, b in zip(sets, banks)])
        if lora == "r16":  # the same kernel without its shrink wgmma: what the expand stage and A loads cost
            t["cutlass_lora_noshrink"] = graph_us([lambda s=s, b=b: lib.lora_gemm(*s[:3], *b, s[3], shrink=False)
                                                     for s, b in zip(sets, banks)])
        for path in ("merged", "cublas_delta"):
            t[path] = graph_us([lambda s=s, b=b, p=path: run_path(p, s[0], s[1], s[2], b[0], b[1], b[2],
                                                                  b[3].view(1, -1), b[4])
                                  for s, b in zip(sets, banks)])
        flops = 2.0 * M * N * K
        row = {"shape": name, "M": M, "K": K, "N": N, "lora": lora, "S": S, "R": R, "us": t,
               "over_cublas": {k: v / t["cublas"] for k, v in t.items()},
               "tflops": {k: flops / v / 1e6 for k, v in t.items()}}
        rows.append(row)
        r = row["over_cublas"]
        print(f"{name:16s} {lora:9s} cublas {t['cublas']:7.1f}us  plain1 {r['cutlass_plain_1x1']:.3f} "
              f"plain2 {r['cutlass_plain_2x1']:.3f} sk {r['cutlass_plain_streamk']:.3f}  lora {r['cutlass_lora']:.3f}  "
              f"noshrink {r.get('cutlass_lora_noshrink', float('nan')):.3f}  "
              f"merged {r['merged']:.3f}  delta {r['cublas_delta']:.3f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated shape names")
    ap.add_argument("--loras", default=",".join(LORAS), help="comma-separated: " + ", ".join(LORAS))
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for M, K, N, S, R, bias, ranks in [
            (300, 200, 136, 1, 8, True, None), (128, 64, 256, 1, 16, False, None), (1, 64, 8, 1, 16, True, None),
            (777, 1040, 520, 3, 16, True, [16, 5, 0]), (4608, 3072, 3072, 1, 16, True, None),
            (1000, 512, 264, 2, 32, False, [32, 17]), (2048, 1280, 1280, 4, 16, True, None),
            (515, 4104, 1288, 1, 64, True, None), (64, 128, 2056, 2, 24, False, [24, 3]),
        ]:
            cases.append(check(M, K, N, S, R, dtype, bias, ranks))
            c = cases[-1]
            print(f"check {M}x{K}->{N} S{S} R{R} {dtype} bias={bias}: err {c['max_err']:.3g} "
                  f"eager {c['eager_err']:.3g} (delta {c['delta_max']:.3g}) {'ok' if c['ok'] else 'FAIL'}", flush=True)
    rows = []
    if not args.check_only and all(c["ok"] for c in cases):
        names = [n for n in SHAPES if not args.only or n in args.only.split(",")]
        for n in names:
            rows += time_shape(n, *SHAPES[n], torch.bfloat16, args.loras.split(","))
    props = torch.cuda.get_device_properties(0)
    out = {"benchmark": "cutlass_lora_gemm", "gpu": props.name, "sms": props.multi_processor_count,
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "timing": "bench_fused.graph_us: CUDA graph over 4 input sets x 3, median of 7 replays; bf16",
           "all_verified": all(c["ok"] for c in cases), "checks": cases, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
