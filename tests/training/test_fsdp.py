"""`fdlora train` under `accelerate launch --use_fsdp` with 2 CPU processes (FSDP2 on gloo): the base is sharded
(each process holds about half of it), the loss curve is the one-process curve with the same global batch,
checkpoints are written once, runs resume across process counts in both directions (1 -> 2 with FSDP, FSDP's
2 -> 1), and the adapter loads in PEFT and fd-lora with equal outputs, close to the one-process adapter."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

import fdlora
from fdlora.training import schema, tiny, trainer

ROOT = Path(__file__).parents[2]
CFG = {"model": {"name": "tiny-llama"},
       "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
                "modules_to_save": ["lm_head"]},
       "train": {"steps": 6, "batch_size": 4, "grad_accumulation": 2, "lr": 5e-3, "checkpoint_every": 2,
                 "seed": 2}}


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


def _cfg(out: Path, **train) -> dict:
    return {**CFG, "output": str(out), "train": {**CFG["train"], **train}}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate's launcher is not installed")
def test_fsdp_two_processes_follow_one_process_and_resume_across_counts(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    one = trainer.train(schema.validate(_cfg(tmp_path / "one")), progress=False).losses
    # 2 processes, FSDP, resuming the 1-process run's step-2 checkpoint: steps 3..6 run sharded
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_cfg(tmp_path / "two",
                                                         resume=str(tmp_path / "one/checkpoints/step-2"))))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [shutil.which("accelerate"), "launch", "--use_fsdp", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "fdlora.apps.cli", "train",
           str(tmp_path / "c.yaml"), "--no-progress"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    held = re.findall(r"FSDP over 2 processes: (\d+) FSDP units; this process holds (\d+) of (\d+)", log)
    assert len(held) == 1, log[-4000:]  # logged once (main process), and FSDP was on
    units, local, total = map(int, held[0])
    assert units == 3 and 0.45 < local / total < 0.55  # 2 decoder layers + the root; half of every weight

    two = json.loads((tmp_path / "two" / "losses.json").read_text())
    assert two[:2] == one[:2] and _close(two, one), (two, one)
    ck = tmp_path / "two" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-4", "step-6"]  # once: no partial or per-rank copies
    assert json.loads((ck / "step-4" / "state.json").read_text())["processes"] == 2
    # the FSDP checkpoint holds whole tensors: one process resumes it onto the same curve
    r = trainer.train(schema.validate(_cfg(tmp_path / "three", resume=str(ck / "step-4"))), progress=False)
    assert r.start_step == 4 and r.losses[:4] == two[:4] and _close(r.losses, one), (r.losses, one)

    a, b = load_file(tmp_path / "one" / "adapter_model.safetensors"), load_file(tmp_path / "two" /
                                                                                 "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("lm_head" in k for k in a)
    for k in a:
        assert a[k].shape == b[k].shape and torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k
    ids = tiny.synthetic_batch("causal-lm", tiny.build("tiny-llama"), 3, 99)["input_ids"]
    pm = PeftModel.from_pretrained(tiny.build("tiny-llama"), str(tmp_path / "two")).eval()
    fm = fdlora.load_fd_lora(tiny.build("tiny-llama"), str(tmp_path / "two")).eval()
    with torch.no_grad():
        x, y, base = pm(input_ids=ids).logits, fm(input_ids=ids).logits, tiny.build("tiny-llama")(input_ids=ids).logits
    assert torch.allclose(x, y, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(x, base, atol=1e-3)  # it trained something
