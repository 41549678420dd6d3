"""Building and finding the CUDA C++ extension (csrc/): ahead of time, or just in time on first use.

Where the library comes from, first found wins:
1. built with the package (`FDLORA_BUILD_CUDA=1 pip install --no-build-isolation .`, setup.py):
   fdlora/kernels/cuda/_C*.so;
2. built earlier into the cache (`fdlora env --build-cuda`, or a previous first use):
   $FDLORA_CUDA_CACHE (default ~/.cache/fdlora/cuda)/<torch, CUDA and source digest>/fdlora_cuda.so;
3. built now with torch.utils.cpp_extension (nvcc + ninja), under a file lock so concurrent processes build once.

`status()` says which, or why it cannot be built ("not built: nvcc not found ..."), without building anything.
Compute capabilities: $FDLORA_CUDA_ARCHS ("8.0;9.0"), else the local GPUs' (JIT), else the release list ARCHS.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import env
from ...errors import BackendUnavailableError

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("ops.cpp", "kernels.cu")
HEADERS = ("kernels.h", "device.cuh")  # included by the sources: in the digest too
NAME = "fdlora_cuda"
ARCHS = "8.0;8.9;9.0;10.0;12.0+PTX"  # A100, L40/4090, H100/H200, B200, RTX 50xx; PTX for what comes next
FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
RECIPE = "libstdc++ shared"  # in the digest: libraries built before the compiler check are not reused


@dataclass(frozen=True)
class Status:
    library: Path | None  # a built library, when one is found
    reason: str | None  # why none can be built here (None: it can be)

    @property
    def usable(self) -> bool:
        return self.library is not None or self.reason is None

    def __str__(self) -> str:
        if self.library is not None:
            return f"built ({self.library})"
        return f"not built: {self.reason}" if self.reason else "not built yet: builds on first use (nvcc, ninja found)"


def digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join([*FLAGS, RECIPE]).encode())
    return h.hexdigest()[:12]


def build_dir() -> Path:
    tag = f"torch{torch.__version__.split('+')[0]}-cu{(torch.version.cuda or 'none').replace('.', '')}-{digest()}"
    return env.cuda_cache_dir() / tag


def _packaged() -> Path | None:
    found = sorted(glob.glob(str(Path(__file__).parent / "_C*.so")))
    return Path(found[0]) if found else None


def _cached() -> Path | None:
    lib = build_dir() / f"{NAME}.so"
    return lib if lib.is_file() else None


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def _nvcc_version(path: str) -> str | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _links_shared_libstdcxx(cxx: str) -> bool:
    try:
        out = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    return os.path.isabs(out) and os.path.exists(out)  # a bare name back: no shared library, the .a gets linked


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX (cpp_extension's choice, default c++) when it links libstdc++ as a shared
    library, else the first of g++, c++, /usr/bin/g++ that does; None when none does."""
    for name in dict.fromkeys([os.environ.get("CXX") or "c++", "g++", "c++", "/usr/bin/g++"]):
        path = shutil.which(name)
        if path is not None and _links_shared_libstdcxx(path):
            return path
    return None


def has_ninja() -> bool:
    """Whether ninja (torch.utils.cpp_extension's builder) is on PATH or beside this Python."""
    return shutil.which("ninja") is not None or shutil.which("ninja", path=os.path.dirname(sys.executable)) is not None


@contextlib.contextmanager
def environ(**values: str):
    """os.environ with `values` set (what cpp_extension reads: CXX, TORCH_CUDA_ARCH_LIST), restored after."""
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def import_library(name: str, lib: Path):
    """The extension module at `lib`, imported under `name`."""
    spec = importlib.util.spec_from_file_location(name, str(lib))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_problem() -> str | None:
    """Why the extension cannot be built on this machine, or None."""
    cuda_compiler = nvcc()
    if cuda_compiler is None:
        return (f"nvcc not found; install the CUDA toolkit {torch.version.cuda or 'of your CUDA torch'} or set "
                "CUDA_HOME to it")
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA; install a CUDA build of torch"
    version = _nvcc_version(cuda_compiler)
    if version is None:
        return f"{cuda_compiler} --version failed; check the CUDA toolkit install"
    if version.split(".")[0] != torch.version.cuda.split(".")[0]:
        return (f"nvcc is CUDA {version} but torch was built with CUDA {torch.version.cuda}; install the matching "
                "toolkit or point CUDA_HOME at it")
    if not has_ninja():
        return "ninja not found; pip install ninja"
    if compiler() is None:
        return (f"the C++ compiler ({os.environ.get('CXX') or 'c++'}) links libstdc++ statically, and no g++ or c++ "
                "on PATH links it as a shared library (a failed check would crash the process); set CXX to one "
                "that does (`$CXX -print-file-name=libstdc++.so` prints a path)")
    return None


def status() -> Status:
    lib = _packaged() or _cached()
    return Status(lib, None if lib is not None else build_problem())


def archs() -> str:
    if os.environ.get(env.CUDA_ARCHS_VAR):
        return env.cuda_archs()
    if torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        return ";".join(f"{a}.{b}" for a, b in caps)
    return ARCHS


def build(verbose: bool = False) -> Path:
    """Compile the extension into the cache (once per torch, CUDA and source version); its path."""
    problem = build_problem()
    if problem is not None:
        raise BackendUnavailableError(f"the fd-lora CUDA extension cannot be built: {problem}")
    from filelock import FileLock
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    lib = out / f"{NAME}.so"
    with FileLock(str(out / "build.lock"), timeout=1800):
        if lib.is_file():  # another process built it while this one waited
            return lib
        print(f"[fdlora] building the CUDA extension for sm {archs()} into {out} (once; about a minute)",
              file=sys.stderr, flush=True)
        if "CUDA_HOME" not in os.environ:
            os.environ["CUDA_HOME"] = str(Path(nvcc()).parent.parent)
        try:
            with environ(TORCH_CUDA_ARCH_LIST=archs(), CXX=compiler()):
                cpp_extension.load(NAME, [str(CSRC / s) for s in SOURCES], extra_cflags=["-O3"],
                                   extra_cuda_cflags=FLAGS, build_directory=str(out), verbose=verbose)
        except Exception as e:
            raise BackendUnavailableError(f"building the fd-lora CUDA extension failed: {type(e).__name__}: "
                                          f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}. Rerun "
                                          "`fdlora env --build-cuda --verbose` to see the compiler output.") from e
    return lib


_loaded = None


def load():
    """Import the library (building it first if needed): its Python module (direct eager entry points); importing
    it registers the torch.ops.fdlora_cuda ops."""
    global _loaded
    if _loaded is None:
        packaged = _packaged()
        lib = packaged or _cached() or build()
        _loaded = import_library("fdlora.kernels.cuda._C" if packaged else NAME, lib)
    return _loaded
