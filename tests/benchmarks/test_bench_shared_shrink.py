"""benchmarks/bench_shared_shrink.py --smoke: every case runs, is checked against the float64 oracle and lands in the
JSON (CPU, toy shapes: the torch backend, and the Triton kernels under the interpreter, whose per-row grouped form
is the by-row shrink); the GPU run is the lead's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fdlora.layers.modules import shared_shrink as shared

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_shared_shrink.py"


def smoke(tmp_path, backend: str, env: dict) -> list[dict]:
    out = tmp_path / f"shared_shrink_{backend}.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--backend", backend, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "WRONG" not in proc.stdout
    data = json.loads(out.read_text())
    assert {"device", "backend", "torch", "triton", "git_sha"} <= set(data)
    shapes = ("smoke-qkv", "smoke-gate-up", "smoke-qkv-prefill")
    want = {(s, m) for s in shapes for m in ("blend-r16", "rows-4xr16", "rows-4xr16-seq")}
    want |= {(s, "blend-r16-sharedA") for s in shapes if s.startswith("smoke-qkv")}
    assert {(c["case"], c["mode"]) for c in data["cases"]} == want
    seq = [c for c in data["cases"] if c["mode"] == "rows-4xr16-seq"]  # each adapter's rows one run
    assert seq and all(c["live"] == 4 for c in seq)
    for c in data["cases"]:
        assert c["checked"] and c["err_grouped"] <= c["bound"] and c["separate_us"] > 0 and c["grouped_us"] > 0, c
        assert abs(c["grouped_ratio"] - c["grouped_us"] / c["separate_us"]) <= 2e-3  # (from unrounded times)
        # per row at most FEW_ROWS rows: production declines the group and runs the separate deltas (ratio 1)
        assert c["declined"] == (c["mode"].startswith("rows") and c["M"] <= shared.FEW_ROWS), c
        assert c["ratio"] == (1.0 if c["declined"] else c["grouped_ratio"]), c
    return data["cases"]


def test_smoke_runs_checks_and_writes_every_case(tmp_path):
    cases = smoke(tmp_path, "torch", {})
    assert not any(c["by_row"] for c in cases)  # the torch backend has no by-row shrink: member-major stack


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_smoke_on_triton_interpreted_runs_the_by_row_shrink(tmp_path):
    cases = smoke(tmp_path, "triton", {"TRITON_INTERPRET": "1"})
    assert all(c["by_row"] == c["mode"].startswith("rows") for c in cases)
    assert any(c["by_row"] and not c["declined"] for c in cases)
