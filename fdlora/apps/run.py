"""`fdlora run CONFIG.yaml`: build the pipeline or model a config describes, load its adapters, and for a
pipeline with a `prompt`, generate one image and save it (`output`, default fdlora-run.png)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "config keys: see `python -c 'import fdlora.config; help(fdlora.config)'`"
    p.add_argument("config", type=Path, help="YAML config (pipeline/model, dtype, device, backend, adapters, prompt)")
    p.add_argument("--check", action="store_true", help="validate the config and exit, building nothing")
    p.add_argument("--output", type=Path, default=None, help="image path; overrides the config's 'output'")
    p.add_argument("--no-caption", action="store_true",
                   help="save the image alone, without the caption row naming its adapters and weights")


def run(args: argparse.Namespace) -> int:
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    from ..api import active_adapters
    from ..config import build, load_config

    cfg = load_config(args.config)
    adapters = ", ".join(f"{a.name}*{a.weight:g}" for a in cfg.adapters) or "none"
    print(f"{args.config}: {cfg.kind} {cfg.base}, {cfg.dtype} on {cfg.device}, backend {cfg.backend}; "
          f"adapters: {adapters}")
    if args.check:
        print("config is valid")
        return 0
    obj = build(cfg)
    if cfg.kind == "model" or not cfg.prompt:
        print(f"built {type(obj).__name__}; adapters active: {active_adapters(obj) if cfg.adapters else []}"
              if cfg.kind == "model" else f"built {type(obj).__name__}")
        return 0
    import torch

    kw = dict(prompt=cfg.prompt, num_inference_steps=cfg.steps,
              generator=torch.Generator("cpu").manual_seed(cfg.seed))
    if cfg.negative_prompt:
        kw["negative_prompt"] = cfg.negative_prompt
    if cfg.size:
        kw.update(height=cfg.size, width=cfg.size)
    elif cfg.base.startswith("tiny-"):
        kw.update(height=64, width=64)
    if type(obj).__name__.startswith(("Flux", "StableDiffusion3")) and cfg.base.startswith("tiny-"):
        kw["max_sequence_length"] = 32
    out = args.output or Path(cfg.output or "fdlora-run.png")
    with torch.inference_mode():
        image = obj(**kw).images[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.no_caption:
        image.save(out)
    else:  # a caption row under the image: its adapters and weights, the prompt, the steps and seed
        from .quickstart.captions import captioned_image

        used = {a.name: a.weight for a in cfg.adapters}
        captioned_image(image, used, prompt=cfg.prompt, extra=f"{cfg.steps} steps, seed {cfg.seed}").save(out)
    print(f"image ({image.size[0]}x{image.size[1]}, {cfg.steps} steps) saved to {out}"
          + ("" if args.no_caption else " under a caption row (adapters, weights, prompt; --no-caption: image alone)"))
    return 0
