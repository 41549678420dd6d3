"""`fdlora inspect SOURCE`: the load report from the command line, without a model."""

from __future__ import annotations

from support import loras

from fdlora.apps.cli import main


def files(seed: int) -> dict[str, bytes]:
    return loras.diffusers_files({"unet": loras.make_lora({"down_blocks.0.attn.to_q": (8, 8)}, rank=2, seed=seed)})


def test_inspect_a_hub_repo_at_a_revision(hub, capsys):
    repo, c1 = hub.publish({**files(1), "extra.safetensors": files(2)["pytorch_lora_weights.safetensors"]},
                           refs=("main", "v1"))
    hub.publish({"style.safetensors": files(3)["pytorch_lora_weights.safetensors"]}, repo=repo)
    assert main(["inspect", repo, "--revision", "v1"]) == 0
    out = capsys.readouterr().out
    assert f"@ v1 -> {c1}" in out and "pytorch_lora_weights.safetensors" in out and "format    diffusers" in out
    assert main(["inspect", repo, "--revision", c1, "--weight-name", "extra.safetensors"]) == 0
    assert "weight_name given" in capsys.readouterr().out
    assert main(["inspect", repo]) == 0
    assert "style.safetensors: the only .safetensors file" in capsys.readouterr().out


def test_inspect_errors_are_one_line(tmp_path, capsys):
    assert main(["inspect", "test/no-such-repo"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fdlora inspect: error:") and "no Hub repo" in err and "Traceback" not in err
    (tmp_path / "a.safetensors").write_bytes(files(4)["pytorch_lora_weights.safetensors"])
    (tmp_path / "b.safetensors").write_bytes(files(5)["pytorch_lora_weights.safetensors"])
    assert main(["inspect", str(tmp_path)]) == 1
    assert "weight_name" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path), "--weight-name", "b.safetensors", "--strict"]) == 0
