# Measures: the CUDA extension's merge kernel (W' = W + B diag(s) A) on every full-size layer shape of SDXL, Flux-dev
# and Llama-3-8B against a copy of the same bytes (the floor) and cuBLAS's addmm (what percall's large blends use).
# Showed (be8a9bb, H200): tensor cores 2.25-3.6x the copy, CUDA cores 2.6-4.3x, addmm 1.7-2.7x on every shape
# (results/nvidia-h200/merge_kernel.json, merge_kernel_cuda_cores.json).
"""Merge-kernel probe: one adapter of rank 16 in a bank of `--slots` slots, bf16, GPU time with L2 flushed
(triton.testing.do_bench, median). Each kernel's W' is checked against the float64 merge first.

    python benchmarks/probes/probe_merge_kernel.py --out $OUT/merge_kernel.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {  # (N, K) of the weights
    "sdxl": [(640, 640), (5120, 640), (640, 2560), (1280, 1280), (10240, 1280), (1280, 5120), (640, 2048),
             (1280, 2048)],
    "flux": [(3072, 3072), (12288, 3072), (3072, 12288), (3072, 15360)],
    "llama": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)],
}


def measure(ops, model: str, N: int, K: int, S: int) -> dict:
    dev, dt, R = "cuda", torch.bfloat16, 16
    W = torch.randn(N, K, device=dev, dtype=dt) * 0.02
    A = torch.randn(S, R, K, device=dev, dtype=dt) * 0.02
    B = torch.randn(N, S, R, device=dev, dtype=dt) * 0.02
    scale = torch.zeros(S, device=dev)
    scale[0] = 2.0
    ranks = torch.full((S,), R, device=dev, dtype=torch.int32)
    out = torch.empty_like(W)
    Bs = (B[:, 0] * scale[0]).to(dt)  # [N, R]: the scaled operand, rounded as the kernel rounds it
    ref = W.double() + Bs.double() @ A[0].double()
    ops.lora_merge(out, W, A, B, scale, ranks)
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, (model, N, K, err)
    forms = {"copy": lambda: out.copy_(W), "addmm": lambda: torch.addmm(W, Bs, A[0], out=out),
             "kernel": lambda: ops.lora_merge(out, W, A, B, scale, ranks)}
    us = {k: triton.testing.do_bench(f, return_mode="median") * 1e3 for k, f in forms.items()}
    gbs = {k: 2 * W.numel() * W.element_size() / (v * 1e-6) / 1e9 for k, v in us.items()}
    return {"model": model, "N": N, "K": K, "elements": N * K, "rel_err": err, "us": us, "GB_s": gbs,
            "x_copy": {k: v / us["copy"] for k, v in us.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--slots", type=int, default=4)
    args = ap.parse_args()
    from fdlora.kernels.cuda import ops

    torch.manual_seed(0)
    rows = []
    for model, shapes in SHAPES.items():
        for N, K in shapes:
            r = measure(ops, model, N, K, args.slots)
            rows.append(r)
            us, x = r["us"], r["x_copy"]
            print(f"{model:6s} {N:6d}x{K:<6d} copy {us['copy']:7.1f} us  addmm {x['addmm']:.2f}x  "
                  f"kernel {x['kernel']:.2f}x  ({r['GB_s']['kernel']:.0f} GB/s)  err {r['rel_err']:.1e}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "dtype": "bfloat16", "rank": 16, "slots": args.slots, "active": 1,
                                        "timing": "triton.testing.do_bench median, L2 flushed", "rows": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
