"""The light core install (issue 26, part 1).

`pip install fd-lora` needs torch, safetensors, huggingface_hub, tqdm and pyyaml (+ triton on Linux x86-64);
diffusers, transformers, peft, accelerate, bitsandbytes, gradio and Ray come with extras. Proof, without a
second multi-GB torch install:

- the metadata pip builds from pyproject.toml (`pip install --dry-run --report`) requires exactly the core
  list, and each extra names what it installs;
- a child Python whose import system refuses every optional package (tests/support/coreonly/sitecustomize.py,
  also what scripts/test.sh runs the pure-torch test files under) imports fdlora, loads nothing optional,
  runs the pure-torch API against a plain-torch oracle, and gets one line naming `pip install fd-lora[extra]`
  for a feature that needs an extra.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COREONLY = ROOT / "tests" / "support" / "coreonly"
CORE = {"torch", "safetensors", "huggingface-hub", "tqdm", "pyyaml", "triton"}
OPTIONAL = {"diffusers", "transformers", "peft", "accelerate", "bitsandbytes", "torchao", "gguf", "gradio", "ray",
            "fastapi"}


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")


@pytest.fixture(scope="module")
def metadata(tmp_path_factory) -> dict:
    """The package metadata pip itself builds from pyproject.toml (nothing is installed or downloaded)."""
    report = tmp_path_factory.mktemp("pip") / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-build-isolation",
                    "--no-index", "--quiet", "--disable-pip-version-check", "--report", str(report), str(ROOT)],
                   check=True, capture_output=True, timeout=120)
    (item,) = json.loads(report.read_text())["install"]
    return item["metadata"]


def test_core_requirements_are_the_core_list(metadata):
    reqs = metadata["requires_dist"]
    core = {_name(r) for r in reqs if "extra ==" not in r}
    assert core == CORE
    triton = next(r for r in reqs if _name(r) == "triton" and "extra ==" not in r)
    assert "platform_system" in triton  # only where it applies


def test_extras_name_what_they_install(metadata):
    extras = {}
    for r in metadata["requires_dist"]:
        m = re.search(r'extra == "([^"]+)"', r)
        if m:
            extras.setdefault(m.group(1), set()).add(_name(r))
    assert set(metadata["provides_extra"]) >= {"diffusers", "transformers", "quant", "train", "demo", "serve", "all",
                                               "dev"}
    assert {"diffusers", "peft", "transformers"} <= extras["diffusers"]
    assert {"transformers", "peft", "accelerate"} <= extras["transformers"]
    assert {"bitsandbytes", "torchao", "gguf"} <= extras["quant"] and "gradio" in extras["demo"]
    assert {"ray", "fastapi"} <= extras["serve"]
    assert extras["all"] == {"fd-lora"}  # all = fd-lora[every other extra but dev]


def test_blocker_covers_every_optional_module():
    sys.path.insert(0, str(COREONLY))
    try:
        src = (COREONLY / "sitecustomize.py").read_text()
    finally:
        sys.path.remove(str(COREONLY))
    from fdlora.extras import EXTRA_OF

    blocked = set(re.findall(r'"(\w+)"', src.split("BLOCKED =", 1)[1].split(")", 1)[0]))
    assert set(EXTRA_OF) <= blocked


CHILD = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import fdlora
    from fdlora.extras import MissingExtraError
    from fdlora.hub.adapter import LoraAdapter, ModuleLora

    loaded = sorted({m.split('.')[0] for m in sys.modules} & OPTIONAL)
    assert not loaded, loaded
    for mod in OPTIONAL:
        try:
            __import__(mod)
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit(f"{mod} importable under the core blocker")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    x = torch.randn(5, 16)
    base = model(x)
    A, B = torch.randn(4, 16), torch.randn(32, 4)
    fdlora.inject(model, ["0"], max_slots=2)
    fdlora.add_adapter(model, LoraAdapter({"0": ModuleLora(A, B, 8.0)}), "a")
    fdlora.restore(model)  # bit-exact restore, then the oracle in plain torch from the untouched weights
    with torch.no_grad():
        assert torch.equal(model(x), base)
        W0, b0 = model[0].weight, model[0].bias
        oracle = model[2](torch.relu(x @ W0.T + b0 + 0.5 * (8.0 / 4) * (x @ A.T) @ B.T))
    fdlora.add_adapter(model, LoraAdapter({"0": ModuleLora(A, B, 8.0)}), "a")
    fdlora.set_adapters(model, ["a"], [0.5])
    with torch.no_grad():
        got = model(x)
        torch.testing.assert_close(got, oracle, rtol=1e-5, atol=1e-5)
        with fdlora.per_sample(model, ["a", None, {"a": 0.5}, None, "a"]):
            rows = model(x)
    fdlora.set_adapters(model, ["a"], [1.0])
    with torch.no_grad():
        full = model(x)
    torch.testing.assert_close(rows[[1, 3]], base[[1, 3]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows[[0, 4]], full[[0, 4]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows[2], oracle[2], rtol=1e-5, atol=1e-5)

    # features that need an extra: one line naming the extra
    kohya = {"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.randn(4, 8),
             "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.randn(8, 4)}
    for call, extra in [(lambda: fdlora.inject(nn.Sequential(nn.Linear(2, 2)), "all-linear"), "transformers"),
                        (lambda: fdlora.from_diffusers(object()), "diffusers"),
                        (lambda: fdlora.load_adapters(kohya), "diffusers")]:
        try:
            call()
        except MissingExtraError as e:
            msg = str(e)
            assert "\\n" not in msg and f"pip install 'fd-lora[{extra}]'" in msg, msg
        else:
            raise SystemExit("no MissingExtraError")
    print("CORE-OK")
""")


