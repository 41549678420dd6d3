"""The built-in backends and what each can do, as data."""

from __future__ import annotations

import importlib.util

import torch

from .. import env
from .registry import Backend, Capability, register

FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32})


def _probe_triton() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'fd-lora[triton]')"
    if not torch.cuda.is_available() and not env.triton_interpret():
        return "no CUDA device (set TRITON_INTERPRET=1 to run it on CPU for tests)"
    if importlib.util.find_spec("fdlora.kernels.triton.ops") is None:
        return "fd-lora was installed without its Triton kernels"
    return None


def _probe_cuda() -> str | None:
    from .cuda import build

    st = build.status()
    if not st.usable:
        return f"not built: {st.reason}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def _auto_extension() -> str | None:
    """`auto` takes the CUDA extension only where it is already built (installed with FDLORA_BUILD_CUDA=1, or built
    by `fdlora env --build-cuda`): choosing a backend never builds it, so no earlier call decides a layer's backend."""
    from .cuda import build

    st = build.status()
    if st.library is None:
        return str(st) if st.reason else ("not built yet: auto takes the CUDA extension only once it is built "
                                          "(`fdlora env --build-cuda`)")
    return None


def _probe_hybrid() -> str | None:
    """Triton usable and the CUDA extension already built (picking a backend never starts a build)."""
    from .cuda import build

    if (reason := _probe_triton()) is not None:
        return reason
    if build.status().library is None:
        return ("the CUDA extension is not built (build it once: `fdlora env --build-cuda`, or install with "
                "FDLORA_BUILD_CUDA=1); Triton alone runs")
    return _probe_cuda()


register(
    Backend(
        "torch",
        Capability(devices=frozenset({"cpu", "cuda", "mps", "xpu"}), dtypes=FLOATS,
                   kinds=frozenset({"linear", "conv2d"})),
        module="fdlora.kernels.ops",
    )
)
register(
    Backend(
        "triton",
        Capability(devices=frozenset({"cuda"} | ({"cpu"} if env.triton_interpret() else set())),
                   dtypes=FLOATS, kinds=frozenset({"linear"}), max_rank=256, max_slots=64),
        module="fdlora.kernels.triton.ops",
        probe=_probe_triton,
    )
)
register(
    Backend(
        "cuda",
        Capability(devices=frozenset({"cuda"}), dtypes=FLOATS, kinds=frozenset({"linear", "conv2d"}), max_slots=64),
        module="fdlora.kernels.cuda.ops",
        probe=_probe_cuda,
        auto=_auto_extension,
    )
)
register(
    Backend(
        "triton+cuda",  # per-call GEMM paths from the extension, merges and decode launches from Triton (hybrid.py)
        Capability(devices=frozenset({"cuda"}), dtypes=FLOATS, kinds=frozenset({"linear"}), max_rank=256,
                   max_slots=64),
        module="fdlora.kernels.hybrid",
        probe=_probe_hybrid,
        auto=_auto_extension,
    )
)
