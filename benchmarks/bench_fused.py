"""Layer-level benchmark of lora_linear: base GEMM + LoRA in one kernel vs cuBLAS base (+ delta).

For each layer shape (`--shapes layers`, the default: every real layer shape of SDXL at 1024², Flux-dev and
Llama-3-8B, prefill and decode rows; `legacy`: the earlier SDXL / Flux set) in bf16 with bias, and LoRA case (r16,
r64, a 4-adapter blend of total rank 64; r16 only at 256 rows or fewer), it first checks every path and the
registered op against a float64 CPU
oracle on sampled rows, then times GPU work alone (CUDA graphs over 4 rotating input sets, so
inputs come from HBM as in a model): the cuBLAS base GEMM, each path of lora_linear_dispatch
(fused, fused_pre, cublas_delta, merged, reference), the op (the path the dispatch chose), the
fused kernel as a plain GEMM and the merge alone. It reports TFLOP/s, (base + LoRA) / base,
whether the dispatch's choice is within 3% of the best path, its target, and eager times (host launch cost
included) of the base and the op. Targets, r16 on the real layer shapes: within 1.08x the cuBLAS base GEMM where the
LoRA's FLOPs are at most 2% of the base's, 1.03x plus that share elsewhere; on the legacy set, per model and LoRA.

    python benchmarks/bench_fused.py --out benchmarks/results/<gpu-slug>/fused.json
    python benchmarks/bench_fused.py --sweep ...   # also time every config of both fused forms

--warm N compiles every kernel variant first in N worker processes (Triton's disk cache is shared),
so the timed process only loads binaries. --check-dispatch FILE re-evaluates the current cost model
(lora_linear_dispatch.estimate) against the per-path GPU times recorded in FILE, without a GPU:
for every row, the modelled choice's measured time over the measured best (must be <= 1.03).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [  # model, M, K, N
    ("sdxl", 8192, 1280, 1280),
    ("sdxl", 16384, 640, 640),
    ("sdxl", 8192, 1280, 5120),
    ("sdxl", 8192, 5120, 1280),
    ("flux", 4608, 3072, 3072),
    ("flux", 4608, 3072, 12288),
    ("flux", 4608, 12288, 3072),
]
LAYERS = [  # the real layer shapes (model, rows, in, out) of SDXL at 1024² (batch 2), Flux-dev and Llama-3-8B
    *[("sdxl", M, K, N) for M, K, N in ((8192, 640, 640), (8192, 640, 5120), (8192, 2560, 640),  # 2 x 4096 tokens
                                        (2048, 1280, 1280), (2048, 1280, 10240), (2048, 5120, 1280),  # 2 x 1024
                                        (154, 2048, 640), (154, 2048, 1280))],  # text keys / values, 2 x 77
    *[("flux", M, K, N) for M in (4096, 512) for K, N in ((3072, 3072), (3072, 12288), (12288, 3072))],
    *[("llama", M, K, N) for M in (32, 2048) for K, N in ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))],
]
DECODE = [("llm-decode", 32, 4096, 4096)]
LORAS = {  # name: (S, R, live ranks, per-slot scale)
    "r16": (1, 16, [16], [2.0]),
    "r64": (1, 64, [64], [0.5]),
    "blend4x16": (4, 16, [16, 16, 16, 16], [0.8, 0.6, 0.4, 0.2]),
}
TARGETS = {("flux", "r16"): 1.10, ("sdxl", "r16"): 1.25, ("flux", "r64"): 1.25, ("sdxl", "r64"): 1.50,
           ("flux", "blend4x16"): 1.25, ("sdxl", "blend4x16"): 1.50}  # --shapes legacy


def layer_target(K: int, N: int, lora: str) -> float | None:
    """--shapes layers, r16: base + LoRA within 1.08x the cuBLAS base GEMM where the LoRA's FLOPs are at most 2% of
    the base's, within 1.03x plus that share elsewhere."""
    if lora != "r16":
        return None
    share = 16 * (K + N) / (K * N)
    return 1.08 if share <= 0.02 else round(1.03 + share, 4)


