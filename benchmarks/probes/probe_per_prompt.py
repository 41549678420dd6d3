# Measures: a Flux-dev per-prompt step: layers on merged copies vs per-call kernels, GPU time by kernel.
"""Where a per-prompt step's time goes on the full-size Flux-dev transformer at the default merge budget
(bench_fullsize's per_prompt_2: batch 2, adapter a0 for prompt 0, a1 for prompt 1): how many layers ran on
per-blend merged copies and how many on the per-call kernels, and torch.profiler's kernels by GPU time for the
base step and the per-prompt step. Results: benchmarks/results/<gpu>/probe_per_prompt.json.

    PYTHONPATH=. python benchmarks/probes/probe_per_prompt.py --out /tmp/probe_per_prompt.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import fdlora  # noqa: E402
from fdlora.fixtures import fullsize  # noqa: E402
from fdlora.testing import step_ms  # noqa: E402


def kernels(fn, steps: int = 2, top: int = 20) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync()
    ev = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in ev) / steps / 1e3
    rows = sorted(ev, key=lambda e: -e.self_device_time_total)[:top]
    return {"kernels_ms": total, "top": [(e.key[:100], e.count / steps, e.self_device_time_total / steps / 1e3)
                                         for e in rows]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cache", default="auto", help="set_merge_cache limit for the per-prompt step")
    ap.add_argument("--tiny", action="store_true", help="a tiny Flux on the CPU: checks the script only")
    args = ap.parse_args()
    from peft import LoraConfig

    dev = "cpu" if args.tiny else "cuda"
    model = fullsize.flux_transformer(dev, torch.float32 if args.tiny else torch.bfloat16, tiny=args.tiny)
    with torch.device(dev):
        for i, n in enumerate(("a0", "a1")):
            torch.manual_seed(i + 1)
            model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=fullsize.FLUX_TARGETS,
                                         init_lora_weights=False), n)
    x = fullsize.flux_inputs(model, batch=2)
    fd = fdlora.from_peft(model)
    fdlora.set_merge_cache(args.cache)
    layers = list(fdlora.handle(fd).layers.values())

    def base():  # fdlora.disable'd layers run the base module alone
        return fd(**x)

    def prompts():
        with fdlora.per_sample(fd, ["a0", "a1"]):
            return fd(**x)

    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "cache": args.cache,
           "layers": len(layers)}
    with torch.inference_mode():
        fdlora.set_adapters(fd, ["a0"])
        for _ in range(2):
            prompts()
        grouped = sum(1 for lay in layers if lay.__dict__.get("_groups") and lay.__dict__["_groups"][3])
        out["grouped_layers"] = grouped
        out["grouped_bytes"] = sum(lay.base.weight.numel() * 2 for lay in layers
                                   if lay.__dict__.get("_groups") and lay.__dict__["_groups"][3])
        out["all_bytes"] = sum(lay.base.weight.numel() * 2 for lay in layers)
        out["cache_gib"] = fdlora.merge_cache_bytes() / 2**30
        b, p = [], []
        for _ in range(5):
            fdlora.disable(fd)
            b.append(step_ms(base, dev))
            fdlora.enable(fd)
            p.append(step_ms(prompts, dev))
        out["base_ms"], out["per_prompt_ms"] = sorted(b)[2], sorted(p)[2]
        fdlora.disable(fd)
        out["base_profile"] = kernels(base)
        fdlora.enable(fd)
        out["per_prompt_profile"] = kernels(prompts)
    print(f"layers {out['layers']}, on merged copies {grouped} ({out['grouped_bytes'] / out['all_bytes']:.0%} of the "
          f"weight bytes), cache {out['cache_gib']:.1f} GiB; base {out['base_ms']:.1f} ms, per-prompt "
          f"{out['per_prompt_ms']:.1f} ms")
    for k in ("base_profile", "per_prompt_profile"):
        print(f"== {k}: kernels {out[k]['kernels_ms']:.1f} ms per step")
        for name, n, ms in out[k]["top"]:
            print(f"  {ms:8.2f}  {n:6.0f}  {name}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
