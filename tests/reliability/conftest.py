"""The reliability suite's knobs (read here and nowhere else) and its figures file.

    FDLORA_RELIABILITY_SCALE=1      multiplies every count (fuzzed files, configs, soak cycles); CI runs 1
    FDLORA_RELIABILITY_RESULTS=1    write the figures to benchmarks/results/reliability.json (or to the path
                                    given instead of 1); unset in CI so a test run never dirties the tree

The CPU figures are the file's top-level keys; the GPU tests' go under "gpu" -> the device's name, beside what
benchmarks/bench_pressure.py puts there. Each kind of run rewrites only its own keys.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import pytest

SCALE = float(os.environ.get("FDLORA_RELIABILITY_SCALE", "1") or 1)
_OUT = os.environ.get("FDLORA_RELIABILITY_RESULTS", "").strip()
RESULTS = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "reliability.json" if _OUT == "1"
           else Path(_OUT) if _OUT else None)


def scaled(n: int) -> int:
    return max(1, round(n * SCALE))


@pytest.fixture(scope="session")
def figures():
    """Counts the tests add to; written as JSON at the end of the session when FDLORA_RELIABILITY_RESULTS is set."""
    out: dict = {"scale": SCALE, "fuzzed_files": 0, "fuzzed_configs": 0, "soak_cycles": 0, "rss_growth_bytes": None,
                 "per_kind": {}, "outcomes": {}, "fuzzed_requests": None, "concurrent_requests": None, "bleed": None}
    yield out
    if RESULTS is None:
        return
    import torch

    out["env"] = {"git": _git_sha(), "torch": torch.__version__, "python": platform.python_version(),
                  "machine": platform.machine(), "device": "cpu"}
    if RESULTS.exists():  # the GPU figures are the GPU runs' to write
        gpu = json.loads(RESULTS.read_text()).get("gpu")
        if gpu is not None:
            out["gpu"] = gpu
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def gpu_figures():
    """The GPU tests' figures, one key per test (soak, threads, ...), merged at the end of the session into the
    figures file under "gpu" -> torch.cuda.get_device_name(), when FDLORA_RELIABILITY_RESULTS is set. The file's
    other keys (the CPU figures, other GPUs, the pressure rows) stay as they are."""
    out: dict = {}
    yield out
    if RESULTS is None or not out:
        return
    import torch

    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    entry = data.setdefault("gpu", {}).setdefault(torch.cuda.get_device_name(), {})
    entry.update(out)
    entry["tests_env"] = {"git": _git_sha(), "torch": torch.__version__, "cuda": torch.version.cuda,
                          "python": platform.python_version(), "scale": SCALE}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


def _git_sha() -> str:
    """HEAD's sha; "" where the tree is no git checkout or git is missing (a device machine's copy of the tree)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""
