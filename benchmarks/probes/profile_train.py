# Measures: where a training step's time goes, fd-lora vs PEFT vs the floor (torch.profiler).
"""Where a training step's time goes, fd-lora vs PEFT (bench_train's cases): torch.profiler over `--steps` AdamW steps
after a warm-up, top ops by self CUDA time and by self CPU time, and the step's wall time; then the same for the floor
(bench_train's: the base alone, frozen, its input gradient flowing back from the first targeted block), so what the
LoRA part adds shows op by op.

    python benchmarks/probes/profile_train.py --case sdxl --out $OUT/profile_train_sdxl.json     # GPU
    python benchmarks/probes/profile_train.py --case sdxl --smoke                              # CPU, toy shapes
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

import bench_train as bt  # noqa: E402


def table(prof, key: str, n: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"op": e.key, "calls": e.count, "self_cuda_ms": e.self_device_time_total / 1e3,
             "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="sdxl", choices=list(bt.CASES))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    dev = torch.device("cpu" if a.smoke else "cuda")
    build, cfg, batch, _, loss_fn, dtype, first = bt.CASES[a.case](dev, a.smoke)
    pm, fm = bt._pair(build, cfg, dev)
    pm.train(), fm.train()
    result = {}
    for name, model in (("peft", pm), ("fd-lora", fm), ("floor", None)):
        if model is None:
            del pm, fm
            model = bt.floor_model(build, first, dev)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5) if params else None

        def step(model=model, opt=opt):
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = loss_fn(model, batch)
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        bt._sync(dev)
        host, walls = [], []  # unprofiled: the host's enqueue time per step against the step's wall time
        for _ in range(3):
            t = time.perf_counter()
            step()
            host.append((time.perf_counter() - t) * 1e3)
            bt._sync(dev)
            walls.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                    + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])) as prof:
            for _ in range(a.steps):
                step()
            bt._sync(dev)
        wall = (time.perf_counter() - t) * 1e3 / a.steps
        gpu = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / 1e3
        result[name] = {"step_ms_profiled": wall, "host_ms": min(host), "wall_ms": min(walls),
                        "gpu_ms": gpu / a.steps, "by_cuda": table(prof, "self_device_time_total", a.top),
                        "by_cpu": table(prof, "self_cpu_time_total", a.top)}
        print(f"== {name}: {wall:.1f} ms/step (profiled); unprofiled host {min(host):.1f} ms of {min(walls):.1f} ms "
              f"wall, kernels {gpu / a.steps:.1f} ms/step")
        for key in ("by_cuda", "by_cpu"):
            print(f"  -- top by {key[3:]}")
            for r in result[name][key]:
                print(f"  {r['op'][:60]:<60} {r['calls']:>6} cuda {r['self_cuda_ms'] / a.steps:8.2f} "
                      f"cpu {r['self_cpu_ms'] / a.steps:8.2f} ms/step")
        del opt
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
