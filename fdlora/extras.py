"""Optional dependencies: which `pip install fd-lora[extra]` brings each one, and the one-line error when missing.

The core install (torch, safetensors, huggingface_hub, tqdm, pyyaml; triton on Linux) runs `import fdlora`
and the pure-torch API (`inject`, `add_adapter`, `set_adapters`, `per_sample`, canonical `LoraAdapter`s,
safetensors files in fd-lora's own layout). Everything that needs more imports it inside the function
that needs it; a missing one surfaces as `MissingExtraError` naming the extra:

    fdlora.errors... MissingExtraError: reading a kohya LoRA needs diffusers, which is not installed:
    pip install 'fd-lora[diffusers]'
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import FdLoraError

# top-level module -> the extra that installs it (pyproject.toml [project.optional-dependencies])
EXTRA_OF = {
    "diffusers": "diffusers",
    "transformers": "transformers",
    "peft": "transformers",
    "accelerate": "transformers",
    "bitsandbytes": "quant",
    "torchao": "quant",
    "gguf": "quant",
    "gradio": "demo",
    "ray": "serve",
    "fastapi": "serve",
    "starlette": "serve",
    "PIL": "diffusers",
}

F = TypeVar("F", bound=Callable[..., Any])


class MissingExtraError(FdLoraError, ModuleNotFoundError):
    """An optional dependency is not installed; the message names `pip install 'fd-lora[extra]'`."""


def hint(module: str, extra: str | None = None) -> str:
    extra = extra or EXTRA_OF.get(module.split(".")[0], "all")
    return f"pip install 'fd-lora[{extra}]'"


def missing(module: str, feature: str, extra: str | None = None) -> MissingExtraError:
    """The error for `feature` without `module`; `extra` when the feature's own extra is not the module's."""
    root = module.split(".")[0]
    return MissingExtraError(f"{feature} needs {root}, which is not installed: {hint(root, extra)}", name=root)


def require(module: str, feature: str) -> Any:
    """`import module`, or raise MissingExtraError naming the extra that installs it."""
    try:
        return importlib.import_module(module)  # the optional extra the caller named
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in EXTRA_OF:
            raise missing(e.name, feature) from None
        raise


def translate(e: BaseException, feature: str, extra: str | None = None) -> BaseException:
    """A ModuleNotFoundError for an optional dependency as a MissingExtraError; anything else unchanged."""
    if isinstance(e, ModuleNotFoundError) and not isinstance(e, MissingExtraError):
        name = (e.name or "").split(".")[0]
        if name in EXTRA_OF:
            return missing(name, feature, extra)
    return e


def needs_extras(fn: F, extra: str | None = None) -> F:
    """Entry points: an optional module missing anywhere below becomes one line naming the extra (`extra`, or
    the one that installs the missing module)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ModuleNotFoundError as e:
            new = translate(e, f"fdlora.{fn.__name__}", extra)
            if new is e:
                raise
            raise new from None

    return wrapper  # type: ignore[return-value]
