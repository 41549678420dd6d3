"""Attach `load_fd_lora` and `prefetch_fd_lora` to DiffusionPipeline once both are imported, in either order.

If diffusers' pipeline module is already imported, attach now; otherwise a meta-path hook attaches
right after it is imported, so `import fdlora` stays fast and never imports diffusers itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "diffusers.pipelines.pipeline_utils"


def _attach(module) -> None:
    from .pipeline import load_fd_lora, prefetch_fd_lora

    if not hasattr(module.DiffusionPipeline, "load_fd_lora"):
        module.DiffusionPipeline.load_fd_lora = load_fd_lora  # the additive entry points: load, load in background
    if not hasattr(module.DiffusionPipeline, "prefetch_fd_lora"):
        module.DiffusionPipeline.prefetch_fd_lora = prefetch_fd_lora


class _Loader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _attach(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if TARGET in sys.modules:
        _attach(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())

