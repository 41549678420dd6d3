"""The one place fd-lora reads environment variables."""

from __future__ import annotations

import os

BACKEND_VAR = "FDLORA_BACKEND"


def backend_preference() -> str:
    """`FDLORA_BACKEND`: auto | triton | cuda | torch (default auto)."""
    return os.environ.get(BACKEND_VAR, "auto").strip().lower() or "auto"


def triton_interpret() -> bool:
    """`TRITON_INTERPRET=1` runs Triton kernels on CPU (tests); it must be set before triton imports."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
