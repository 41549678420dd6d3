"""Building and loading the C++ training layer (train.cpp): just in time on first use, into the cache.

Needs a C++ compiler and ninja (no CUDA toolkit: the file calls ATen only, so one build serves CPU and CUDA); built
once per torch and source version into $FDLORA_CUDA_CACHE (default ~/.cache/fdlora/cuda)/host-<digest>/, under a
file lock so concurrent processes build once (about half a minute). `FDLORA_TRAIN_CPP=0` turns it off. Where it
cannot be built, `load()` returns None and `status()` says why; the layers then run their Python Function, which
computes the same.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

from ... import env
from ..cuda.build import compiler, environ, has_ninja, import_library

SOURCE = Path(__file__).parent / "train.cpp"
NAME = "fdlora_train_host"
FLAGS = ["-O3"]


def build_dir() -> Path:
    h = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
    return env.cuda_cache_dir() / f"host-torch{torch.__version__.split('+')[0]}-{h}"


def problem() -> str | None:
    """Why the library cannot be built or used here, or None."""
    if not env.train_cpp():
        return f"{env.TRAIN_CPP_VAR} turns it off"
    if (build_dir() / f"{NAME}.so").is_file():
        return None
    if not has_ninja():
        return "ninja not found; pip install ninja"
    if compiler() is None:
        return "no C++ compiler that links libstdc++ as a shared library (g++ or c++ on PATH, or CXX)"
    return None


_loaded: object = None
_reason: str | None = None


def status() -> str:
    if _loaded is not None and _loaded is not False:
        return f"loaded ({build_dir() / NAME}.so)"
    return f"not loaded: {_reason or problem() or 'builds on first use'}"


def load():
    """The library's module (building it first if needed), or None where it cannot be built (see status)."""
    global _loaded, _reason
    if _loaded is None:
        _loaded, _reason = False, problem()
        if _reason is None:
            try:
                _loaded = import_library(NAME, _build())
            except Exception as e:  # a failed build leaves the Python path, with the reason kept
                _reason = f"building it failed: {type(e).__name__}: {(str(e).strip().splitlines() or [e])[-1]}"
    return _loaded or None


def _build() -> Path:
    from filelock import FileLock
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    lib = out / f"{NAME}.so"
    with FileLock(str(out / "build.lock"), timeout=1800):
        if lib.is_file():
            return lib
        print(f"[fdlora] building the C++ training layer into {out} (once; about half a minute)", file=sys.stderr,
              flush=True)
        with environ(CXX=compiler()):
            cpp_extension.load(NAME, [str(SOURCE)], extra_cflags=FLAGS, build_directory=str(out), verbose=False)
    return lib
