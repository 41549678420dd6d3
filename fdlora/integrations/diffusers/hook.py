"""Attach `load_fd_lora` and `prefetch_fd_lora` to diffusers' DiffusionPipeline and ModularPipeline once both are
imported, in either order.

If diffusers' pipeline module is already imported, attach now; otherwise a meta-path hook attaches
right after it is imported, so `import fdlora` stays fast and never imports diffusers itself.
Modular pipelines (Flux3ModularPipeline, AnimaModularPipeline, ...) carry their family's LoRA loader mixin
like the classic ones, and fd-lora's pipeline methods work on them unchanged.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGETS = {"diffusers.pipelines.pipeline_utils": "DiffusionPipeline",
           "diffusers.modular_pipelines.modular_pipeline": "ModularPipeline"}


def _attach(module) -> None:
    from fdlora.integrations.diffusers.pipeline import load_fd_lora, prefetch_fd_lora

    cls = getattr(module, TARGETS[module.__name__], None)
    if cls is None:
        return
    if not hasattr(cls, "load_fd_lora"):
        cls.load_fd_lora = load_fd_lora  # the additive entry points: load, load in the background
    if not hasattr(cls, "prefetch_fd_lora"):
        cls.prefetch_fd_lora = prefetch_fd_lora


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
        if name not in TARGETS:
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
    for name in TARGETS:
        if name in sys.modules:
            _attach(sys.modules[name])
    if not all(n in sys.modules for n in TARGETS) and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())

