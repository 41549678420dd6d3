"""benchmarks/bench_train.py --smoke: every case (llama, vit nf4, sdxl, the layer microbenchmark) runs its
verification against PEFT and its timing loop on toy shapes on CPU, and writes the JSON the GPU run commits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.slow
def test_bench_train_smoke(tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "train.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--smoke", "--steps", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())
    assert [c["case"] for c in res["cases"]] == ["llama", "vit", "sdxl"]
    for c in res["cases"]:
        assert c["checked"] and c["grad_rel_err"] < c["grad_bound"] and c["fd_ms"] > 0 and c["peft_ms"] > 0
    assert res["layer"] and all(r["rel_err_vs_torch"] < 1e-4 for r in res["layer"])
    assert {"device", "torch", "peft", "git_sha"} <= res["env"].keys()
