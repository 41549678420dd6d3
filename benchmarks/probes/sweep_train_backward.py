# Measures: the LoRA backward per layer: PEFT-style torch vs cuBLAS half path vs two-pass Triton.
"""The LoRA part of a layer's backward at bench_train's layer shapes (M = 8192, r 16, bf16): the PEFT-style torch path,
the shipped cuBLAS half path (lora_train_linear_backward_half), and the two-pass Triton kernels
(fdlora.kernels.triton.train.lora_backward.backward_half) over a few launch shapes, each checked against the half path
first; also each cuBLAS GEMM of the half path alone, to show which one is slow.

    python benchmarks/probes/sweep_train_backward.py --out $OUT/sweep_train_backward.json     # GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_train  # noqa: E402

from fdlora.kernels.ops import lora_train  # noqa: E402
from fdlora.kernels.triton.train import lora_backward as LB  # noqa: E402
from fdlora.testing import median_ms  # noqa: E402

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]
BLOCKS = {
    "bm256-w4": LB.Blocks(BM=256, BN=64, BK=64, warps=4, stages=3),
    "bm256-w4-s4": LB.Blocks(BM=256, BN=64, BK=64, warps=4, stages=4),
    "bm128-bn128": LB.Blocks(BM=128, BN=128, BK=128, warps=8, stages=3),
    "bm256-bn128-s2": LB.Blocks(BM=256, BN=128, BK=128, warps=8, stages=2),
    "tile128-w4": LB.Blocks(BM=128, BN=128, BK=128, warps=4, stages=3, fill=64),
    "tile128-w8": LB.Blocks(BM=128, BN=128, BK=128, warps=8, stages=3, fill=64),
    "bm64-bn256-tile": LB.Blocks(BM=64, BN=256, BK=256, warps=4, stages=3, fill=64),
    "bm128-fill8": LB.Blocks(BM=128, BN=64, BK=64, warps=4, stages=3, fill=8),
}


def run_shape(K: int, N: int, rep: int) -> dict:
    dev, dt, M = torch.device("cuda"), torch.bfloat16, 8192
    gy, x, A, B, s = bench_train.layer_inputs(dev, dt, M, K, N)
    hb, Ab, Bb, Bs = (x.float() @ A.t()).to(dt), A.to(dt), B.to(dt), (B * s).to(dt)

    def torch_path():
        gys = gy * s.to(dt)
        return (gys @ Bb) @ Ab, ((gys @ Bb).t() @ x), gys.t() @ hb

    def half():
        return lora_train.lora_train_linear_backward_half(gy, x, hb, None, Ab, Bs, s)

    want = [t.float() for t in half()]
    row = {"M": M, "K": K, "N": N, "r": 16, "torch_ms": median_ms(torch_path, rep, "cuda"),
           "half_ms": median_ms(half, rep, "cuda")}
    gh = torch.mm(gy, Bs)
    row["gemm_ms"] = {
        "g": median_ms(lambda: torch.mm(gy, Bs), rep, "cuda"),
        "gB": median_ms(lambda: torch.mm(gy.t(), hb, out_dtype=torch.float32), rep, "cuda"),
        "gA": median_ms(lambda: torch.mm(gh.t(), x, out_dtype=torch.float32), rep, "cuda"),
        "gu": median_ms(lambda: torch.mm(gh, Ab), rep, "cuda"),
    }
    row["floor_ms"] = {"read_gy": median_ms(lambda: gy.sum(dtype=torch.float32), rep, "cuda"),
                       "clone_u": median_ms(lambda: x.clone(), rep, "cuda")}
    row["triton"] = {}
    for name, b in BLOCKS.items():
        try:
            got = LB.backward_half(gy, x, hb, None, Ab, Bs, s, blocks=b)
            err = max(float((p.float() - q).abs().max() / q.abs().max()) for p, q in zip(got, want))
            ms = median_ms(lambda b=b: LB.backward_half(gy, x, hb, None, Ab, Bs, s, blocks=b), rep, "cuda")
            gp, _ = LB.gy_pass(gy, hb, Bs, b)
            gu = torch.empty_like(x)
            row["triton"][name] = {"ms": ms, "rel_err_vs_half": err, "x_torch": ms / row["torch_ms"],
                                   "gy_pass_ms": median_ms(lambda b=b: LB.gy_pass(gy, hb, Bs, b), rep, "cuda"),
                                   "u_pass_ms": median_ms(lambda b=b, gp=gp, gu=gu: LB.u_pass(gp, x, Ab, gu, False,
                                                                                              b), rep, "cuda")}
        except Exception as e:  # a launch shape that does not fit (shared memory): recorded, not fatal
            row["triton"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    best = min((v["ms"], k) for k, v in row["triton"].items() if "ms" in v)
    row["best"] = {"blocks": best[1], "ms": best[0], "x_torch": best[0] / row["torch_ms"],
                   "half_x_torch": row["half_ms"] / row["torch_ms"]}
    print(f"K={K:5d} N={N:5d}: torch {row['torch_ms']:.3f}  half {row['half_ms']:.3f} "
          f"({row['half_ms'] / row['torch_ms']:.2f}x)  gemms " +
          " ".join(f"{k} {v * 1e3:.0f}us" for k, v in row["gemm_ms"].items()) +
          f"  triton best {best[1]} {best[0]:.3f} ({best[0] / row['torch_ms']:.2f}x)  floors " +
          " ".join(f"{k} {v * 1e3:.0f}us" for k, v in row["floor_ms"].items()), flush=True)
    for k, v in row["triton"].items():
        print(f"    {k:16s} " + (f"{v['ms']:.3f} ms  x{v['x_torch']:.2f}  err {v['rel_err_vs_half']:.1e}  gy pass "
                                 f"{v['gy_pass_ms'] * 1e3:.0f}us  u pass {v['u_pass_ms'] * 1e3:.0f}us"
                                 if "ms" in v else v["error"]), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args()
    rows = [run_shape(K, N, a.repeats) for K, N in SHAPES]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