def inputs(M, K, N, lora, device="cuda", dtype=torch.bfloat16, seed=0):
    S, R, ranks, scales = LORAS[lora]
    g = torch.Generator(device=device).manual_seed(seed)
    A = torch.zeros(S, R, K, device=device, dtype=dtype)
    B = torch.zeros(N, S, R, device=device, dtype=dtype)
    for s, r in enumerate(ranks):
        A[s, :r] = (torch.randn(r, K, generator=g, device=device) * K**-0.5).to(dtype)
        B[:, s, :r] = (torch.randn(N, r, generator=g, device=device) * r**-0.5).to(dtype)
    return dict(
        x=torch.randn(M, K, generator=g, device=device).to(dtype),
        W=(torch.randn(N, K, generator=g, device=device) * K**-0.5).to(dtype),
        bias=torch.randn(N, generator=g, device=device).to(dtype),
        A=A, B=B,
        scale=torch.tensor(scales, device=device, dtype=torch.float32),
        group_weight=torch.ones(1, S, device=device),
        ranks=torch.tensor(ranks, device=device, dtype=torch.int32),
    )


def args_of(d):
    return (d["x"], d["W"], d["bias"], d["A"], d["B"], d["scale"], d["group_weight"], d["ranks"])


ORACLE_ROWS = 256  # rows checked against the float64 oracle (first, last and random ones)


def oracle_rows(d):
    """(row indices, float64 CPU oracle of y at those rows): independent of any GPU kernel or state."""
    M = d["x"].shape[0]
    g = torch.Generator().manual_seed(1)
    rows = torch.cat([torch.tensor([0, M - 1]), torch.randint(0, M, (ORACLE_ROWS,), generator=g)]).unique()
    x = d["x"][rows.to(d["x"].device)].cpu().double()
    W, A, B = (d[k].cpu().double() for k in ("W", "A", "B"))
    S, R, K = A.shape
    w = (d["scale"].cpu().double() * d["group_weight"][0].cpu().double()).repeat_interleave(R)  # [S*R]
    h = (x @ A.reshape(S * R, K).t()) * w
    return rows, x @ W.t() + d["bias"].cpu().double() + h @ B.reshape(-1, S * R).t()


def lora_flops(M, K, N, lora):
    S, R, ranks, _ = LORAS[lora]
    return 2.0 * M * sum(ranks) * (K + N)


# --- compile warm-up in worker processes ---------------------------------------------------------


def warm_tasks(sweep: bool, decode: bool) -> list[tuple]:
    from fdlora.kernels.triton.forward import lora_linear as L

    cfgs = SWEEP_CONFIGS() if sweep else L.CONFIGS["many"]
    tasks = []
    for lora in LORAS:
        for pre in (False, True):
            for i in range(len(cfgs)):
                tasks.append(("cfg", lora, pre, i, sweep, 256))
        tasks.append(("delta", lora, 256))
        tasks.append(("shrink", lora, 256))
        tasks.append(("merge", lora, 256))
    if decode:
        for pre in (False, True):
            for i in range(len(L.CONFIGS["few"])):
                tasks.append(("few", "r16", pre, i, 32))
        tasks.append(("delta", "r16", 32))
        tasks.append(("shrink", "r16", 32))
    return tasks


def SWEEP_CONFIGS():
    from fdlora.kernels.triton.forward.lora_linear import _cfg

    return [
        _cfg(8, 3, 128, 256, 64), _cfg(8, 4, 128, 256, 64), _cfg(8, 4, 128, 128, 64), _cfg(8, 3, 256, 128, 64),
        _cfg(8, 3, 128, 128, 128), _cfg(8, 3, 128, 256, 64, persistent=1), _cfg(4, 4, 128, 128, 64),
        _cfg(8, 4, 128, 128, 64, persistent=1),
    ]


