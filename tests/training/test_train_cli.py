"""`fdlora train CONFIG`: bad configs fail with one clear line before anything loads; a good tiny-vit config
trains, checkpoints, resumes onto the uninterrupted loss curve exactly, and its output loads in PEFT and fd-lora
with equal outputs."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch
import yaml

import fdlora
from fdlora.apps import cli
from fdlora.fixtures import tiny_tasks as tiny
from fdlora.training import schema, trainer

GOOD = {
    "model": {"name": "tiny-vit", "task": "image-classification"},
    "lora": {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "fc1"],
             "modules_to_save": ["classifier"]},
    "data": "synthetic",
    "train": {"steps": 10, "batch_size": 8, "lr": 5e-3, "seed": 1, "checkpoint_every": 4},
}


def _with(path: str, value):
    cfg = copy.deepcopy(GOOD)
    keys = path.split(".")
    d = cfg
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    if value is _DEL:
        del d[keys[-1]]
    else:
        d[keys[-1]] = value
    return cfg


_DEL = object()
# (id, config, what the one line must contain)
BAD = [
    ("missing-lora-r", _with("lora.r", _DEL), ["lora.r: missing", "fix: add `r: 8`"]),
    ("negative-dropout", _with("lora.dropout", -0.1), ["lora.dropout: got -0.1", "[0, 1)", "fix:"]),
    ("unknown-quant-type", _with("quantization", {"enabled": True, "type": "nf5"}),
     ["quantization.type: got 'nf5'", "nf4 | fp4 | int8", "did you mean 'nf4'"]),
    ("targets-match-nothing", _with("lora.target_modules", ["q_prj"]),
     ["lora.target_modules", "matches no module", "Did you mean ['q_proj']"]),
    ("unknown-key-did-you-mean", _with("lora.alpah", 8), ["lora.alpah: unknown key", "did you mean 'alpha'"]),
    ("unknown-section", {**GOOD, "trian": {}}, ["trian: unknown key", "did you mean 'train'"]),
    ("bad-optimizer", _with("train.optimizer", "adamx"), ["train.optimizer: got 'adamx'", "did you mean 'adam"]),
    ("task-mismatch", _with("model.task", "causal-lm"), ["model.task", "set `task: image-classification`"]),
    ("bad-distributed", _with("train.distributed", "fsdp2"), ["train.distributed: got 'fsdp2'", "did you mean 'fsdp'"]),
    ("fsdp-with-quantization", _with("quantization", {"enabled": True, "type": "nf4"}) | {
        "train": {**GOOD["train"], "distributed": "fsdp"}}, ["train.distributed: got 'fsdp'", "distributed: ddp"]),
    ("bad-hub-repo-id", {**GOOD, "output": {"dir": "x", "push_to_hub": "me/my adapter"}},
     ["output.push_to_hub: got 'me/my adapter'", "a Hub repo id", "fix: set `push_to_hub: me/my-adapter`"]),
]


def _run(tmp_path, cfg, *extra):
    cfg = copy.deepcopy(cfg)
    if isinstance(cfg, dict):
        cfg.setdefault("output", {"dir": str(tmp_path / "out")})
    p = tmp_path / "train.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return cli.main(["train", str(p), "--no-progress", *extra])


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_config_one_clear_line(case, tmp_path, capsys):
    _, cfg, wants = case
    rc = _run(tmp_path, cfg)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    lines = [ln for ln in err.splitlines() if "kernels-community" not in ln]
    assert len(lines) == 1, err
    for w in wants:
        assert w in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_quantization_without_bitsandbytes(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    rc = _run(tmp_path, _with("quantization", {"enabled": True, "type": "nf4"}), "--check")
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1 and "pip install fd-lora[quant]" in err, err


def test_good_config_trains_and_loads_in_peft_and_fdlora(tmp_path, capsys):
    from peft import PeftModel

    assert _run(tmp_path, GOOD) == 0
    out = tmp_path / "out"
    assert "adapter saved" in capsys.readouterr().out
    x = tiny.synthetic_batch("image-classification", tiny.build("tiny-vit"), 4, 99)["pixel_values"]
    pm = PeftModel.from_pretrained(tiny.build("tiny-vit"), str(out)).eval()
    fm = fdlora.load_fd_lora(tiny.build("tiny-vit"), str(out)).eval()
    with torch.no_grad():
        a, b, base = pm(pixel_values=x).logits, fm(pixel_values=x).logits, tiny.build("tiny-vit")(pixel_values=x).logits
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, base, atol=1e-3)  # it trained something
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4", "step-8"]


def test_resume_reproduces_the_uninterrupted_loss_curve(tmp_path):
    whole = schema.validate({**GOOD, "output": str(tmp_path / "a")})
    full = trainer.train(whole, progress=False).losses
    part = schema.validate({**GOOD, "output": str(tmp_path / "b")})
    first = trainer.train(part, progress=False, stop_after=6).losses  # "killed" after step 6; checkpoint at 4
    assert len(first) == 6 and first == full[:6]
    resumed = schema.validate({**GOOD, "output": str(tmp_path / "b"),
                               "train": {**GOOD["train"], "resume": True}})
    r = trainer.train(resumed, progress=False)
    assert r.start_step == 4 and r.losses == full  # exactly, not approximately
    assert full[-1] < full[0]
    sa = (tmp_path / "a" / "adapter_model.safetensors").read_bytes()
    assert sa == (tmp_path / "b" / "adapter_model.safetensors").read_bytes()


def test_check_validates_without_loading(tmp_path, capsys):
    assert _run(tmp_path, GOOD, "--check") == 0
    assert "config is valid" in capsys.readouterr().out


def test_examples_validate():
    from pathlib import Path

    for p in sorted(Path(__file__).parents[2].glob("examples/train/*.yaml")):
        schema.load(p)


def test_image_folder_and_bf16_mixed_precision(tmp_path):
    """data: an image folder (root/<class>/*.png), trained with bf16 autocast: finite losses that drop."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for c, colour in enumerate(((200, 30, 30), (30, 30, 200))):
        (tmp_path / "imgs" / f"class{c}").mkdir(parents=True)
        for i in range(4):
            noise = (torch.rand(16, 16, 3, generator=g) * 40).to(torch.uint8)
            arr = (torch.tensor(colour, dtype=torch.uint8) + noise).clamp(0, 255).numpy()
            Image.fromarray(arr).save(tmp_path / "imgs" / f"class{c}" / f"{i}.png")
    cfg = schema.validate({"model": {"name": "tiny-vit"}, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"],
                                                                   "modules_to_save": ["classifier"]},
                           "data": {"source": str(tmp_path / "imgs")},
                           "train": {"steps": 8, "batch_size": 4, "lr": 1e-2, "mixed_precision": "bf16"},
                           "output": str(tmp_path / "out")})
    r = trainer.train(cfg, progress=False)
    assert all(torch.isfinite(torch.tensor(r.losses))) and r.losses[-1] < r.losses[0]
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("name,targets", [("tiny-sd15", ["to_q", "to_v", "conv1"]), ("tiny-llama", "all-linear")])
def test_other_tiny_models_train(name, targets, tmp_path):
    cfg = schema.validate({"model": {"name": name}, "lora": {"r": 4, "target_modules": targets},
                           "train": {"steps": 3, "batch_size": 2, "lr": 1e-2, "grad_accumulation": 2},
                           "output": str(tmp_path / "out")})
    r = trainer.train(cfg, progress=False)
    assert len(r.losses) == 3 and all(torch.isfinite(torch.tensor(r.losses)))
    cfg_json = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert cfg_json["r"] == 4 and cfg_json["peft_type"] == "LORA"
