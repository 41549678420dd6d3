"""The `fdlora` command at its edges: a missing file, an uncached model offline, --strict's wording, fd-lora's own
trained adapter (modules_to_save) read without warnings or a misattributed import, `plan tiny-sd15`, a plan whose
recommendation and table use the same memory numbers, and the demo offering the names it shows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fdlora.apps.cli import main
from fdlora.errors import PartialLoadWarning

ROOT = Path(__file__).resolve().parent.parent.parent


def fdlora_cli(*argv: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m fdlora ...` in a fresh process (what a user's shell runs: no imports warmed by other tests)."""
    return subprocess.run([sys.executable, "-m", "fdlora", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket closes: connections are refused


def peft_dir(path: Path, extra: dict[str, torch.Tensor] | None = None, modules_to_save=None) -> Path:
    """A PEFT adapter folder for a module `layer` (in 8 -> out 8, r 2), with `extra` keys besides its LoRA."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    sd = {"base_model.model.layer.lora_A.weight": torch.randn(2, 8),
          "base_model.model.layer.lora_B.weight": torch.randn(8, 2), **(extra or {})}
    save_file(sd, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["layer"],
         "modules_to_save": modules_to_save}))
    return path


def test_inspect_of_a_missing_weight_file_says_it_does_not_exist(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "missing.safetensors"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'missing.safetensors' does not exist" in err, err
    assert str(tmp_path / "missing.safetensors") in err and "Hugging Face cache" not in err


@pytest.mark.parametrize("env, says", [
    pytest.param({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set", id="HF_HUB_OFFLINE"),
    pytest.param({"HF_ENDPOINT": "http://127.0.0.1:{port}"}, "cannot be reached", id="no-network"),
])
def test_train_with_an_uncached_model_fails_at_once_in_one_line(tmp_path, env, says):
    (tmp_path / "c.yaml").write_text("model: {name: someone/not-cached, task: causal-lm}\n"
                                     "lora: {r: 4, alpha: 8, target_modules: [q_proj]}\ndata: synthetic\n"
                                     "train: {steps: 1, batch_size: 1}\noutput: {dir: out}\n")
    env = {k: v.format(port=closed_port()) for k, v in env.items()}
    proc = fdlora_cli("train", "c.yaml", "--no-progress", cwd=tmp_path, HF_HOME=str(tmp_path / "hf"), **env)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(err) == 1, proc.stderr
    assert err[0].startswith("fdlora train: error: c.yaml: model 'someone/not-cached' is not in the local Hugging "
                             "Face cache") and says in err[0] and "hf download someone/not-cached" in err[0], err[0]
    assert "Retrying" not in proc.stdout + proc.stderr


def test_inspect_strict_warns_once_and_speaks_cli(tmp_path, capsys, recwarn):
    src = peft_dir(tmp_path / "a", {"base_model.model.junk": torch.zeros(2)})
    assert main(["inspect", "--strict", str(src)]) == 1
    out, err = capsys.readouterr()
    assert "unused keys (1):" in out and "base_model.model.junk" in out  # the report lists it
    assert err.count("base_model.model.junk") == 1 and "Drop --strict" in err and "--strict and 1 keys" in err
    assert "strict=False" not in err and "strict=True" not in err
    assert not [w for w in recwarn if issubclass(w.category, PartialLoadWarning)]


def test_a_partial_load_warns_once_without_logging_set_up(tmp_path):
    src = peft_dir(tmp_path / "a", {"base_model.model.junk": torch.zeros(2)})
    code = f"from fdlora.hub.load import load_adapters; load_adapters({str(src)!r}, cache=None)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("keys were not loaded") == 1, proc.stderr


def test_modules_to_save_keys_are_neither_unused_nor_dropped(tmp_path):
    from fdlora.hub.load import load_adapters

    src = peft_dir(tmp_path / "a", {"base_model.model.head.weight": torch.randn(3, 8),
                                    "base_model.model.head.bias": torch.randn(3)}, modules_to_save=["head"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialLoadWarning)
        _, report = load_adapters(str(src), cache=None)
    assert set(report.keys_saved) == {"base_model.model.head.weight", "base_model.model.head.bias"}
    assert not report.keys_unused and not report.keys_dropped and report.keys_matched == 2
    report.check_strict()
    assert "2 modules_to_save" in str(report)


@pytest.fixture(scope="module")
def trained_vit(tmp_path_factory) -> Path:
    """examples/train/tiny-vit.yaml (modules_to_save: [classifier]) trained by `fdlora train`, a few steps."""
    d = tmp_path_factory.mktemp("vit")
    text = (ROOT / "examples" / "train" / "tiny-vit.yaml").read_text()
    assert "modules_to_save: [classifier]" in text
    (d / "c.yaml").write_text(text.replace("steps: 60", "steps: 2").replace("checkpoint_every: 20", "checkpoint_every: 2"))
    proc = fdlora_cli("train", "c.yaml", "--no-progress", cwd=d)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return d / "out" / "tiny-vit-lora"


def test_an_adapter_fdlora_train_wrote_passes_inspect_strict(trained_vit):
    proc = fdlora_cli("inspect", "--strict", str(trained_vit), cwd=trained_vit)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PartialLoadWarning" not in proc.stderr and "not loaded" not in proc.stderr
    assert "0 unused, 0 dropped, 2 modules_to_save" in proc.stdout


def test_reading_a_tiny_adapter_times_its_conversion_not_imports(trained_vit):
    """A fresh process reading the 0.04 MB file: PEFT's import (seconds) is its own entry, conversion takes ms."""
    code = ("import json, warnings; from fdlora.errors import PartialLoadWarning; "
            "warnings.simplefilter('error', PartialLoadWarning); from fdlora.hub.load import load_adapters; "
            f"_, r = load_adapters({str(trained_vit)!r}, cache=None); print(json.dumps(r.seconds))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seconds = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seconds["convert"] < 0.5, seconds  # 16 small tensors; was 3-9 s with PEFT's import counted in it


def test_the_trained_adapter_loads_on_its_model_without_warnings(trained_vit):
    import fdlora
    from fdlora.fixtures import tiny_tasks

    model = tiny_tasks.build("tiny-vit")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialLoadWarning)
        fdlora.load_fd_lora(model, str(trained_vit))


def test_plan_accepts_tiny_sd15_like_run_train_and_demo(capsys):
    from fdlora.fixtures import tiny_pipeline
    from fdlora.plan.builtins import BUILTINS

    assert main(["plan", "tiny-sd15"]) == 0
    assert "fdlora plan: tiny-sd15 on" in capsys.readouterr().out
    unet = tiny_pipeline.sd15().unet.config  # the planner's config is the pipeline's UNet
    for key, value in BUILTINS["tiny-sd15"][2].items():
        got = unet[key]
        assert (list(got) if isinstance(got, (list, tuple)) else got) == value, key


def test_plan_recommendation_and_table_use_the_same_memory_numbers():
    from fdlora.plan.api import plan

    r = plan("llama-3-8b", gpu="cpu", adapters_per_batch=4)
    table = r.table()
    rows = {line.split()[0]: line for line in table.splitlines()[3:3 + len(r.strategies)]}
    for s in r.strategies:
        fits = r.need_gib(s) <= r.info["device_gib"]
        assert (("does not fit" in rows[s.name]) == (s.feasible and not fits)), rows[s.name]
    best = r.by_name(r.recommended)
    assert r.need_gib(best) <= r.info["device_gib"]
    dynamic = r.by_name("dynamic")
    if dynamic.extra_gib <= 0 and r.need_gib(dynamic) > r.info["device_gib"]:  # the base alone does not fit
        assert "exceed the device's" in r.reason and "even at +0 GiB" in r.reason
    assert f"leaves {r.info['free_gib']:.2f} GiB" in table


def test_the_demo_offers_its_adapters_under_the_names_it_shows():
    pytest.importorskip("diffusers")
    from fdlora.apps.demo import Demo, tiny_pipe

    demo = Demo(tiny_pipe())
    assert demo.names == ["pixel", "watercolor"]
    assert demo.offered() == demo.names