def run_warm(tasks: list[tuple]) -> list[str]:
    from fdlora.kernels.triton.forward import lora_linear as L
    from fdlora.kernels.triton.forward.lora_delta import lora_delta
    from fdlora.kernels.triton.forward.lora_shrink import launch_shrink
    from fdlora.kernels.triton.merge.lora_merge import launch_merge

    out = []
    for t in tasks:
        t0 = time.time()
        try:
            if t[0] in ("cfg", "few"):
                _, lora, pre, i, *rest = t
                M = rest[-1]
                sweep = t[0] == "cfg" and rest[0]
                cfg = (SWEEP_CONFIGS() if sweep else L.CONFIGS["many" if t[0] == "cfg" else "few"])[i]
                d = inputs(M, 256, 256, lora)
                L.launch_lora_linear(*args_of(d), pre=pre, config=cfg)
            elif t[0] == "delta":
                d = inputs(t[2], 256, 256, t[1])
                y = F.linear(d["x"], d["W"], d["bias"])
                lora_delta(y, d["x"], d["A"], d["B"], d["scale"], d["group_weight"], d["ranks"])
            elif t[0] == "merge":
                d = inputs(t[2], 256, 256, t[1])
                launch_merge(d["W"], d["A"], d["B"], d["scale"], d["group_weight"], d["ranks"])
            else:
                d = inputs(t[2], 256, 256, t[1])
                launch_shrink(d["x"], d["A"], d["scale"], d["ranks"])
            torch.cuda.synchronize()
            out.append(f"{t}: ok {time.time() - t0:.1f}s")
        except Exception as e:
            out.append(f"{t}: FAILED {type(e).__name__}: {str(e)[:300]}")
    return out


