# Measures: an eager denoiser step's host enqueue vs GPU time and per-op profile, merge cache on / off.
# Showed: eager SDXL step host vs GPU time, merge cache on/off (why the cache). profile_sdxl_percall.json
"""Where an eager denoiser step with fd-lora spends its time: host enqueue vs GPU, per-op profile.

    python benchmarks/probes/profile_step.py --model sdxl --depth 2      # GPU: prints tables, writes --out JSON
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_pipeline as bp  # noqa: E402

import fdlora  # noqa: E402
from fdlora.kernels.triton.forward import lora_linear_dispatch as D  # noqa: E402


def host_and_gpu_ms(fn, n=15):
    """(host ms to enqueue one call, wall ms of one call including the GPU), medians."""
    fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e3)
    return sorted(host)[n // 2], sorted(wall)[n // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="sdxl")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--merge-cache", default="auto", help='fdlora.set_merge_cache limit ("0": the per-call paths)')
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    fdlora.set_merge_cache(a.merge_cache)
    from peft import LoraConfig

    from fdlora.integrations.transformers import adapter_from_peft

    build, dtype = {"sdxl": (bp.sdxl, torch.float16), "flux": (bp.flux, torch.bfloat16)}[a.model]
    base, inputs, targets = build(False, a.depth, torch.device("cuda"), dtype)
    peft_m = copy.deepcopy(base)
    peft_m.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets, init_lora_weights=False), "a")
    ad = adapter_from_peft(peft_m, "a")
    fd = copy.deepcopy(base)
    h = fdlora.inject(fd, targets, max_slots=4, max_rank=16)
    h.add_adapter(ad, "a")
    folded = bp.fold(base, [(ad, 1.0)])
    res = {"model": a.model, "depth": a.depth, "layers": len(h.layers), "device": torch.cuda.get_device_name(),
           "merge_cache": a.merge_cache}
    with torch.inference_mode():
        for name, m in (("base", base), ("merged", folded), ("peft", peft_m), ("fdlora", fd), ("base", base),
                        ("fdlora", fd)):
            res[name] = host_and_gpu_ms(lambda m=m: m(**inputs))
            print(f"{name:8s} host enqueue {res[name][0]:8.2f} ms   wall {res[name][1]:8.2f} ms")
        res["plans"] = {str((p.M, p.K, p.N, p.S, p.R, p.G)): str(v) for p, v in D._PLANS.items()}
        for k, v in res["plans"].items():
            print(" plan", k, v)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fd(**inputs)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cpu_time_total", row_limit=25))
        print(ka.table(sort_by="self_cuda_time_total", row_limit=25))
        res["top_cpu"] = [(e.key, e.count, e.self_cpu_time_total) for e in
                          sorted(ka, key=lambda e: -e.self_cpu_time_total)[:30]]
        res["top_cuda"] = [(e.key, e.count, getattr(e, "self_device_time_total", 0)) for e in
                           sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", 0))[:30]]
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    with torch.inference_mode():
        pr.enable()
        for _ in range(3):
            fd(**inputs)
        pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue()[:6000])
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
