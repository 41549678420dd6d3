"""Denoiser steps captured in CUDA graphs: base vs weights folded vs fd-lora frozen, with and without the cache.

What compiled and captured models run (`handle.freeze()`, then a CUDA graph of the step): every fused layer calls
fdlora::merged_linear, whose stamped merge finds nothing changed on the device and returns before the GEMM on W'
(merged-weight cache, fdlora.layers.fastpath.merged), or with the cache off the per-call kernels. Same models as
bench_pipeline.py (SDXL UNet batch 2 at 1024^2 fp16, Flux 4096 + 512 tokens bf16, real widths, `--depth` blocks).
Timed: replays of each captured step (GPU-bound, no host launch cost), interleaved in rounds, ratio to that round's
base; then "switch + replay": set_adapters between replays, so every layer re-merges inside the replay. Outputs are
checked first against the folded model (the same weights merged in fp32, one cast) and after every switch.

    python benchmarks/bench_captured.py --out benchmarks/results/<gpu>/captured.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import flux, fold, out_of, sdxl  # noqa: E402

import fdlora  # noqa: E402
from fdlora.hub.adapter import LoraAdapter, ModuleLora  # noqa: E402
from fdlora.layers.fastpath.captured import CudaGraphs  # noqa: E402


def adapter(model, targets, seed, rank=16):
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and any(path == t or path.endswith("." + t) for t in targets):
            K, N = m.in_features, m.out_features
            mods[path] = ModuleLora((torch.randn(rank, K, generator=g) / K**0.5).cuda(),
                                    (torch.randn(N, rank, generator=g) * 0.05 / rank**0.5).cuda(), None)
    return LoraAdapter(mods)


def capture(fn):
    """(graph, static output) of fn() captured after two warm-up calls on a side stream (fdlora.capture_steps' own
    mechanism)."""
    g, out = CudaGraphs(torch.device("cuda")).capture(fn)
    return g, out_of(out)


def replay_ms(g, n=5) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def bench(name, build, depth, rounds, dtype):
    base, inputs, targets = build(False, depth, torch.device("cuda"), dtype)
    ads = [adapter(base, targets, i) for i in range(4)]
    names = [f"s{i}" for i in range(4)]
    cases = {"1 adapter": ([names[0]], [1.0]), "4-adapter blend": (names, [0.7, 0.5, 0.3, 0.2])}
    res = {"model": name}
    fd = copy.deepcopy(base)
    h = fdlora.inject(fd, targets, max_slots=4, max_rank=16)
    for n, ad in zip(names, ads):
        h.add_adapter(ad, n, activate=False)
    h.freeze()
    res["layers"] = len(h.layers)
    with torch.inference_mode():
        y_base = out_of(base(**inputs)).float()
        g_base, _ = capture(lambda: base(**inputs))
        for case, (ns, ws) in cases.items():
            folded = fold(base, [(ads[names.index(n)], w) for n, w in zip(ns, ws)])
            y_ref = out_of(folded(**inputs)).float()
            effect = float((y_ref - y_base).abs().max())
            g_fold, _ = capture(lambda f=folded: f(**inputs))
            h.set_adapters(ns, ws)
            graphs = {}
            for limit, how in ((0, "fd-lora per-call"), ("auto", "fd-lora cached")):  # captured buffers stay pinned
                fdlora.set_merge_cache(limit)
                graphs[how] = capture(lambda: fd(**inputs))
                graphs[how][0].replay()
                torch.cuda.synchronize()
                err = float((graphs[how][1].float() - y_ref).abs().max())
                res[f"check {case} {how}"] = {"err_vs_folded": err, "lora_effect": effect}
                print(f"  verify {name} {case} {how}: err {err:.3g}, LoRA effect {effect:.3g}", flush=True)
                assert err <= 0.05 * effect + 2e-2, f"{name} {case} {how}: err {err} vs effect {effect}"
            res[f"merge cache MB {case}"] = fdlora.merge_cache_bytes() / 2**20
            variants = {"base": g_base, "merged": g_fold, **{k: g for k, (g, _) in graphs.items()}}
            times = {k: [] for k in variants}
            for _ in range(rounds):
                for k, g in variants.items():
                    times[k].append(replay_ms(g))
            b = statistics.median(times["base"])
            for k, ts in times.items():
                res[f"{k} {case} ms"] = statistics.median(ts)
                if k != "base":
                    res[f"{k} {case} x base"] = statistics.median(t / tb for t, tb in zip(ts, times["base"]))
            # a switch before every replay: each layer re-merges inside the graph (the miss cost)
            g_c, y_c = graphs["fd-lora cached"]
            flip = []
            for i in range(rounds):
                h.set_adapters(ns, [w * (0.5 if i % 2 else 1.0) for w in ws])
                flip.append(replay_ms(g_c, n=1))
            h.set_adapters(ns, ws)
            g_c.replay()
            torch.cuda.synchronize()
            res[f"fd-lora cached, switch + replay {case} x base"] = statistics.median(flip) / b
            err = float((y_c.float() - y_ref).abs().max())
            assert err <= 0.05 * effect + 2e-2, f"after switching back: err {err}"
            print(f"  {name} {case}: base {b:.2f} ms | " + " | ".join(
                f"{k} x{res[f'{k} {case} x base']:.3f}" for k in variants if k != "base")
                + f" | switch+replay x{res[f'fd-lora cached, switch + replay {case} x base']:.3f}", flush=True)
            del folded, g_fold, graphs, variants
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--models", default="sdxl,flux")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import diffusers

    out = {"benchmark": "captured denoiser steps", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "diffusers": diffusers.__version__, "depth": a.depth, "time": time.strftime("%Y-%m-%d %H:%M"),
           "git_sha": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()}
    builders = {"sdxl": (sdxl, torch.float16), "flux": (flux, torch.bfloat16)}
    for m in a.models.split(","):
        build, dtype = builders[m]
        out[m] = bench(m, build, a.depth, a.rounds, dtype)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
