# Measures: the merged-weight cache's per-call cost vs cuBLAS in a CUDA graph (the cost model's merge terms).
# Showed: the device-checked merge cache costs 1.013-1.058x cuBLAS at r16; refit merge cost. probe_checked.json
"""Probe: the merged-weight cache's per-call cost in a CUDA graph, interleaved so clock drift cancels.

Per layer shape (SDXL / Flux, bf16, bias, r16): a CUDA graph each of the cuBLAS base GEMM, the GEMM on a merged W'
("cached", what an eager layer with a fresh host key runs), the stamped merge + GEMM ("checked": what compiled and
captured layers run; the merge finds the stamp fresh and returns), merge-every-call + GEMM ("merged") and cuBLAS +
the delta kernel ("cublas_delta"), the two cache-less per-call paths the dispatch chooses between. Rounds
replay every graph once, each timed by CUDA events; the ratio to base is taken per round, median of the rounds.
(bench_fused.py times its columns one after another, where clocks can drift between columns on large shapes.)

    python benchmarks/probes/probe_checked.py --out results.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fused import ROTATE, SHAPES, args_of, capture_calls, inputs, oracle_rows  # noqa: E402

from fdlora.kernels.triton.merge.lora_merge import launch_merge, new_stamp  # noqa: E402


def timed(g, n) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--loras", default="r16", help="comma list of bench_fused.LORAS names")
    ap.add_argument("--only", default="", help="comma list of models (sdxl, flux)")
    args = ap.parse_args()
    version = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    from fdlora.kernels.triton.forward import lora_linear as L

    cases = [(m, M, K, N, lo) for m, M, K, N in SHAPES for lo in args.loras.split(",")
             if not args.only or m in args.only.split(",")]
    for model, M, K, N, lora in cases:
        sets = [inputs(M, K, N, lora, seed=i) for i in range(ROTATE)]
        bufs = [launch_merge(s["W"], s["A"], s["B"], s["scale"], s["group_weight"], s["ranks"])[0] for s in sets]
        stamps = [new_stamp(sets[0]["A"].shape[0], "cuda") for _ in sets]

        def checked(s, w, st):
            launch_merge(s["W"], s["A"], s["B"], s["scale"], s["group_weight"], s["ranks"], out=w[None], stamp=st,
                         version=version)
            return F.linear(s["x"], w, s["bias"])

        def merged(s):
            return F.linear(s["x"], launch_merge(s["W"], s["A"], s["B"], s["scale"], s["group_weight"],
                                                 s["ranks"])[0], s["bias"])

        orows, ref = oracle_rows(sets[0])
        y = checked(sets[0], bufs[0], stamps[0])
        err = float((y[orows.cuda()].double().cpu() - ref).norm() / ref.norm())
        assert err < 1e-2, (model, M, K, N, err)
        graphs = {
            "base": capture_calls([lambda s=s: F.linear(s["x"], s["W"], s["bias"]) for s in sets]),
            "cached": capture_calls([lambda s=s, w=w: F.linear(s["x"], w, s["bias"]) for s, w in zip(sets, bufs)]),
            "checked": capture_calls([lambda s=s, w=w, st=st: checked(s, w, st)
                                      for s, w, st in zip(sets, bufs, stamps)]),
            "merged": capture_calls([lambda s=s: merged(s) for s in sets]),
            "cublas_delta": capture_calls([lambda s=s: L.run_path("cublas_delta", *args_of(s)) for s in sets]),
        }
        t = {k: [] for k in graphs}
        for _ in range(args.rounds):
            for k, (g, n) in graphs.items():
                t[k].append(timed(g, n))
        row = {"shape": f"{model}_{M}x{K}->{N}", "lora": lora, "M": M, "K": K, "N": N, "rel_err_vs_fp64": err,
               "us": {k: statistics.median(v) for k, v in t.items()},
               "over_base": {k: statistics.median(a / b for a, b in zip(v, t["base"])) for k, v in t.items()}}
        rows.append(row)
        print(f"{row['shape']:24s} {lora:9s} base {row['us']['base']:7.1f}us " + " ".join(
            f"{k} {v:.3f}" for k, v in row["over_base"].items() if k != "base"), flush=True)
        del graphs, sets, bufs
        torch.cuda.empty_cache()
    out = {"benchmark": "probe_checked", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "time": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
