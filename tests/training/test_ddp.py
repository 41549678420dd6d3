"""`fdlora train` under `accelerate launch` with 2 CPU processes (DDP on gloo): the loss curve of one process with
the same global batch, checkpoints written once (by the main process), and a resume with another process count.
The same test runs on 2 GPUs (DDP on NCCL) where there are 2 (gpu marker)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fdlora.training import schema, trainer

ROOT = Path(__file__).parents[2]
CFG = {"model": {"name": "tiny-llama"},
       "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
       "train": {"steps": 6, "batch_size": 4, "lr": 5e-3, "checkpoint_every": 3, "seed": 2}}
TOL = {"cpu": 1e-5, "cuda": 1e-4}  # relative, per loss; cuda: other GEMM splits for batch 4 vs 2 per process
DEVICES = [pytest.param("cpu", id="cpu-gloo", marks=pytest.mark.slow),
           pytest.param("cuda", id="cuda-nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")])]


def _cfg(out: Path, device: str, **train) -> dict:
    return {**CFG, "output": str(out), "train": {**CFG["train"], "device": device, **train}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate's launcher is not installed")
def test_two_processes_follow_one_process(tmp_path, device):
    tol = TOL[device]
    one = trainer.train(schema.validate(_cfg(tmp_path / "one", device)), progress=False).losses
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_cfg(tmp_path / "two", device)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [shutil.which("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "fdlora.apps.cli", "train",
           str(tmp_path / "c.yaml"), "--no-progress"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    two = json.loads((tmp_path / "two" / "losses.json").read_text())
    assert len(two) == len(one)
    assert all(abs(a - b) <= tol * abs(b) for a, b in zip(two, one)), (two, one)
    ck = tmp_path / "two" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-3", "step-6"]  # no partial or per-rank copies
    assert json.loads((ck / "step-3" / "state.json").read_text())["processes"] == 2
    # resume the 2-process run's step-3 checkpoint in one process: the same curve again
    r = trainer.train(schema.validate(_cfg(tmp_path / "three", device, resume=str(ck / "step-3"))), progress=False)
    assert r.start_step == 3 and r.losses[:3] == two[:3]
    assert all(abs(a - b) <= tol * abs(b) for a, b in zip(r.losses, one)), (r.losses, one)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
