# Measures: host and GPU us per eager blend call without the merged-weight cache (BoundLinear) vs F.linear.
"""What one eager blend call without the merged-weight cache costs (fdlora_cuda.BoundLinear, the kept call of
FusedLoraLinear._kept_linear) against F.linear at the SDXL and Flux layer shapes: host us per call (issued while a
sleep kernel holds the GPU, so no launch waits on a full queue) and GPU us per call (CUDA events over back-to-back
calls), and its error against the float64 reference. Results: benchmarks/results/<gpu>/probe_bound_linear.json.

    PYTHONPATH=. python benchmarks/probes/probe_bound_linear.py --out /tmp/probe_bound_linear.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# (label, M, K, N, bias, dtype): the SDXL UNet at batch 2, 1024^2 (64^2 and 32^2 latents' tokens, text 77), Flux-dev
SHAPES = [
    ("sdxl attn1 q 64^2", 8192, 640, 640, False, torch.float16),
    ("sdxl attn out 64^2", 8192, 640, 640, True, torch.float16),
    ("sdxl ff in 64^2", 8192, 640, 5120, True, torch.float16),
    ("sdxl ff out 64^2", 8192, 2560, 640, True, torch.float16),
    ("sdxl attn1 q 32^2", 2048, 1280, 1280, False, torch.float16),
    ("sdxl attn2 k text", 154, 2048, 1280, False, torch.float16),
    ("sdxl ff in 32^2", 2048, 1280, 10240, True, torch.float16),
    ("sdxl ff out 32^2", 2048, 5120, 1280, True, torch.float16),
    ("flux qkv", 4608, 3072, 3072, True, torch.bfloat16),
    ("flux mlp in", 4608, 3072, 12288, True, torch.bfloat16),
    ("flux single out", 4608, 15360, 3072, True, torch.bfloat16),
]
S, R, CALLS = 4, 16, 200


def host_us(fn) -> float:
    """Host us per call with the GPU held by a sleep kernel: the launches queue without waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        torch.cuda._sleep(200_000_000)  # ~100 ms on an H100: longer than issuing the calls
        t = time.perf_counter()
        for _ in range(CALLS // 4):
            fn()
        best = min(best, (time.perf_counter() - t) / (CALLS // 4) * 1e6)
        torch.cuda.synchronize()
    return best


def gpu_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 20 * 1e3)
    return statistics.median(times)


def measure(ops, label: str, M: int, K: int, N: int, has_bias: bool, dtype: torch.dtype) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
    W = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
    bias = torch.randn(N, device="cuda", generator=g).to(dtype) if has_bias else None
    A = (torch.randn(S, R, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
    B = (torch.randn(N, S, R, device="cuda", generator=g) * 0.1).to(dtype)
    A[1:] = float("nan")  # dead slots: the kernels must not read them
    B[:, 1:] = float("nan")
    scale = torch.tensor([0.8, 0, 0, 0], device="cuda")
    ranks = torch.tensor([R, 0, 0, 0], device="cuda", dtype=torch.int32)
    gw = torch.ones(1, S, device="cuda")
    bound = ops.prepare_linear(x, W, bias, A, B, scale, ranks, 0)
    ref = x.double() @ (W.double() + 0.8 * B[:, 0].double() @ A[0].double()).t()
    if bias is not None:
        ref += bias.double()
    with torch.no_grad():
        err = float((bound(x).double() - ref).abs().max() / ref.abs().max())
        return {"shape": label, "M": M, "K": K, "N": N, "bias": has_bias, "dtype": str(dtype).split(".")[-1],
                "merged": bool(bound.merged), "planned": bool(bound.planned), "rel_err": err,
                "host_us_bound": host_us(lambda: bound(x)), "host_us_linear": host_us(lambda: F.linear(x, W, bias)),
                "gpu_us_bound": gpu_us(lambda: bound(x)), "gpu_us_linear": gpu_us(lambda: F.linear(x, W, bias)),
                "gpu_us_op": gpu_us(lambda: ops.lora_linear(x, W, bias, A, B, scale, gw, ranks))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from fdlora.kernels import registry

    ops = registry.ops("cuda")
    rows = []
    for shape in SHAPES:
        row = measure(ops, *shape)
        rows.append(row)
        print(f"{row['shape']:22s} merged {row['merged']!s:5s} planned {row['planned']!s:5s} err {row['rel_err']:.1e}"
              f"  host us {row['host_us_bound']:.1f} vs F.linear {row['host_us_linear']:.1f}   gpu us "
              f"{row['gpu_us_bound']:.1f} (op {row['gpu_us_op']:.1f}) vs F.linear {row['gpu_us_linear']:.1f}",
              flush=True)
        assert row["rel_err"] < 5e-3, f"{row['shape']}: error {row['rel_err']}"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
