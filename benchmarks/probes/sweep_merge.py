# Showed: lora_merge blocks; a copy of W alone is 0.157 of a Flux 3072^2 GEMM. sweep_merge_s9.json
"""Block sweep of lora_merge (the "merged" path's W' = W + sum_s w_s B_s A_s), against a copy of W's bytes.

Per weight shape and LoRA (r16, a 4 x r16 blend, r64): every candidate (BN, BK, warps, stages) is checked
against the shipped blocks' output (within one rounding of W'), then timed as in bench_delta.py (CUDA graph
replay, L2 flushed before each, median); `copy_us` is a device copy of W into a same-size buffer timed the
same way, the floor for a kernel that reads W and writes W'.

    python benchmarks/probes/sweep_merge.py --out $OUT/sweep_merge.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_delta import gpu_us  # noqa: E402

from fdlora.kernels.triton.merge.lora_merge import BLOCKS, launch_merge  # noqa: E402

WEIGHTS = {"flux_3072": (3072, 3072), "flux_3072_12288": (12288, 3072), "flux_12288_3072": (3072, 12288),
           "sdxl_1280": (1280, 1280), "sdxl_640": (640, 640), "sdxl_1280_5120": (5120, 1280),
           "sdxl_5120_1280": (1280, 5120)}  # name: (N, K) of W
LORAS = {"r16": (1, 16), "blend4x16": (4, 16), "r64": (1, 64)}
CANDIDATES = [dict(BN=bn, BK=bk, num_warps=w, num_stages=st) for bn, bk, w, st in [
    (64, 128, 4, 2), (64, 256, 4, 2), (64, 256, 8, 2), (128, 128, 8, 2), (128, 256, 8, 2), (32, 256, 4, 2),
    (32, 512, 4, 2), (64, 128, 4, 3), (128, 128, 4, 2), (16, 512, 4, 2), (64, 64, 4, 2), (128, 64, 4, 2),
    (32, 128, 4, 2), (64, 128, 8, 2), (256, 64, 8, 2)]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dtype = torch.bfloat16
    rows = []
    for name, (N, K) in WEIGHTS.items():
        g = torch.Generator(device="cuda").manual_seed(N + K)
        W = torch.randn(N, K, device="cuda", generator=g).to(dtype)
        dst = torch.empty_like(W)
        copy_us = gpu_us(functools.partial(dst.copy_, W))
        for lora, (S, R) in LORAS.items():
            A = torch.randn(S, R, K, device="cuda", generator=g).div_(K**0.5).to(dtype)
            B = torch.randn(N, S, R, device="cuda", generator=g).div_(R**0.5).to(dtype)
            scale = torch.full((S,), 0.5, device="cuda")
            gw = torch.ones(1, S, device="cuda")
            ranks = torch.full((S,), R, device="cuda", dtype=torch.int32)
            out = torch.empty(1, N, K, device="cuda", dtype=dtype)
            want = launch_merge(W, A, B, scale, gw, ranks).float()
            ulp = want.abs().clamp_min(1e-3) * 2.0**-7  # one bf16 rounding of W'
            timed = {}
            for cand in CANDIDATES:
                got = launch_merge(W, A, B, scale, gw, ranks, out=out, blocks=cand).float()
                if not ((got - want).abs() <= ulp).all():
                    timed[str(cand)] = None
                    continue
                timed[str(cand)] = gpu_us(functools.partial(launch_merge, W, A, B, scale, gw, ranks, out=out,
                                                            blocks=cand))
            ok = {k: v for k, v in timed.items() if v is not None}
            best = min(ok, key=ok.get)
            shipped = timed[str(BLOCKS["gpu"])]
            rows.append({"weight": name, "N": N, "K": K, "lora": lora, "copy_us": copy_us, "shipped_us": shipped,
                         "best": best, "best_us": ok[best], "us": timed,
                         "shipped_over_copy": shipped / copy_us, "best_over_copy": ok[best] / copy_us})
            print(f"{name:16s} {lora:9s} copy {copy_us:6.1f}us shipped {shipped:6.1f} ({shipped / copy_us:.2f}x) "
                  f"best {ok[best]:6.1f} ({ok[best] / copy_us:.2f}x) {best}", flush=True)
    props = torch.cuda.get_device_properties(0)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "sweep_merge", "gpu": props.name, "torch": torch.__version__,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "timing": "CUDA graph replay, L2 flushed before each, median of 30; bf16", "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
