"""Smoke tests of the `fdlora bench` and `fdlora run` subcommands: help, bad arguments, a CPU run each."""

from __future__ import annotations

import json

import pytest

from fdlora.apps.cli import main


@pytest.mark.parametrize("command, options", [
    pytest.param("bench", ["--out", "--list", "--quick", "set_adapters"], id="bench"),
    pytest.param("run", ["--check", "--output", "config"], id="run"),
])
def test_help_exits_zero_and_names_options(command, options, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in options:
        assert opt in text


@pytest.mark.parametrize("argv, fragment", [
    pytest.param(["bench", "nope"], "fdlora bench: error: unknown benchmark 'nope'; choose from set_adapters",
                 id="bench-unknown-name"),
    pytest.param(["run", "/nonexistent/x.yaml"], "fdlora run: error: /nonexistent/x.yaml: cannot read the config",
                 id="run-missing-file"),
])
def test_bad_arguments_give_one_line_error(argv, fragment, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


def test_bench_bad_option_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--repeats-typo", "3"])
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("set_adapters", "delta", "fused", "pipeline", "load", "llm"):
        assert name in out


def test_bench_set_adapters_on_cpu_writes_json(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "set_adapters", "delta", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GPU-only benchmarks are skipped" in out
    result = json.loads((tmp_path / "set_adapters.json").read_text())
    assert result["benchmark"] == "set_adapters" and result["fdlora_weight_change_ms"] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {b["name"]: (b["status"], b["note"]) for b in summary["benchmarks"]}
    assert status["set_adapters"][0] == "ok"
    assert status["delta"] == ("skipped", "needs a CUDA GPU (none present)")
    assert not (tmp_path / "delta.json").exists()


def test_run_tiny_sd15_config_writes_image(tmp_path, capsys):
    from PIL import Image

    from fdlora.fixtures import tiny_pipeline as tiny
    from fdlora.fixtures.localcache import populate

    cache = tmp_path / "cache"
    populate(cache, "demo/pixel", tiny.random_lora_files(tiny.sd15(), seed=1))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
pipeline: tiny-sd15
device: cpu
backend: torch
adapters:
  - name: pixel
    source: demo/pixel
    weight: 0.7
    hub: {{cache_dir: {cache}, local_files_only: true}}
prompt: a cat
steps: 2
output: {tmp_path / "out.png"}
""")
    assert main(["run", str(cfg), "--no-caption"]) == 0
    assert "saved to" in capsys.readouterr().out
    assert Image.open(tmp_path / "out.png").size == (64, 64)
    from fdlora.kernels import set_backend

    set_backend("auto")


def test_run_check_validates_only(tmp_path, capsys):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("model: tiny-llama\ndtype: bfloat16\n")
    assert main(["run", str(cfg), "--check"]) == 0
    assert "config is valid" in capsys.readouterr().out
