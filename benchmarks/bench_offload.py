"""Offload benchmark (issue 26, part 2): full-size SDXL UNet and Flux-dev transformer steps under offload,
fd-lora vs diffusers+PEFT under the same offload.

The denoiser is built on the CPU (fdlora.fixtures.fullsize: real config, random weights, fp16 / bf16), two r16 PEFT
adapters a0, a1 are added (init_lora_weights=False, B scaled by 0.1) and blended 0.8 / 0.4; the fd-lora copy is a deep
copy converted with `fdlora.from_peft`. Each (impl, mode) gets a fresh copy with the offload applied:

- model:      accelerate.cpu_offload_with_hook (what enable_model_cpu_offload puts on each component). Rows "cold"
              (the component moved back to the CPU before every step: onload + step) and "warm" (it stays onloaded
              between steps, as during a pipeline's denoising loop);
- group:      diffusers.hooks.apply_group_offloading, leaf level, with a CUDA stream (on CUDA);
- sequential: accelerate.cpu_offload (what enable_sequential_cpu_offload does): slow, every weight crosses PCIe.

Verification first: fd-lora's step output against diffusers+PEFT's under the same offload (max |d| / max |ref| within
the dtype's tolerance, and the LoRA's effect over the base must be visible); then `--rounds` timed steps (median ms,
CUDA synchronised, host time included). Each row also says how many fused layers run offloaded (no merged-weight
cache: fdlora.layers.storage.offload) and how many merged-weight bytes are held after the step.

    python3 benchmarks/bench_offload.py --model sdxl --out $OUT/offload.json
    python3 benchmarks/bench_offload.py --model flux --modes model,group --out $OUT/offload.json
    python3 benchmarks/bench_offload.py --smoke --out /tmp/o.json      # toy widths on CPU, seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fdlora  # noqa: E402
from fdlora.fixtures import fullsize  # noqa: E402
from fdlora.layers.storage.offload import offloaded_layers  # noqa: E402

warnings.filterwarnings("ignore")
TOL = {torch.float16: 2e-2, torch.bfloat16: 4e-2, torch.float32: 1e-4}
NAMES, BLEND = ["a0", "a1"], [0.8, 0.4]


def to(obj, dev):
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, dict):
        return {k: to(v, dev) for k, v in obj.items()}
    return obj


def out_of(y) -> torch.Tensor:
    y = y[0] if isinstance(y, tuple) else y
    return getattr(y, "sample", y)


def build(name: str, smoke: bool, dtype: torch.dtype):
    """(PEFT model on the CPU, its base without LoRA, step kwargs)."""
    from peft import LoraConfig

    if name == "sdxl":
        model, targets = fullsize.sdxl_unet("cpu", dtype, smoke), fullsize.SDXL_TARGETS
        kw = fullsize.sdxl_inputs(model, 2, fullsize.SDXL_TOKENS_TINY if smoke else fullsize.SDXL_TOKENS)
    else:
        model, targets = fullsize.flux_transformer("cpu", dtype, smoke), fullsize.FLUX_TARGETS
        kw = fullsize.flux_inputs(model, 1, fullsize.FLUX_TOKENS_TINY if smoke else fullsize.FLUX_TOKENS)
    base = copy.deepcopy(model)
    for i, n in enumerate(NAMES):
        torch.manual_seed(i + 1)
        model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets, init_lora_weights=False), n)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.1)
    model.set_adapters(NAMES, BLEND)
    return model, base, kw


def offload(model, mode: str, dev: torch.device):
    """Apply `mode` to `model`; returns a callable that puts a model-offloaded component back on the CPU."""
    import accelerate

    if mode == "model":
        model, hook = accelerate.cpu_offload_with_hook(model, dev)
        return hook.offload
    if mode == "group":
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(model, onload_device=dev, offload_device=torch.device("cpu"), offload_type="leaf_level",
                               use_stream=dev.type == "cuda")
        return lambda: None
    if mode == "sequential":
        accelerate.cpu_offload(model, dev)
        return lambda: None
    raise SystemExit(f"unknown mode {mode!r}: model, group or sequential")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(step, dev: torch.device, rounds: int, before=lambda: None) -> float:
    ms = []
    for _ in range(rounds):
        before()
        sync(dev)
        t = time.perf_counter()
        step()
        sync(dev)
        ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms)


def run_model(name: str, modes: list[str], dev: torch.device, dtype: torch.dtype, rounds: int, smoke: bool) -> list:
    peft_model, base, kw = build(name, smoke, dtype)
    fd_model = fdlora.from_peft(copy.deepcopy(peft_model))
    fdlora.set_adapters(fd_model, NAMES, BLEND)
    x = to(kw, dev)
    with torch.inference_mode():
        base_y = out_of(base.to(dev)(**x)).float()
    del base  # host memory: a Flux-dev copy is 24 GB, and the PEFT model, the fd-lora model, each offloaded copy and
    if dev.type == "cuda":  # group offloading's pinned copies come on top (a 128 GB host ran out with it kept)
        torch.cuda.empty_cache()
    rows = []
    for mode in modes:
        got = {}
        for impl, src in (("diffusers+peft", peft_model), ("fd-lora", fd_model)):
            m = copy.deepcopy(src)
            back = offload(m, mode, dev)
            with torch.inference_mode():
                def step(m=m):
                    return out_of(m(**x))
                got[impl] = step().float()
                phases = {"cold": back, "warm": lambda: None} if mode == "model" else {"step": lambda: None}
                ms = {ph: timed(step, dev, rounds, before) for ph, before in phases.items()}
            ref = got.get("diffusers+peft", got[impl])
            err = float((got[impl] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
            eff = float((ref - base_y).abs().max() / ref.abs().max().clamp_min(1e-12))
            ok = bool(torch.isfinite(got[impl]).all()) and err <= TOL[dtype] and eff > 2 * err
            offl = offloaded_layers(m) if impl == "fd-lora" else {}
            for ph, t in ms.items():
                rows.append({"model": name, "mode": mode, "impl": impl, "phase": ph, "ms": round(t, 3), "ok": ok,
                             "rel_err_vs_peft": err, "lora_effect": eff, "offloaded_layers": len(offl),
                             "cache_gib": fdlora.merge_cache_bytes(dev) / 2**30,
                             "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None})
                print(f"{name:5} {mode:10} {impl:15} {ph:5} {t:9.2f} ms  ok={ok} err={err:.2e} "
                      f"offloaded={len(offl)}", flush=True)
            back()
            del m
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def environment(dev: torch.device) -> dict:
    import accelerate
    import diffusers
    import peft

    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent).stdout.strip() or None
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (smoke: timings meaningless)",
            "torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__,
            "accelerate": accelerate.__version__, "git_sha": sha}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="sdxl,flux", help="sdxl, flux or both (comma-separated)")
    ap.add_argument("--modes", default="model,group", help="model, group, sequential (comma-separated)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="toy widths on the CPU (fp32): checks the script runs")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    rows = []
    for name in a.model.split(","):
        dtype = torch.float32 if a.smoke else (torch.float16 if name == "sdxl" else torch.bfloat16)
        rows += run_model(name, a.modes.split(","), dev, dtype, 1 if a.smoke else a.rounds, a.smoke)
        if a.out is not None:  # after each model: a later one that dies (host memory) keeps the earlier rows
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps({**environment(dev), "rows": rows}, indent=1))
            print(f"wrote {a.out} ({name})")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
