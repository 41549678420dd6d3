"""`fdlora plan MODEL ...`: merge vs dynamic vs cache, predicted from configs (fdlora.plan does the work)."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import FdLoraError

HELP = ("Should I merge, serve LoRA dynamically or cache merged weights? Predicts step time, switch cost and memory "
        "per strategy.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="builtin (sdxl, flux-dev, llama-3-8b, tiny-*), directory or Hub id")
    p.add_argument("--adapters", type=int, default=1, help="adapters loaded")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", nargs="+", default=None, help="module name suffixes (default: the family's)")
    p.add_argument("--gpu", default="h100", help="h100 | h200 | a100 | l40s | 4090 | cpu")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None, help="LLM: new tokens per sequence per step")
    p.add_argument("--context", type=int, default=None, help="LLM: cached tokens per sequence")
    p.add_argument("--resolution", type=int, default=None, help="diffusion: image side in pixels")
    p.add_argument("--steps", type=int, default=None, help="steps per request")
    p.add_argument("--switch-every", type=float, default=1.0, help="steps between adapter/blend changes")
    p.add_argument("--adapters-per-batch", type=int, default=1, help="distinct adapters in one batch")
    p.add_argument("--blend", type=int, default=1, help="adapters active at once in a blend")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (LLMs)")
    p.add_argument("--cache-budget-gib", type=float, default=None, help="memory for merged-weight copies")
    p.add_argument("--captured", action="store_true", help="CUDA-graph captured steps (no host overhead)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", default=None, help="draw each strategy's time per step and memory to FILE")
    p.add_argument("--calibrate", action="store_true", help="time this machine's device and save its constants")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fdlora plan", description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))


def run(a: argparse.Namespace) -> int:
    try:
        if a.calibrate:
            from ..plan.devices import calibrate

            print(f"wrote {calibrate()}")
            if not a.model:
                return 0
        if not a.model:
            raise FdLoraError("give a MODEL (a builtin such as sdxl, a config directory or a Hub id), or --calibrate.")
        from ..plan.api import plan

        r = plan(a.model, adapters=a.adapters, rank=a.rank, targets=a.targets, gpu=a.gpu, batch=a.batch,
                 tokens=a.tokens, context=a.context, resolution=a.resolution, steps=a.steps,
                 switch_every=a.switch_every, adapters_per_batch=a.adapters_per_batch, blend=a.blend, tp=a.tp,
                 cache_budget_gib=a.cache_budget_gib, eager=not a.captured)
    except FdLoraError as e:
        print(f"fdlora plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r.to_dict(), indent=1) if a.json else r.table())
    if a.plot:
        from ..plan.plot import plot

        plot(r, a.plot)
        print(f"plot (time per step vs switch frequency, memory per strategy) written to {a.plot}")
    return 0
