"""benchmarks/bench_train.py --ddp --fsdp --smoke under `accelerate launch` on CPU (gloo): a 1-process launch and a
2-process launch merge their rows into one JSON, the file gpu_session.sh's train-multi stage writes on 2 GPUs. FSDP
rows hold half the frozen base per process at 2, DDP replicas stay equal, the nf4 ViT's FSDP row says why it did
not run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def _launch(out: Path, processes: int, cases: list[str]) -> None:
    cmd = [shutil.which("accelerate"), "launch", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", *(["--multi_gpu"] if processes > 1 else []), "--num_processes", str(processes),
           str(ROOT / "benchmarks" / "bench_train.py"), "--smoke", "--ddp", "--fsdp", "--steps", "1",
           "--cases", *cases, "--out", str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate's launcher is not installed")
def test_bench_train_multi_process_rows_merge(tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "train_multigpu.json"
    cases = ["llama", "sdxl", "vit"]
    _launch(out, 1, cases)
    _launch(out, 2, cases)
    _launch(out, 1, ["llama"])  # a repeated launch replaces its rows, never duplicates them
    doc = json.loads(out.read_text())
    assert {"device", "git_sha", "gpus", "rows"} <= doc.keys() and doc["gpus"] == 0
    rows = {(r["case"], r["mode"], r["processes"]): r for r in doc["rows"]}
    assert len(rows) == len(doc["rows"]) == 12
    for (case, mode, n), r in rows.items():
        assert r["smoke"] and r["steps"] == 1
        if case == "vit" and mode == "fsdp":
            assert r["note"].startswith("not run: FSDP does not shard bitsandbytes 4-bit weights"), r
            continue
        assert r["fd_ms"] > 0 and len(r["fd_ms_ranks"]) == n and r["fd_ms"] == max(r["fd_ms_ranks"])
        assert r["losses_finite"] and r["peak_gib"] is None  # no CUDA memory on CPU
        assert r["global_batch"] == r["per_process_batch"] * n
        share = r["base_bytes_per_gpu"] / r["base_bytes_total"]
        if mode == "fsdp":
            assert r["fsdp_units"] > 1 and (share == 1.0 if n == 1 else 0.45 < share < 0.55), r
        else:
            assert share == 1.0 and r["replicas_equal"], r
    assert rows[("llama", "ddp", 2)]["per_process_batch"] == 1 and rows[("llama", "ddp", 1)]["per_process_batch"] == 2
    assert rows[("sdxl", "fsdp", 2)]["global_batch"] == 2  # batch 1 on each process (weak scaling), noted
    assert "weak scaling" in rows[("sdxl", "fsdp", 2)]["note"]
