# Measures: where a slider step's extra host time goes (set_adapters, remerge replay) on SDXL / Flux-dev.
"""Where a slider step's extra host time goes on the full-size SDXL UNet or Flux-dev transformer (`--model flux`)
(bench_fullsize's slider_every_step: the
step after `set_adapters(['a0'], [w])`, every cached layer re-merged): host ms of set_adapters, of the replay
(remerge._replay: its launch and its per-layer checks), of the rest of the step, and how many layer calls missed
the hot path, against a plain cached step. Results: benchmarks/results/<gpu>/probe_slider_host.json.

    PYTHONPATH=. python benchmarks/probes/probe_slider_host.py --out /tmp/probe_slider_host.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import fdlora  # noqa: E402
from fdlora.fixtures import fullsize  # noqa: E402
from fdlora.layers.fastpath import hot, remerge  # noqa: E402


class Clock:
    """Host ms inside wrapped functions, and hot-path misses, per step."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.misses = 0

    def wrap(self, owner, name: str, label: str):
        real = getattr(owner, name)

        @functools.wraps(real)
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.ms[label] = self.ms.get(label, 0.0) + (time.perf_counter() - t) * 1e3
        setattr(owner, name, timed)


def profile(fd, x, weights) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_run

    out = {}
    for case in ("plain", "slider"):
        with prof_run(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                if case == "slider":
                    fdlora.set_adapters(fd, ["a0"], [next(weights)])
                fd(**x)
            torch.cuda.synchronize()
        ev = prof.key_averages()
        gpu = sorted(ev, key=lambda e: -e.device_time_total)[:12]
        cpu = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]
        kernels = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA") / 2e3
        print(f"== {case}: kernels {kernels:.2f} ms per step")
        out[case] = {"kernels_ms_per_step": kernels,
                     "gpu_ms_per_step": [(e.key[:90], e.count / 2, e.device_time_total / 2e3) for e in gpu],
                     "host_ms_per_step": [(e.key[:90], e.count / 2, e.self_cpu_time_total / 2e3) for e in cpu]}
        print(f"== {case}: top kernels (GPU ms per step)")
        for k, n, ms in out[case]["gpu_ms_per_step"]:
            print(f"  {ms:8.2f}  {n:6.0f}  {k}")
        print(f"== {case}: top ops (self host ms per step)")
        for k, n, ms in out[case]["host_ms_per_step"]:
            print(f"  {ms:8.2f}  {n:6.0f}  {k}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--model", choices=["sdxl", "flux"], default="sdxl")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler, 2 plain and 2 slider steps: top kernels by GPU time, ops by host time")
    args = ap.parse_args()
    from peft import LoraConfig

    if args.model == "sdxl":
        model, targets = fullsize.sdxl_unet("cuda", torch.float16), fullsize.SDXL_TARGETS
        x = fullsize.sdxl_inputs(model, 2)
    else:
        model, targets = fullsize.flux_transformer("cuda", torch.bfloat16), fullsize.FLUX_TARGETS
        x = fullsize.flux_inputs(model)
    with torch.device("cuda"):
        for i, n in enumerate(("a0", "a1")):
            torch.manual_seed(i + 1)
            model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets,
                                         init_lora_weights=False), n)
    fd = fdlora.from_peft(model)
    clock = Clock()
    clock.wrap(remerge, "_replay", "replay")
    clock.wrap(remerge, "_full", "full pass")
    real_get = hot.get

    def counted(layer, x):
        fn = real_get(layer, x)
        clock.misses += fn is None
        return fn
    hot.get = counted  # fdlora.layers.modules.fused calls it through the module
    weights = itertools.cycle([i / 10 for i in range(1, 11)])
    rows = {}
    with torch.inference_mode():
        fdlora.set_adapters(fd, ["a0"])
        for _ in range(3):
            fd(**x)
        for case in ("plain", "slider"):
            per = []
            for _ in range(args.steps):
                torch.cuda.synchronize()
                clock.ms, clock.misses = {}, 0
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                if case == "slider":
                    fdlora.set_adapters(fd, ["a0"], [next(weights)])
                t1 = time.perf_counter()
                fd(**x)
                t2 = time.perf_counter()
                end.record()
                end.synchronize()
                per.append({"set_adapters": (t1 - t0) * 1e3, "forward host": (t2 - t1) * 1e3,
                            "step gpu": start.elapsed_time(end), "misses": clock.misses, **clock.ms})
            rows[case] = {k: statistics.median(p.get(k, 0.0) for p in per[2:]) for k in per[-1]}
            print(case, {k: round(v, 2) for k, v in rows[case].items()}, flush=True)
        if args.profile:
            rows["profile"] = profile(fd, x, weights)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "model": args.model,
                                        "layers": len(fdlora.handle(fd).layers),
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
