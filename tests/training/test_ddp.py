"""`fdlora train` under `accelerate launch` with 2 CPU processes (DDP on gloo): the loss curve of one process with
the same global batch, checkpoints written once (by the main process), and a resume with another process count."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fdlora.training import schema, trainer

ROOT = Path(__file__).parents[2]
CFG = {"model": {"name": "tiny-llama"},
       "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
       "train": {"steps": 6, "batch_size": 4, "lr": 5e-3, "checkpoint_every": 3, "seed": 2}}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate's launcher is not installed")
def test_two_processes_follow_one_process(tmp_path):
    one = trainer.train(schema.validate({**CFG, "output": str(tmp_path / "one")}), progress=False).losses
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**CFG, "output": str(tmp_path / "two")}))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [shutil.which("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "fdlora.apps.cli", "train",
           str(tmp_path / "c.yaml"), "--no-progress"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    two = json.loads((tmp_path / "two" / "losses.json").read_text())
    assert len(two) == len(one)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(two, one)), (two, one)
    ck = tmp_path / "two" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-3", "step-6"]  # no partial or per-rank copies
    assert json.loads((ck / "step-3" / "state.json").read_text())["processes"] == 2
    # resume the 2-process run's step-3 checkpoint in one process: the same curve again
    r = trainer.train(schema.validate({**CFG, "output": str(tmp_path / "three"),
                                       "train": {**CFG["train"], "resume": str(ck / "step-3")}}), progress=False)
    assert r.start_step == 3 and r.losses[:3] == two[:3]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r.losses, one))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
