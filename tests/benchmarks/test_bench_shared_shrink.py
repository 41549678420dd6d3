"""benchmarks/bench_shared_shrink.py --smoke: every case runs, is checked against the float64 oracle and lands in the
JSON (CPU, torch backend, toy shapes); the GPU run is the lead's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_shared_shrink.py"


def test_smoke_runs_checks_and_writes_every_case(tmp_path):
    out = tmp_path / "shared_shrink.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    assert {"device", "backend", "torch", "triton", "git_sha"} <= set(data)
    got = {(c["case"], c["mode"]) for c in data["cases"]}
    assert got == {(s, m) for s in ("smoke-qkv", "smoke-gate-up") for m in ("blend-r16", "rows-4xr16")} | {
        ("smoke-qkv", "blend-r16-sharedA")}
    for c in data["cases"]:
        assert c["checked"] and c["err_grouped"] <= c["bound"] and c["separate_us"] > 0 and c["grouped_us"] > 0, c
        assert abs(c["ratio"] - c["grouped_us"] / c["separate_us"]) <= 2e-3  # (from unrounded times)
    assert "WRONG" not in proc.stdout
