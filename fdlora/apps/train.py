"""`fdlora train CONFIG.yaml`: fine-tune a LoRA adapter through fd-lora's fused trainable layers.

The config (fdlora.training.schema) is validated before anything loads; the output directory is a PEFT adapter
(PeftModel.from_pretrained and fdlora.load_fd_lora both load it). Runs under `accelerate launch` unchanged.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..training import schema

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "config:\n" + schema.__doc__.split("\n\n")[1]
    p.add_argument("config", type=Path, help="YAML config: model, lora, quantization, data, train, output")
    p.add_argument("--check", action="store_true", help="validate the config and exit, loading nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    from ..training import schema

    cfg = schema.load(args.config)
    q = f", {cfg.quant.type} ({cfg.quant_method})" if cfg.quant else ""
    print(f"{args.config}: {cfg.model} ({cfg.task}{q}), LoRA r={cfg.r} alpha={cfg.alpha:g}, {cfg.steps} steps of "
          f"{cfg.batch_size} on {cfg.data} -> {cfg.output}")
    if args.check:
        print("config is valid")
        return 0
    from ..training.trainer import train

    result = train(cfg, progress=not args.no_progress)
    if result.losses and result.main:
        print(f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; adapter saved to {result.output}")
    return 0
