"""The `fdlora` command. Each subcommand lives in its own module of fdlora.apps; this file only wires them.

A new command is one module with `add_arguments(parser)` and `run(args) -> int`, plus one line in SUBCOMMANDS."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with `add_arguments(parser)` and `run(args) -> int`, help)
SUBCOMMANDS = {
    "quickstart": ("fdlora.apps.quickstart", "run the main job on an embedded tiny default (no download)"),
    "inspect": ("fdlora.apps.inspect", "print the load report of an adapter without loading a model"),
    "demo": ("fdlora.apps.demo", "a Gradio app: live adapter weights, per-prompt gallery (needs fd-lora[demo])"),
    "bench": ("fdlora.apps.bench", "run the benchmark suite or a named subset; prints a table, writes JSON"),
    "plan": ("fdlora.apps.plan", "merge, serve dynamically or cache merged weights? predicted from configs"),
    "run": ("fdlora.apps.run", "build a pipeline or model from a YAML config, load its adapters, optionally generate"),
    "env": ("fdlora.apps.env", "print torch, CUDA, GPU and Triton, and why each backend can or cannot run here"),
    "serve": ("fdlora.apps.serve", "serve a run config's pipeline and adapters over HTTP (Ray Serve; fd-lora[serve])"),
    "train": ("fdlora.apps.train", "fine-tune a LoRA adapter from a YAML config (output: a PEFT adapter dir)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fdlora", description="fd-lora: fast dynamic LoRA.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)  # subcommands load on use
        except ModuleNotFoundError:
            pass
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args) or 0)  # the chosen subcommand's module
    except Exception as e:  # errors print as one line unless --debug
        if args.debug:
            raise
        from ..errors import FdLoraError
        from ..extras import translate

        e = translate(e, f"fdlora {args.command}")  # a missing optional package: one line naming the extra
        kind = "error" if isinstance(e, FdLoraError) else type(e).__name__
        print(f"fdlora {args.command}: {kind}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
