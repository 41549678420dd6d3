# Measures: the one-pass grad_A + grad_u backward piece (x_pass) vs cuBLAS's two GEMMs, as GPU time.
"""The gA and gu pieces of the LoRA backward fused into one pass over u (lora_backward_parts.x_pass) against
cuBLAS's two GEMMs, at bench_train's layer shapes, as GPU time (CUDA graph replays, L2 flushed); then the whole
layer's backward (fd-lora's half path: g, grad_B, grad_A, grad_u, the base added by addmm_) with the best tile of
each shape in place of the two GEMMs, beside the base's grad_x GEMM alone and the PEFT-style path.

    python benchmarks/probes/probe_x_pass.py --out $OUT/probe_x_pass.json      # GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_delta import gpu_us  # noqa: E402
from bench_train import layer_inputs  # noqa: E402

from fdlora.kernels.ops import lora_train  # noqa: E402
from fdlora.kernels.triton.train import lora_backward_parts as P  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    dev, dt, M = torch.device("cuda"), torch.bfloat16, 8192
    tiles = [P.Tile(BM=bm, BL=bk, warps=w, stages=st, fill=f)
             for bm, bk, w, st, f in itertools.product((64, 128), (64, 128, 256), (4, 8), (3,), (1, 2, 4))]
    rows = [shape_row(dev, dt, M, K, N, tiles) for K, N in [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]]
    if a.out:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                     "rows": rows}, indent=1))


def shape_row(dev, dt, M, K, N, tiles) -> dict:
    gy, x, A, B, s = layer_inputs(dev, dt, M, K, N)
    W = torch.randn(N, K, device=dev, dtype=dt) / K ** 0.5
    Ac, sA, _, sB = lora_train.half_casts(A, B, s, dt)
    hs = torch.nn.functional.linear(x, sA)
    g = torch.mm(gy, sB)
    want_u, want_A = torch.mm(g, Ac), lora_train._mm_f32(g.t(), x)
    row = {"K": K, "N": N, "M": M,
           "cublas_us": gpu_us(lambda: (lora_train._mm_f32(g.t(), x), torch.mm(g, Ac))), "tiles": {}}
    for t in tiles:
        gu, gA = P.x_pass(g, x, Ac, t)
        err = max(float((gu.float() - want_u.float()).abs().max() / want_u.float().abs().max()),
                  float((gA - want_A).abs().max() / want_A.abs().max()))
        if err > 2e-2:
            row["tiles"][t.name] = {"err": err}
            continue
        row["tiles"][t.name] = {"us": gpu_us(lambda t=t: P.x_pass(g, x, Ac, t)), "err": err}
    best = min((v["us"], n) for n, v in row["tiles"].items() if "us" in v)
    row["best"], row["best_us"] = best[1], best[0]
    t = P.Tile.parse(best[1])

    def base():
        return gy @ W

    def fd_layer():
        return lora_train.lora_train_linear_backward_half(gy, x, hs, W, Ac, sB, None)

    def fused_layer(t=t):
        g = torch.mm(gy, sB)
        grad_B = lora_train._mm_f32(gy.t(), hs)
        grad_u, grad_A = P.x_pass(g, x, Ac, t)
        return grad_u.addmm_(gy, W), grad_A, grad_B

    def torch_layer():
        gys = gy * s.to(dt)
        gB = gys.t() @ hs
        gh = gys @ B.to(dt)
        gA = gh.t() @ x
        return (gy @ W).add_(gh @ A.to(dt)), gA, gB

    ref, got = fd_layer(), fused_layer()
    row["layer_err"] = max(float((p.float() - q.float()).abs().max() / q.float().abs().max())
                           for p, q in zip(got, ref))
    rounds = [[gpu_us(f) for f in (base, fd_layer, fused_layer, torch_layer)] for _ in range(5)]
    row["layer_rounds_us"] = rounds
    row["fd_lora_x_torch"] = statistics.median((f - b) / (t_ - b) for b, f, _, t_ in rounds)
    row["fused_lora_x_torch"] = statistics.median((u - b) / (t_ - b) for b, _, u, t_ in rounds)
    print(f"K={K} N={N}: cuBLAS gA+gu {row['cublas_us']:.1f} us, x_pass best {best[1]} {best[0]:.1f} us; "
          f"layer LoRA part vs torch: half path {row['fd_lora_x_torch']:.3f}, fused {row['fused_lora_x_torch']:.3f}"
          f" (err {row['layer_err']:.1e})", flush=True)
    return row


if __name__ == "__main__":
    main()
