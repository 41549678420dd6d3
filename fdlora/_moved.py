"""Old import paths of modules that moved (issue 29's layout), resolved to their new homes with a warning.

    import fdlora.pipelines.peft            # DeprecationWarning: ... moved to fdlora.pipelines.transformers.live
    from fdlora.pipelines.peft import adapter_from_peft     # still works

One table and one meta-path finder, installed by `import fdlora`; no file is left at an old path.
The old name is an alias of the new module object (sys.modules holds both), so state and
isinstance checks are shared. Attribute access (`fdlora.pipelines.peft` after `import fdlora`)
goes through `moved_attribute`, used by the packages' `__getattr__`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "fdlora.cli": "fdlora.apps.cli",
    "fdlora.bench": "fdlora.apps.bench",
    "fdlora.demo": "fdlora.apps.demo",
    "fdlora.quickstart": "fdlora.apps.quickstart",
    "fdlora.quickstart_pipeline": "fdlora.apps.quickstart_pipeline",
    "fdlora.run": "fdlora.apps.run",
    "fdlora.hub.inspect": "fdlora.apps.inspect",
    "fdlora.pipelines.attach": "fdlora.pipelines.diffusers.hook",
    "fdlora.pipelines.targets": "fdlora.pipelines.diffusers.targets",
    "fdlora.pipelines.tiny": "fdlora.pipelines.diffusers.tiny",
    "fdlora.pipelines.peft": "fdlora.pipelines.transformers.live",
    "fdlora.pipelines.peft_convert": "fdlora.pipelines.transformers.live",
    "fdlora.pipelines.peft_config": "fdlora.pipelines.transformers.loraconfig",
    "fdlora.pipelines.peft_files": "fdlora.pipelines.transformers.read",
    "fdlora.pipelines.peft_state": "fdlora.pipelines.transformers.read",
    "fdlora.pipelines.peft_attach": "fdlora.pipelines.transformers.attach",
    "fdlora.pipelines.save": "fdlora.pipelines.transformers.save",
    "fdlora.pipelines.saved_modules": "fdlora.pipelines.transformers.saved_modules",
    "fdlora.pipelines.quantized": "fdlora.pipelines.transformers.quantized",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there (the old path will be removed).",
                  DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        _warn(spec.name, self.new)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        """The module already ran; only give it back its own spec, which the import system just overwrote."""
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        new = MOVED.get(name)
        return None if new is None else importlib.util.spec_from_loader(name, _Alias(new))


def moved_attribute(package: str, name: str):
    """The moved module `package.name` (imported, with the warning); AttributeError if `name` never lived there."""
    if f"{package}.{name}" in MOVED:
        return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