def _core_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(COREONLY), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                        else []))
    return env


def test_import_and_pure_torch_api_with_the_core_alone():
    out = subprocess.run([sys.executable, "-c", f"OPTIONAL = set({sorted(OPTIONAL)!r})\n" + CHILD], env=_core_env(),
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "CORE-OK" in out.stdout, out.stderr[-3000:]


def test_cli_names_the_extra_with_the_core_alone(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pipeline: tiny-sd15\ndevice: cpu\nserve: {replicas: 1}\n")
    out = subprocess.run([sys.executable, "-m", "fdlora", "serve", str(cfg)], env=_core_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'fd-lora[serve]'" in lines[0], out.stderr[-2000:]


@pytest.mark.parametrize("targets, exclude", [
    (["q_proj", "v_proj"], None), (["0.q_proj", "q"], None), (["blocks.0.q_proj"], None), (r".*\.(q|v)_proj", None),
    (["q_proj", "v_proj"], ["blocks.1.q_proj"]), (r".*_proj", r"blocks\.0\..*"), (["mlp", "head"], "head"),
], ids=["suffixes", "dotted-and-partial-suffix", "full-path", "regex", "exclude-list", "exclude-regex", "exclude-str"])
def test_core_target_matching_equals_peft(monkeypatch, targets, exclude):
    pytest.importorskip("peft")
    from torch import nn

    from fdlora.layers.model.targets import match_targets

    def net():
        blocks = nn.ModuleList(nn.ModuleDict({"q_proj": nn.Linear(4, 4), "v_proj": nn.Linear(4, 4),
                                              "mlp": nn.Linear(4, 4)}) for _ in range(2))
        return nn.ModuleDict({"blocks": blocks, "head": nn.Linear(4, 2)})

    with_peft = match_targets(net(), targets, exclude)
    for mod in ("peft", "peft.tuners.tuners_utils"):
        monkeypatch.setitem(sys.modules, mod, None)  # `import peft` now raises ModuleNotFoundError
    assert match_targets(net(), targets, exclude) == with_peft
