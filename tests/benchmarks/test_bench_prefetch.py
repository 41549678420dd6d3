"""benchmarks/bench_prefetch.py --smoke: the verification (prefetched banks == loaded banks), the step timing
during background loads and the three cold-start processes run on toy widths on CPU and write the JSON the GPU
run commits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.slow
def test_bench_prefetch_smoke(tmp_path):
    out = tmp_path / "prefetch.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_prefetch.py"), "--smoke", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())
    assert res["verified"] and res["adapter_mb"] > 0 and {"device", "torch", "git_sha"} <= res.keys()
    s = res["steps"]
    assert s["idle_ms"] > 0 and s["during_prefetch_ms"] > 0 and s["steps_during"] >= 2 and s["prefetches"] >= 1
    assert set(res["cold"]) == {"fd", "fd-warmup", "diffusers"}
    assert all(r["first_load_s"] > 0 and r["first_step_s"] > 0 for r in res["cold"].values())
    assert {"later_load_s", "reload_from_ram_s", "delete_s"} <= res["cold"]["fd"].keys()
    assert {"warmup_before_load_s", "warmup_s"} <= res["cold"]["fd-warmup"].keys()
