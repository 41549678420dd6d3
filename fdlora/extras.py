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
import sys
import threading
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


def detached_import(module: str) -> Any:
    """`import module`, run on a thread of its own the first time. Some libraries keep a frame of their own import (a
    registration that records where it was made, a kept traceback), and a frame keeps its callers' frames and their
    locals: imported under a call that holds a user's model (`inject`, a load), the model and its GPU memory would
    stay for the life of the process. A thread's frames have no such callers."""
    got = sys.modules.get(module)
    if got is not None:
        return got
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["module"] = importlib.import_module(module)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=f"fdlora-import-{module}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box.pop("error")
    return box["module"]


def require(module: str, feature: str) -> Any:
    """`import module`, or raise MissingExtraError naming the extra that installs it."""
    try:
        return detached_import(module)  # the optional extra the caller named
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