def warm(n: int, sweep: bool, decode: bool) -> None:
    import multiprocessing as mp

    tasks = warm_tasks(sweep, decode)
    chunks = [tasks[i::n] for i in range(n)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(n) as pool:
        for lines in pool.map(run_warm, [c for c in chunks if c]):
            for line in lines:
                if "FAILED" in line:
                    print("warm:", line, flush=True)
    print(f"warm: {len(tasks)} kernel variants compiled in {time.time() - t0:.0f}s on {n} workers", flush=True)


# --- timing ----------------------------------------------------------------------------------------


ROTATE = 4  # input sets cycled through in every timed graph: their bytes exceed L2, as in a model


def bench_us(fn) -> float:
    """Eager median (host launch cost included), L2 flushed between repeats."""
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def capture_calls(calls, reps: int = 3):
    """(CUDA graph of `calls` (one per input set) captured `reps` times, calls in it), after one warm call each
    (compile / autotune outside the capture) and one replay."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for c in calls:
                c()
    g.replay()
    torch.cuda.synchronize()
    return g, reps * len(calls)


def graph_us(calls, reps: int = 3) -> float:
    """GPU microseconds per call: `calls` (one per input set) captured `reps` times in a CUDA graph,
    replayed; the median of 7 replays over the number of calls. No host launch cost inside."""
    g, n = capture_calls(calls, reps)
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    del g
    return sorted(ts)[len(ts) // 2]


def bench_case(model: str, M: int, K: int, N: int, lora: str, paths: list[str], sweep_cfgs: list) -> dict:
    from torch._library.triton import set_wrap_triton_enabled

    from fdlora.kernels.triton import config as C
    from fdlora.kernels.triton.forward import lora_linear as L
    from fdlora.kernels.triton.forward import lora_linear_dispatch as D
    from fdlora.kernels.triton.forward.lora_shrink import launch_shrink
    from fdlora.kernels.triton.merge.lora_merge import launch_merge, new_stamp

    sets = [inputs(M, K, N, lora, seed=i) for i in range(ROTATE)]
    d = sets[0]
    args = args_of(d)
    rows, ref = oracle_rows(d)
    row = {"model": model, "M": M, "K": K, "N": N, "lora": lora, "rank_total": sum(LORAS[lora][2])}
    errs, ok = {}, True
    for p in (*paths, "op"):
        y = torch.ops.fdlora.lora_linear(*args) if p == "op" else L.run_path(p, *args)
        assert y.shape == (M, N) and not y.isnan().any(), f"{p}: NaN or wrong shape"
        yr = y[rows.to(y.device)].cpu().double()
        errs[p] = float((yr - ref).norm() / ref.norm())
        ok &= errs[p] < 1e-2
        if errs[p] >= 1e-2:
            print(f"VERIFY FAILED {model} {M}x{K}->{N} {lora} {p}: rel err {errs[p]:.2e}", flush=True)
    row["rel_err_vs_fp64"] = errs
    row["verified"] = bool(ok)

    arg_sets = [args_of(s) for s in sets]
    zero_sets = [args_of(dict(s, scale=torch.zeros_like(s["scale"]))) for s in sets]

    def each(fn, over=arg_sets):
        return [lambda a=a: fn(*a) for a in over]

    # direct launches run as inside the registered op: straight to the kernel, no HOP dispatch
    with set_wrap_triton_enabled(False):
        t = {"cublas_base": graph_us([lambda s=s: F.linear(s["x"], s["W"], s["bias"]) for s in sets])}
        for p in paths:
            t[p] = graph_us(each(lambda *a, p=p: L.run_path(p, *a)))
        t["op"] = graph_us(each(torch.ops.fdlora.lora_linear))
        problem = D.Problem(M, K, N, *d["A"].shape[:2], d["x"].dtype, "cuda", C.device_sms(d["x"]))
        plan = D.plan(problem)
        row["chosen"] = plan.path
        row["plan"] = str(plan)
        row["model_us"] = D.estimate(problem)
        row["us"] = t
        row["eager_us"] = {"cublas_base": bench_us(lambda: F.linear(d["x"], d["W"], d["bias"])),
                           "op": bench_us(lambda: torch.ops.fdlora.lora_linear(*args))}
        # the fused kernel as a plain GEMM (every slot at scale 0; autotuned), and the merge alone
        t["triton_gemm"] = graph_us(each(lambda *a: L.launch_lora_linear(*a, pre=True), zero_sets))
        t["merge_only"] = graph_us(each(lambda x, W, b, A, B, sc, gw, rk: launch_merge(W, A, B, sc, gw, rk)))
        # an eager blend-mode layer with the merged-weight cache (fdlora.layers.fastpath.merged): once W' is merged
        # (merge_only, after each switch), every call is one cuBLAS GEMM on W'
        merged = [launch_merge(a[1], *a[3:6], a[6], a[7])[0] for a in arg_sets]
        t["cached"] = graph_us([lambda s=s, w=w: F.linear(s["x"], w, s["bias"]) for s, w in zip(sets, merged)])
        # the same cache in a compiled / captured layer (fdlora::merged_linear): every call launches the stamped
        # merge, which finds nothing changed on the device and returns, then the GEMM on W'
        version = torch.zeros(1, dtype=torch.int32, device="cuda")
        stamps = [new_stamp(d["A"].shape[0], "cuda") for _ in sets]

        def checked(s, w, st):
            launch_merge(s["W"], s["A"], s["B"], s["scale"], s["group_weight"], s["ranks"], out=w[None], stamp=st,
                         version=version)
            return F.linear(s["x"], w, s["bias"])

        t["cached_checked"] = graph_us([lambda s=s, w=w, st=st: checked(s, w, st)
                                        for s, w, st in zip(sets, merged, stamps)])
        y = checked(d, merged[0], stamps[0])
        errs["cached_checked"] = float((y[rows.to(y.device)].cpu().double() - ref).norm() / ref.norm())
        row["verified"] = bool(row["verified"] and errs["cached_checked"] < 1e-2)
        del merged
        sw_txt = ""
        if sweep_cfgs:
            sw = {}
            for i, cfg in enumerate(sweep_cfgs):
                for pre in (False, True):
                    name = f"{'pre' if pre else 'fused'}-{i}"
                    try:
                        sw[name] = graph_us(each(lambda *a, cfg=cfg, pre=pre: L.launch_lora_linear(
                            *a, pre=pre, config=cfg)))
                    except Exception as e:  # out of shared memory etc.
                        sw[name] = f"{type(e).__name__}"
            timed = {k: v for k, v in sw.items() if isinstance(v, float)}
            best_f = min((v, k) for k, v in timed.items() if k.startswith("fused"))
            best_p = min((v, k) for k, v in timed.items() if k.startswith("pre"))
            gemm = {}
            for i, cfg in enumerate(sweep_cfgs):  # the kernel as a plain GEMM: every slot at scale 0
                try:
                    gemm[i] = graph_us(each(lambda *a, cfg=cfg: L.launch_lora_linear(*a, pre=True, config=cfg),
                                            zero_sets))
                except Exception:
                    pass
            gi = min(gemm, key=gemm.get)
            sw["gemm_only_best"] = gemm[gi]
            sw["gemm_only_best_cfg"] = gi
            sw["shrink_only"] = graph_us([lambda s=s: launch_shrink(s["x"], s["A"], s["scale"], s["ranks"])
                                          for s in sets])
            row["sweep_us"] = sw
            sw_txt = (f" | sweep fused {best_f[0]:.1f}({best_f[1]}) pre {best_p[0]:.1f}({best_p[1]}) "
                      f"gemm {gemm[gi]:.1f}({gi}) shrink {sw['shrink_only']:.1f}")
    base_flops = 2.0 * M * N * K
    extra = lora_flops(M, K, N, lora)
    cands = {p: t[p] for p in paths}
    best = min(cands, key=cands.get)
    row["best_path"] = best
    row["chosen_over_best"] = cands[plan.path] / cands[best]
    row["op_over_best"] = t["op"] / cands[best]
    row["ratio"] = {p: t[p] / t["cublas_base"] for p in (*paths, "op")}
    row["tflops"] = {"cublas_base": base_flops / t["cublas_base"] / 1e6,
                     "triton_gemm": base_flops / t["triton_gemm"] / 1e6,
                     **{p: (base_flops + extra) / t[p] / 1e6 for p in (*paths, "op")}}
    tgt = layer_target(K, N, lora) if (model, M, K, N) in LAYERS else TARGETS.get((model, lora))
    row["target"] = tgt
    row["met"] = None if tgt is None else bool(t["op"] / t["cublas_base"] <= tgt)
    row["ratio_cached"] = t["cached"] / t["cublas_base"]
    row["met_cached"] = None if tgt is None else bool(row["ratio_cached"] <= tgt)
    row["ratio_cached_checked"] = t["cached_checked"] / t["cublas_base"]
    row["met_cached_checked"] = None if tgt is None else bool(row["ratio_cached_checked"] <= tgt)
    print(f"{model:10s} {M:5d}x{K:5d}->{N:5d} {lora:9s} base {t['cublas_base']:6.1f}us "
          f"({row['tflops']['cublas_base']:.0f} TF) " + " ".join(f"{p} {t[p]:6.1f}" for p in paths)
          + f" | op {t['op']:6.1f} ({plan.path}; best {best}, x{row['chosen_over_best']:.3f})"
          + f" ratio {t['op'] / t['cublas_base']:.3f}" + (f" <= {tgt}" if tgt else "")
          + f" | cached {row['ratio_cached']:.3f} checked {row['ratio_cached_checked']:.3f}"
          + f" | triton gemm {row['tflops']['triton_gemm']:.0f} TF, merge {t['merge_only']:.1f}"
          + f" | eager op {row['eager_us']['op']:.0f}" + sw_txt, flush=True)
    return row


def check_dispatch(results: Path, out: Path | None) -> None:
    """The current model's choice for every recorded row, judged by that row's measured path times."""
    from fdlora.kernels.triton.forward import lora_linear_dispatch as D

    data = json.loads(results.read_text())
    rows = []
    for r in data["rows"]:
        S, R = LORAS[r["lora"]][:2]
        problem = D.Problem(r["M"], r["K"], r["N"], S, R, torch.bfloat16, "cuda", data["sms"])
        est = D.estimate(problem)
        timed = {p: r["us"][p] for p in est if p in r["us"]}
        chosen = min(est, key=est.get)
        best = min(timed, key=timed.get)
        ratio = timed[chosen] / timed[best]
        rows.append({"model": r["model"], "M": r["M"], "K": r["K"], "N": r["N"], "lora": r["lora"],
                     "chosen": chosen, "best": best, "chosen_over_best": ratio,
                     "chosen_over_base": timed[chosen] / r["us"]["cublas_base"], "target": r["target"],
                     "met": None if r["target"] is None else timed[chosen] / r["us"]["cublas_base"] <= r["target"],
                     "model_us": est})
        print(f"{r['model']:10s} {r['M']:5d}x{r['K']:5d}->{r['N']:5d} {r['lora']:9s} chosen {chosen:12s} "
              f"best {best:12s} x{ratio:.3f}  (base+LoRA)/base {timed[chosen] / r['us']['cublas_base']:.3f}"
              + (f" <= {r['target']}" if r["target"] else ""))
    summary = {"source": str(results), "gpu": data["gpu"], "rows": len(rows),
               "dispatch_within_3pct": all(r["chosen_over_best"] <= 1.03 for r in rows),
               "worst_chosen_over_best": max(r["chosen_over_best"] for r in rows),
               "targets_met": sum(1 for r in rows if r["met"]),
               "targets_total": sum(1 for r in rows if r["met"] is not None),
               "note": "in-sample: the model constants were fitted to these measurements"}
    print(json.dumps(summary))
    if out:
        out.write_text(json.dumps({**summary, "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sweep", action="store_true", help="also time every sweep config of both fused forms")
    ap.add_argument("--decode", action="store_true", help="add decode-sized shapes (M=32)")
    ap.add_argument("--shapes", choices=["layers", "legacy"], default="layers",
                    help="layers: every real layer shape of SDXL, Flux-dev and Llama-3-8B (targets by LoRA FLOP "
                         "share); legacy: the earlier SDXL / Flux set (fused.json before)")
    ap.add_argument("--warm", type=int, default=0, help="compile in this many worker processes first")
    ap.add_argument("--warm-only", action="store_true", help="compile, then exit (run beside the tests)")
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--only", default=None, help="comma list of model names or loras to keep")
    ap.add_argument("--check-dispatch", type=Path, default=None, help="results JSON to re-judge the model on")
    ap.add_argument("--dispatch", choices=["model", "measure"], default=None,
                    help="FDLORA_DISPATCH for this run (measure: the op times close paths on its first call)")
    a = ap.parse_args()
    if a.check_dispatch:
        return check_dispatch(a.check_dispatch, a.out)
    if a.dispatch:
        os.environ["FDLORA_DISPATCH"] = a.dispatch

    import triton

    from fdlora.kernels.triton.forward import lora_linear as L
    from fdlora.kernels.triton.forward import lora_linear_dispatch as D

    if a.warm:
        warm(a.warm, a.sweep, a.decode)
    if a.warm_only:
        return
    sha = a.git_sha
    if sha is None:
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
        except OSError:
            sha = None
    props = torch.cuda.get_device_properties(0)
    meta = {
        "benchmark": "fused_lora_linear", "gpu": props.name, "sms": props.multi_processor_count,
        "gpu_slug": re.sub(r"[^a-z0-9]+", "-", props.name.lower()).strip("-"),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "git_sha": sha, "dtype": "bfloat16",
        "dispatch": os.environ.get("FDLORA_DISPATCH", "model"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "timing": (f"GPU time: CUDA graph of {ROTATE} rotating input sets x 3, median of 7 replays per call; "
                   "eager_us: triton.testing.do_bench median with host launch cost, L2 flushed"),
    }
    print(json.dumps(meta), flush=True)
    rows = []
    shapes = (LAYERS if a.shapes == "layers" else SHAPES) + (DECODE if a.decode else [])
    keep = set(a.only.split(",")) if a.only else None
    sweep_cfgs = SWEEP_CONFIGS() if a.sweep else []
    paths = [p for p in D.PATHS if p != "cublas_delta" or D.delta_available()]
    for model, M, K, N in shapes:
        for lora in LORAS:
            if keep and model not in keep and lora not in keep:
                continue
            if (model == "llm-decode" or M <= 256) and lora != "r16":
                continue
            rows.append(bench_case(model, M, K, N, lora, paths, sweep_cfgs))
    summary = {
        "all_verified": all(r["verified"] for r in rows),
        "targets_met": sum(1 for r in rows if r["met"]), "targets_total": sum(1 for r in rows if r["met"] is not None),
        "targets_met_cached": sum(1 for r in rows if r.get("met_cached")),
        "targets_met_cached_checked": sum(1 for r in rows if r.get("met_cached_checked")),
        "dispatch_within_3pct": all(r["chosen_over_best"] <= 1.03 for r in rows),
        "worst_chosen_over_best": max(r["chosen_over_best"] for r in rows) if rows else None,
    }
    print(json.dumps(summary), flush=True)
    tuned = {f"{'few' if few else 'many'}": {str(k): str(v) for k, v in L._KERNELS[(few, True)].cache.items()}
             for few in (True, False)}
    print(json.dumps(tuned), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({**meta, "summary": summary, "autotuned": tuned, "rows": rows}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
