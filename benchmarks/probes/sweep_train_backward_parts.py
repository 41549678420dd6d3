# Measures: each LoRA backward piece's candidate forms, then the best combination per shape.
"""Each piece of the LoRA backward at bench_train's layer shapes (M = 8192, r 16, bf16), every candidate implementation
of it timed alone after a check against the shipped cuBLAS half path (lora_train_linear_backward_half), then the
fastest combination per shape end to end against the PEFT-style torch path (bench_train.layer_microbench's measure).

    gy: g = gy Bs and grad_B = s gy^T h   cuBLAS orientations (lora_backward_parts.HALF_PIECES) or the Triton gy kernel
    gA: grad_A = g^T u                    cuBLAS orientations, split-M batched GEMMs, or the Triton split-M kernel
    gu: grad_u = g As                     cuBLAS, or the Triton store-bound tile kernel
(Triton kernels: fdlora.kernels.triton.train.lora_backward_parts, launch shapes "BMxBL-wW-sS-fF[-t]".) Pieces are timed on
device (CUDA events around 10 back-to-back calls, best of 3; --graph: CUDA graph replays); end to end with bench_train's
median_ms (synchronised per call), as the target is measured, and as GPU time (graph replays: what the backward adds
to a GPU-bound step). Printed last: the shapes where a plan beat the half path.

    python benchmarks/probes/sweep_train_backward_parts.py --out $OUT/sweep_train_backward_parts.json   # GPU, ~2 min
    TRITON_INTERPRET=1 python benchmarks/probes/sweep_train_backward_parts.py --smoke                   # CPU check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_train  # noqa: E402

from fdlora.kernels.ops import lora_train  # noqa: E402
from fdlora.kernels.triton.train import lora_backward as LB  # noqa: E402
from fdlora.kernels.triton.train import lora_backward_parts as parts  # noqa: E402
from fdlora.testing import median_ms  # noqa: E402

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]
# Launch shapes per Triton piece; the fill variants of one shape share its compiled kernel (fill only sizes the grid).
TILES = {
    "gy": ["128x128-w4-s3-f2", "128x128-w4-s3-f1", "128x128-w4-s3-f4", "128x128-w4-s3-f0", "128x128-w8-s3-f2",
           "64x256-w4-s3-f2", "64x128-w4-s4-f2", "64x128-w4-s3-f0", "256x128-w8-s2-f2", "128x256-w8-s3-f2",
           "128x128-w4-s3-f2-t"],
    "gA": ["128x128-w4-s3-f2", "128x128-w4-s3-f1", "128x128-w4-s3-f4", "128x128-w4-s3-f8", "128x128-w8-s3-f2",
           "64x256-w4-s3-f2", "64x128-w4-s4-f2", "256x64-w8-s3-f2", "128x128-w4-s4-f4", "128x128-w4-s3-f2-t",
           "64x256-w8-s3-f2-t"],
    "gu": ["64x128-w4-s2-f0", "128x128-w4-s2-f0", "128x128-w8-s2-f0", "64x256-w4-s2-f0", "128x256-w8-s2-f0",
           "256x128-w8-s2-f0", "32x256-w4-s2-f0"],
}
SMOKE_TILES = {"gy": ["16x16-w1-s1-f1", "16x32-w1-s1-f0-t"], "gA": ["16x16-w1-s1-f2", "32x16-w1-s1-f1-t"],
               "gu": ["16x16-w1-s1-f0", "32x16-w1-s1-f0"]}
TOL = {"g": 1e-2, "gu": 1e-2, "gA": 1e-3, "gB": 1e-3}  # relative to the half path's max: bf16 outputs, fp32 grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


GRAPH = False  # --graph: time every piece as a CUDA graph replay (bench_delta.gpu_us), host time out of it


def device_us(fn, dev: torch.device) -> float:
    """Device time of one call in us: best of 3 runs of 10 back-to-back calls between CUDA events (host launch time
    hides behind the previous call only where the call's device time exceeds it: at N = 1024 it does not); with
    GRAPH, the median replay of the call captured in a CUDA graph, L2 flushed before each (no host time at all);
    one wall-timed call on CPU."""
    fn()
    if dev.type == "cuda" and GRAPH:
        from bench_delta import gpu_us

        return gpu_us(fn)
    if dev.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    best = float("inf")
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 100)
    return best


def candidates(piece: str, tiles: dict) -> list[str]:
    return list(parts.HALF_PIECES[piece]) + ["tri:" + t for t in tiles[piece]]


def time_piece(piece, names, run, check, nbytes, dev) -> dict:
    """{name: {us, GBps, err} or {error}} for each implementation name; `run(fn)` calls it, `check(out)` gives the
    error against the half path (a dict of relative errors), `nbytes` the piece's compulsory traffic."""
    out = {}
    for name in names:
        try:
            fn = _piece_fn(piece, name)
            errs = check(run(fn))
            bad = {k: v for k, v in errs.items() if not v <= TOL[k]}
            if bad:
                out[name] = {"error": "mismatch vs half path: " + ", ".join(f"{k} {v:.1e}" for k, v in bad.items())}
                continue
            us = device_us(lambda fn=fn: run(fn), dev)
            out[name] = {"us": us, "GBps": nbytes / us / 1e3, "err": max(errs.values())}
        except Exception as e:  # a launch shape that does not fit (shared memory, registers): recorded, not fatal
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    return out


def _piece_fn(piece: str, name: str):
    if name.startswith("tri:"):
        return getattr(parts, piece.lower() + "_impl")(name[4:])
    return parts.HALF_PIECES[piece][name]  # (a KeyError names a bad entry of TILES' cuBLAS side)


def best(rows: dict) -> tuple[str, dict] | None:
    ok = [(v["us"], k) for k, v in rows.items() if "us" in v]
    return None if not ok else (min(ok)[1], rows[min(ok)[1]])


def run_shape(K: int, N: int, M: int, dev: torch.device, dt: torch.dtype, tiles: dict, rep: int) -> dict:
    gy, x, A, B, s = bench_train.layer_inputs(dev, dt, M, K, N)
    hb, Ab, Bb, Bs = (x.float() @ A.t()).to(dt), A.to(dt), B.to(dt), (B * s).to(dt)
    r, es = A.shape[0], gy.element_size()
    want_u, want_A, want_B = lora_train.lora_train_linear_backward_half(gy, x, hb, None, Ab, Bs, s)
    g = torch.mm(gy, Bs)

    def torch_path():  # autograd's work for lora_B(lora_A(x)) * s (bench_train.layer_microbench)
        gys = gy * s.to(dt)
        gh = gys @ Bb
        return gh @ Ab, gh.t() @ x, gys.t() @ hb

    row = {"M": M, "K": K, "N": N, "r": r, "pieces": {}}
    P = row["pieces"]
    P["gy"] = time_piece("gy", candidates("gy", tiles), lambda f: f(gy, hb, Bs, s),
                         lambda o: {"g": rel(o[0], g), "gB": rel(o[1], want_B)}, (M * N + 2 * M * r) * es, dev)
    P["gA"] = time_piece("gA", candidates("gA", tiles), lambda f: f(g, x), lambda o: {"gA": rel(o, want_A)},
                         M * K * es, dev)
    P["gu"] = time_piece("gu", candidates("gu", tiles), lambda f: f(g, Ab, gy, None), lambda o: {"gu": rel(o, want_u)},
                         M * K * es, dev)
    # the old two-pass kernels' pass over gy (its best sweep_train_backward shape), for reference: not a plan entry
    b = LB.Blocks(BM=128, BN=128, BK=128, warps=8, stages=3) if dev.type == "cuda" else LB.INTERPRETED
    try:
        row["twopass_gy_pass_us"] = device_us(lambda: LB.gy_pass(gy, hb, Bs, b), dev)
    except Exception as e:
        row["twopass_gy_pass_us"] = f"{type(e).__name__}: {str(e)[:160]}"
    # g's fp32 partials straight into the Triton gA and gu kernels (no sum launch): the best Triton shapes of each
    tri = {p: best({k: v for k, v in P[p].items() if k.startswith("tri:")}) for p in P}
    if all(tri.values()):
        try:
            gp, _ = parts.gy_partials(gy, hb, Bs, parts.Tile.parse(tri["gy"][0][4:]))
            ta, tu = parts.Tile.parse(tri["gA"][0][4:]), parts.Tile.parse(tri["gu"][0][4:])
            row["partials"] = {"P": gp.shape[0],
                               "gA_us": device_us(lambda: parts.grad_a(gp, x, ta), dev),
                               "gu_us": device_us(lambda: parts.grad_u(gp, Ab, torch.empty_like(x), False, tu), dev)}
        except Exception as e:  # (recorded; the plans below still run)
            row["partials_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    # end to end: the best piece of each kind composed (parts.half_backward_plan)
    plans = {"best": {p: best(P[p])[0] for p in P}}
    if all(tri.values()):
        plans["triton+p"] = {"gy": tri["gy"][0] + "+p", "gA": tri["gA"][0], "gu": tri["gu"][0]}
    row["torch_ms"] = median_ms(torch_path, rep, dev.type)
    half = lambda: lora_train.lora_train_linear_backward_half(gy, x, hb, None, Ab, Bs, s)  # noqa: E731
    row["half_ms"] = median_ms(half, rep, dev.type)
    if dev.type == "cuda":  # the same two as GPU time (graph replays): what they add to a GPU-bound step
        from bench_delta import gpu_us

        row["torch_gpu_us"], row["half_gpu_us"] = gpu_us(torch_path), gpu_us(half)
    row["plans"] = {}
    for name, plan in plans.items():
        try:
            composed = parts.half_backward_plan(plan)
            fn = lambda composed=composed: composed(gy, x, hb, None, Ab, Bs, s)  # noqa: E731
            got = fn()
            errs = {"gu": rel(got[0], want_u), "gA": rel(got[1], want_A), "gB": rel(got[2], want_B)}
            ms = median_ms(fn, rep, dev.type) if not any(v > TOL[k] for k, v in errs.items()) else float("nan")
            row["plans"][name] = {"plan": plan, "ms": ms, "x_torch": ms / row["torch_ms"], "errs": errs}
            if dev.type == "cuda" and ms == ms:
                from bench_delta import gpu_us

                us = gpu_us(fn)
                row["plans"][name].update(gpu_us=us, gpu_x_torch=us / row["torch_gpu_us"])
        except Exception as e:
            row["plans"][name] = {"plan": plan, "ms": float("nan"), "x_torch": float("nan"),
                                  "error": f"{type(e).__name__}: {str(e)[:160]}"}
    return row


def report(row: dict) -> None:
    K, N = row["K"], row["N"]
    gpu = (f"; GPU time torch {row['torch_gpu_us']:.0f} us half {row['half_gpu_us']:.0f} "
           f"({row['half_gpu_us'] / row['torch_gpu_us']:.2f}x)") if "torch_gpu_us" in row else ""
    print(f"K={K:5d} N={N:5d}: torch {row['torch_ms']:.3f} ms  half {row['half_ms']:.3f} "
          f"({row['half_ms'] / row['torch_ms']:.2f}x){gpu}", flush=True)
    for piece, rows in row["pieces"].items():
        ok = sorted((v["us"], k) for k, v in rows.items() if "us" in v)
        top = "  ".join(f"{k} {us:.0f}us {rows[k]['GBps']:.0f}GB/s" for us, k in ok[:3])
        mm = rows.get("mm", {})
        bad = [k for k, v in rows.items() if "error" in v]
        print(f"    {piece:3s} best: {top}   (cuBLAS mm {mm.get('us', float('nan')):.0f}us"
              + (f"; {len(bad)} failed: {', '.join(bad[:4])}" if bad else "") + ")", flush=True)
    if "partials_error" in row:
        print(f"    g as fp32 partials: {row['partials_error']}", flush=True)
    if "partials" in row:
        p = row["partials"]
        print(f"    g as {p['P']} fp32 partials: gA {p['gA_us']:.0f}us  gu {p['gu_us']:.0f}us", flush=True)
    for name, p in row["plans"].items():
        gpu = f", GPU {p['gpu_us']:.0f} us ({p['gpu_x_torch']:.2f}x)" if "gpu_us" in p else ""
        print(f"    plan {name:9s} {p['ms']:.3f} ms ({p['x_torch']:.2f}x torch{gpu})  {p['plan']}"
              + (f"  {p['error']}" if "error" in p else f"  errs {max(p['errs'].values()):.1e}"), flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (run under TRITON_INTERPRET=1)")
    ap.add_argument("--graph", action="store_true", help="time the pieces as CUDA graph replays (no host time)")
    a = ap.parse_args(argv)
    global GRAPH
    GRAPH = a.graph
    t0 = time.perf_counter()
    if a.smoke:
        dev, dt, M, shapes, tiles, rep = torch.device("cpu"), torch.float32, 45, [(40, 72)], SMOKE_TILES, 1
    else:
        dev, dt, M, shapes, tiles, rep = torch.device("cuda"), torch.bfloat16, 8192, SHAPES, TILES, a.repeats
    rows = []
    for K, N in shapes:
        rows.append(run_shape(K, N, M, dev, dt, tiles, rep))
        report(rows[-1])
    table = {}
    for row in rows:
        done = {k: v for k, v in row["plans"].items() if v["ms"] == v["ms"]}
        name = min(done, key=lambda k: done[k]["ms"], default=None)
        if name is not None and done[name]["ms"] < row["half_ms"]:
            table[(row["K"], row["N"])] = done[name]["plan"]
    print("shapes where a plan beat the half path:\n" + "{\n" + "".join(
        f"    {k}: {v},\n" for k, v in table.items()) + "}", flush=True)
    print(f"sweep took {time.perf_counter() - t0:.0f} s", flush=True)
    out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "piece_timer": "graph" if GRAPH else "events",
           "rows": rows, "half_backward": {f"{k[0]}x{k[1]}": v for k, v in table.items()}}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
