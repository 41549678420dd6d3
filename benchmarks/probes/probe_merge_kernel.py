# Measures: the CUDA extension's merge kernel (W' = W + B diag(s) A) on every full-size layer shape of SDXL, Flux-dev
# and Llama-3-8B against a copy of the same bytes (the floor), cuBLAS's addmm and the Triton backend's merge.
# Showed (H200): fragment-sized accesses 3.0-3.7x the copy on the largest weights (86adf30), W staged in shared
# memory and stored in 16-byte rows 2.0-2.1x (e83f7b7), addmm 2.6-2.7x, the Triton merge 1.55-1.65x in a CUDA graph
# (results/nvidia-h200/merge_kernel.json, merge_kernel_candidates.json, merge_kernel_cuda_cores.json).
"""Merge-kernel probe: one adapter of rank 16 in a bank of `--slots` slots, bf16, GPU time with L2 flushed
(triton.testing.do_bench, median) and in a CUDA graph of 20 calls (bench_fused.graph_us), against the Triton
backend's merge kernel too. Each kernel's W' is checked against the float64 merge first.

    python benchmarks/probes/probe_merge_kernel.py --out $OUT/merge_kernel.json [--stream]

--stream also builds merge_stream.cu (candidates; about a minute) and times its persistent, pipelined kernel with 2, 3
and 4 stages of W tiles in flight (streamN: fragments stored straight from the accumulators; streamNc: through shared
memory in 16-byte rows) and its one-tile-a-block kernel with W staged in shared memory (tile128, tile256: threads).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton.testing

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fused import graph_us  # noqa: E402

SHAPES = {  # (N, K) of the weights
    "sdxl": [(640, 640), (5120, 640), (640, 2560), (1280, 1280), (10240, 1280), (1280, 5120), (640, 2048),
             (1280, 2048)],
    "flux": [(3072, 3072), (12288, 3072), (3072, 12288), (3072, 15360)],
    "llama": [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)],
}


def measure(ops, launch_merge, stream, model: str, N: int, K: int, S: int) -> dict:
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
    gw = torch.ones(1, S, device=dev)
    launch_merge(W, A, B, scale, gw, ranks, out=out.view(1, N, K))
    err_triton = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err_triton < 1e-2, (model, N, K, err_triton)
    forms = {"copy": lambda: out.copy_(W), "addmm": lambda: torch.addmm(W, Bs, A[0], out=out),
             "kernel": lambda: ops.lora_merge(out, W, A, B, scale, ranks),
             "triton": lambda: launch_merge(W, A, B, scale, gw, ranks, out=out.view(1, N, K))}
    errs = {}
    candidates = {}  # merge_stream.cu's forms: timed only where they are right
    if stream:
        for stages in (2, 3, 4):
            candidates[f"stream{stages}"] = functools.partial(stream.merge_stream, out, W, A, B, scale, ranks,
                                                              stages, 2)
            candidates[f"stream{stages}c"] = functools.partial(stream.merge_stream, out, W, A, B, scale, ranks,
                                                               -stages, 2)
        for threads in (128, 256):
            candidates[f"tile{threads}"] = functools.partial(stream.merge_tile, out, W, A, B, scale, ranks, threads)
    for name, f in candidates.items():
        out.fill_(float("nan"))
        f()
        errs[name] = ((out.double() - ref).abs().max() / ref.abs().max()).nan_to_num(1.0).item()
        if errs[name] < 1e-2:
            forms[name] = f
    us = {k: triton.testing.do_bench(f, return_mode="median") * 1e3 for k, f in forms.items()}
    us_graph = {k: graph_us([f], reps=20) for k, f in forms.items()}
    gbs = {k: 2 * W.numel() * W.element_size() / (v * 1e-6) / 1e9 for k, v in us.items()}
    return {"model": model, "N": N, "K": K, "elements": N * K, "rel_err": err, "rel_err_triton": err_triton,
            "rel_err_stream": errs, "us": us, "GB_s": gbs, "x_copy": {k: v / us["copy"] for k, v in us.items()},
            "us_graph": us_graph, "x_copy_graph": {k: v / us_graph["copy"] for k, v in us_graph.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--stream", action="store_true", help="also build and time the candidate in merge_stream.cu")
    args = ap.parse_args()
    from fdlora.kernels.cuda import ops
    from fdlora.kernels.triton.merge.lora_merge import launch_merge

    stream = None
    if args.stream:
        from torch.utils.cpp_extension import load

        major, minor = torch.cuda.get_device_capability()
        stream = load(name="fdlora_probe_merge_stream", sources=[str(Path(__file__).with_name("merge_stream.cu"))],
                      extra_include_paths=[str(ROOT / "fdlora" / "kernels" / "cuda" / "csrc")],
                      extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"])
    torch.manual_seed(0)
    rows = []
    for model, shapes in SHAPES.items():
        for N, K in shapes:
            r = measure(ops, launch_merge, stream, model, N, K, args.slots)
            rows.append(r)
            us, x = r["us"], r["x_copy"]
            xg = r["x_copy_graph"]
            cands = "".join(f" {k} {v:.2f}x" for k, v in x.items() if k.startswith(("stream", "tile")))
            print(f"{model:6s} {N:6d}x{K:<6d} copy {us['copy']:7.1f} us  addmm {x['addmm']:.2f}x  kernel "
                  f"{x['kernel']:.2f}x  triton {x['triton']:.2f}x{cands} | in a graph: copy {r['us_graph']['copy']:.1f}"
                  f" us, " + " ".join(f"{k} {v:.2f}x" for k, v in xg.items() if k != "copy")
                  + "".join(f" [{k} err {e:.1e}]" for k, e in r["rel_err_stream"].items() if e >= 1e-2), flush=True)
    if args.out:
        timing = ("us: triton.testing.do_bench median, L2 flushed; us_graph: 20 calls in a CUDA graph, median of 7 "
                  "replays (bench_fused.graph_us)")
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "dtype": "bfloat16", "rank": 16, "slots": args.slots, "active": 1,
                                        "timing": timing, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
