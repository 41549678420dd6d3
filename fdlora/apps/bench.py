"""`fdlora bench`: run the benchmark suite (benchmarks/bench_*.py) or a named subset, one subprocess each.

Each benchmark writes OUT/<name>.json; a summary table is printed and OUT/summary.json lists every
benchmark's status (ok / failed / skipped, with the reason). Without a CUDA device the GPU-only
benchmarks are skipped and say so; set_adapters runs on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..errors import FdLoraError

# name -> (script, needs a GPU, extra args with --quick, what it measures)
BENCHMARKS = {
    "set_adapters": ("bench_set_adapters.py", False, ["--layers", "40", "--adapters", "8", "--repeats", "20"],
                     "set_adapters latency: fd-lora table write vs diffusers+PEFT layer walk (CPU ok)"),
    "delta": ("bench_delta.py", True, ["--quick"], "LoRA delta kernels vs torch on real model shapes"),
    "fused": ("bench_fused.py", True, [], "fused base GEMM + LoRA kernels vs cuBLAS + LoRA"),
    "pipeline": ("bench_pipeline.py", True, ["--repeats", "3"], "SDXL / Flux denoiser steps with adapters"),
    "load": ("bench_load.py", True, ["--repeats", "3"], "adapter load time, fd-lora vs diffusers+PEFT"),
    "llm": ("bench_llm.py", True, ["--reps", "5"], "Llama decode / prefill with adapters vs PEFT"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "benchmarks: " + ", ".join(BENCHMARKS) + " (all when none is named)"
    p.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all); see --list")
    p.add_argument("--out", type=Path, default=Path("fdlora-bench"), help="folder for <name>.json and summary.json")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a smoke run)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per benchmark")


def benchmarks_dir() -> Path:
    d = Path(__file__).resolve().parents[2] / "benchmarks"
    if not d.is_dir():
        raise FdLoraError(f"benchmark scripts not found at {d}; `fdlora bench` runs from a source checkout "
                          "(git clone the repository and pip install -e .)")
    return d


def _gpu() -> tuple[bool, str]:
    import torch

    if torch.cuda.is_available():
        return True, torch.cuda.get_device_name()
    return False, "CPU (no CUDA device)"


def _headline(data: dict) -> str:
    nums = [(k, v) for k, v in data.items() if isinstance(v, float) and k.endswith(("_ms", "_s"))]
    return ", ".join(f"{k}={v:.3g}" for k, v in nums[:3])


def run(args: argparse.Namespace) -> int:
    if args.list:
        for name, (script, gpu, _, what) in BENCHMARKS.items():
            print(f"{name:13s} {'GPU' if gpu else 'CPU'}  {script:22s} {what}")
        return 0
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        raise FdLoraError(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}")
    names = list(dict.fromkeys(args.names)) or list(BENCHMARKS)
    bench_dir = benchmarks_dir()
    has_gpu, device = _gpu()
    print(f"fdlora bench on {device}" + ("" if has_gpu else ": GPU-only benchmarks are skipped"))
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(bench_dir.parent),
                                                                     os.environ.get("PYTHONPATH")]))}
    rows = []
    for name in names:
        script, needs_gpu, quick, _ = BENCHMARKS[name]
        out = args.out / f"{name}.json"
        row = {"name": name, "status": "skipped", "seconds": 0.0, "json": None, "note": ""}
        rows.append(row)
        if needs_gpu and not has_gpu:
            row["note"] = "needs a CUDA GPU (none present)"
            continue
        cmd = [sys.executable, str(bench_dir / script), "--out", str(out)] + (quick if args.quick else [])
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            row.update(status="failed", note=f"timed out after {args.timeout:g} s")
            continue
        finally:
            row["seconds"] = round(time.perf_counter() - t, 2)
        if proc.returncode != 0 or not out.exists():
            last = (proc.stderr or proc.stdout).strip().splitlines()
            row.update(status="failed", note=f"exit {proc.returncode}: {last[-1] if last else 'no output'}")
            continue
        row.update(status="ok", json=str(out), note=_headline(json.loads(out.read_text())))
    print(f"\n{'benchmark':13s} {'status':8s} {'time s':>7s}  result")
    for r in rows:
        print(f"{r['name']:13s} {r['status']:8s} {r['seconds']:7.1f}  {r['json'] or ''} {r['note']}".rstrip())
    summary = args.out / "summary.json"
    summary.write_text(json.dumps({"device": device, "gpu": has_gpu, "quick": args.quick, "benchmarks": rows},
                                  indent=2))
    print(f"summary written to {summary}")
    return 1 if any(r["status"] == "failed" for r in rows) else 0
