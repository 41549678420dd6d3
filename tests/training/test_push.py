"""`output: {dir, push_to_hub: user/name}` against the loopback Hub server: the PEFT adapter directory goes up in
one commit (no checkpoints), downloads back byte-equal and loads in PEFT and fd-lora (by Hub id) with equal
outputs; a Hub error (no token, a namespace the token does not own, an unreachable endpoint) is one line naming
the fix, and the local output stays whole."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

import fdlora
from fdlora.apps import cli
from fdlora.fixtures import tiny_tasks as tiny

CFG = {"model": {"name": "tiny-vit"},
       "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["classifier"]},
       "train": {"steps": 2, "batch_size": 4, "lr": 1e-2, "checkpoint_every": 1}}
TOKEN = "hf_fdlora_writer"


@pytest.fixture
def hub(pytestconfig, monkeypatch):
    """The session's loopback Hub with writes allowed only to TOKEN, in namespace fdlora-train."""
    h = pytestconfig.fakehub
    monkeypatch.setattr(h, "writers", {TOKEN: {"fdlora-train"}})
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return h


def _train(tmp_path, repo: str, capsys) -> tuple[int, str]:
    cfg = copy.deepcopy(CFG)
    cfg["output"] = {"dir": str(tmp_path / "out"), "push_to_hub": repo}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    rc = cli.main(["train", str(tmp_path / "c.yaml"), "--no-progress"])
    return rc, capsys.readouterr().err


def _outputs(adapter: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from peft import PeftModel

    pm = PeftModel.from_pretrained(tiny.build("tiny-vit"), adapter).eval()
    fm = fdlora.load_fd_lora(tiny.build("tiny-vit"), adapter).eval()
    with torch.no_grad():
        return pm(pixel_values=x).logits, fm(pixel_values=x).logits


def test_push_to_hub_uploads_the_adapter(tmp_path, hub, capsys):
    from huggingface_hub import snapshot_download

    repo = f"fdlora-train/vit-{tmp_path.name}"
    start = len(hub.log)
    rc, err = _train(tmp_path, repo, capsys)
    assert rc == 0, err
    got = snapshot_download(repo, cache_dir=tmp_path / "dl")
    local = tmp_path / "out"
    names = sorted(p.name for p in (tmp_path / "dl").rglob("*") if p.is_file() and "snapshots" in p.parts)
    assert names == ["adapter_config.json", "adapter_model.safetensors", "losses.json"]  # no checkpoints
    for n in names:
        assert (local / n).read_bytes() == (tmp_path / got / n).read_bytes(), n
    writes = [r for r in hub.log[start:] if r[0] == "POST" and "/commit/" in r[1]]
    assert len(writes) == 1 and writes[0][2] == 200 and writes[0].authorization == f"Bearer {TOKEN}"

    x = tiny.synthetic_batch("image-classification", tiny.build("tiny-vit"), 3, 7)["pixel_values"]
    a, b = _outputs(got, x)
    c, d = _outputs(repo, x)  # fd-lora and PEFT resolve the Hub id themselves
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5) and torch.equal(a, c) and torch.equal(b, d)
    with torch.no_grad():
        assert not torch.allclose(a, tiny.build("tiny-vit")(pixel_values=x).logits, atol=1e-4)

    rc, err = _train(tmp_path, repo, capsys)  # again into the existing repo: a second commit, no error
    assert rc == 0, err


BAD = [
    ("no-token", "fdlora-train/vit-no-token", None, ["401", "hf auth login", "HF_TOKEN"]),
    ("foreign-namespace", "someone-else/vit", TOKEN, ["403", "may not write", "'someone-else' namespace"]),
    ("unreachable", "fdlora-train/vit-down", TOKEN, ["could not reach http://127.0.0.1:9", "HF_ENDPOINT"]),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_hub_error_is_one_line_and_keeps_the_output(case, tmp_path, hub, capsys, monkeypatch):
    name, repo, token, wants = case
    if token is None:
        monkeypatch.delenv("HF_TOKEN")
    if name == "unreachable":
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
    rc, err = _train(tmp_path, repo, capsys)
    lines = [ln for ln in err.strip().splitlines() if "kernels-community" not in ln]
    assert rc == 1 and len(lines) == 1, err
    line = lines[0]
    for w in ["output.push_to_hub", repo, *wants, f"saved in {tmp_path / 'out'}", f"hf upload {repo}"]:
        assert w in line, (w, line)
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]
    x = tiny.synthetic_batch("image-classification", tiny.build("tiny-vit"), 2, 3)["pixel_values"]
    a, b = _outputs(str(out), x)  # the local adapter is whole
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
