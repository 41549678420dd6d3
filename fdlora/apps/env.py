"""`fdlora env`: the environment (Python, torch, CUDA, GPUs, Triton, nvcc) and, per backend, whether it can run
here and why not; `--build-cuda` builds the CUDA C++ extension ahead of time (into the cache first use would fill)."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--build-cuda", action="store_true", help="build the CUDA C++ extension now (needs nvcc, ninja)")
    p.add_argument("--verbose", action="store_true", help="with --build-cuda: show the compiler's output")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def lines() -> list[str]:
    import torch

    from .. import env
    from ..kernels import registry
    from ..kernels.cuda import build

    out = [f"python      {platform.python_version()} ({platform.platform()})",
           f"torch       {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
           f"triton      {_version('triton')}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(f"gpu {i}       {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB")
    else:
        out.append("gpu         none (CUDA not available)")
    out.append(f"nvcc        {build.nvcc() or 'not found'}")
    out.append(f"cuda ext    {build.status()} [cache {build.build_dir()}]")
    out.append(f"backend     {registry.preference()} (FDLORA_BACKEND / fdlora.set_backend)")
    for name, b in registry.backends().items():
        reason = b.auto() or b.unavailable()  # never builds the extension just to say whether it runs
        out.append(f"  {name:<9} {'available' if reason is None else reason}")
    from ..kernels.costmodel import profile

    gpu, calibrated = profile()
    out.append(f"dispatch    {env.dispatch_mode()}: cost model fitted on the H100; on {gpu} "
               + ("its constants are in force" if calibrated else "not calibrated: cuBLAS-based paths only")
               + f" ({env.DISPATCH_VAR}, {env.DEBUG_DISPATCH_VAR}=1 logs each decision)")
    where = {"process": "fd-lora's reader process", "thread": "the prefetch's own thread"}[env.prefetch_reader()]
    out.append(f"prefetch    files read in {where} ({env.PREFETCH_READER_VAR})")
    return out


def run(args: argparse.Namespace) -> int:
    if args.build_cuda:
        from ..kernels.cuda import build

        print(f"built {build.build(verbose=args.verbose)}")
    print("\n".join(lines()))
    return 0
