"""Malformed `fdlora train` configs and `serve:` sections: every one fails validation with one ConfigError line naming
the file, before any model is built. Seeded; FDLORA_RELIABILITY_SCALE sets how many (the run configs are
test_fuzz_configs.py)."""

from __future__ import annotations

import copy
import math
import random
from collections import Counter

import pytest
import yaml

from fdlora.config import load_config
from fdlora.errors import ConfigError
from fdlora.training import schema

from .conftest import scaled

N_TRAIN, N_SERVE = 200, 120
TRAIN = {"model": {"name": "tiny-vit", "task": "image-classification"},
         "lora": {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"], "rslora": False},
         "data": "synthetic",
         "train": {"steps": 3, "batch_size": 4, "lr": 3e-3, "optimizer": "adamw", "seed": 0, "checkpoint_every": 0},
         "output": {"dir": "out/x"}}
TRAIN_BAD = {  # section.key -> values that must each be refused
    "model.name": [5, None, ["tiny-vit"], {"a": 1}],
    "model.task": ["segmentation", 1, None, "Causal-LM"],
    "lora.r": [0, -1, "8", 2.5, None, True],
    "lora.alpha": ["16", None, float("nan"), float("inf"), -4, [1]],
    "lora.dropout": [-0.1, 1.0, 1.5, "0.1", float("nan"), True],
    "lora.target_modules": [5, [], [5], {"q": 1}, ""],
    "lora.rslora": ["yes", 1],
    "lora.init": ["uniform", 2],
    "quantization.type": ["nf3", 4, "int4"],
    "quantization.method": ["auto", 1],
    "quantization.compute_dtype": ["float8", 16],
    "train.steps": [0, -5, "10", 2.5, True],
    "train.batch_size": [0, -1, "4", 1.5],
    "train.lr": [-1.0, 0, "fast", float("inf"), float("nan")],
    "train.optimizer": ["adagrad", 1, None],
    "train.mixed_precision": ["fp8", True, "bf32"],
    "train.grad_accumulation": [0, -2, "1"],
    "train.seed": [-1, "0", 1.5],
    "train.checkpoint_every": [-1, "5"],
    "train.device": ["tpu", 0],
    "output.push_to_hub": ["nope", 5, "a/b/c"],
}
SERVE = {"pipeline": "tiny-sd15", "device": "cpu", "adapters": [{"name": "pixel", "source": "user/pixel"}],
         "serve": {"replicas": 2, "adapters_per_replica": 4, "max_batch": 8, "port": 8000}}
SERVE_BAD = {
    "replicas": [0, -1, 65, "2", 1.5, True, None],
    "adapters_per_replica": [0, 65, "4"],
    "max_batch": [0, 257, "8", -3],
    "batch_wait_s": [-0.1, 11.0, "0.05", float("nan"), float("inf")],
    "host": [5, ["127.0.0.1"], True],
    "port": [-1, 65536, "8000", 80.5],
    "address": [5, ["ray://x"]],
    "max_steps": [0, 1001, "50"],
    "max_size": [7, 4097, "1024"],
}
TEXTS = ["", "[1, 2", "model: [", "- 1\n- 2", "just text", "model: !!python/object/apply:os.system ['echo x']",
         "{a: " * 3000 + "}" * 3000, "\x00\x01"]


def _set(d: dict, path: str, value) -> None:
    section, key = path.split(".")
    if not isinstance(d.get(section), dict):
        d[section] = {}
    d[section][key] = value


def train_configs(n: int) -> list[tuple[str, str]]:
    rng = random.Random(23)
    out = [("text", t) for t in TEXTS]
    while len(out) < n:
        d = copy.deepcopy(TRAIN)
        kind = rng.choice(["value", "value", "values", "unknown-key", "unknown-section", "missing"])
        if kind in ("value", "values"):
            for path in rng.sample(list(TRAIN_BAD), 1 if kind == "value" else rng.randint(2, 3)):
                if path.startswith("quantization."):
                    d["quantization"] = {"enabled": True, "type": "nf4"}
                _set(d, path, rng.choice(TRAIN_BAD[path]))
        elif kind == "unknown-key":
            d[rng.choice(["lora", "train", "model"])][rng.choice(["rank", "step", "lr_", "Task", "alpha_"])] = 1
        elif kind == "unknown-section":
            d[rng.choice(["loras", "training", "optim", "Model"])] = {}
        else:
            del d[rng.choice(["model", "lora"])]
        out.append((kind, yaml.safe_dump(d)))
    return out[:n]


def serve_configs(n: int) -> list[tuple[str, str]]:
    rng = random.Random(26)
    out = []
    while len(out) < n:
        d = copy.deepcopy(SERVE)
        kind = rng.choice(["value", "value", "values", "unknown-key", "not-a-mapping"])
        if kind in ("value", "values"):
            for key in rng.sample(list(SERVE_BAD), 1 if kind == "value" else rng.randint(2, 3)):
                d["serve"][key] = rng.choice(SERVE_BAD[key])
        elif kind == "unknown-key":
            d["serve"][rng.choice(["replica", "Port", "workers", "max_batches"])] = 1
        else:
            d["serve"] = rng.choice([5, "fast", [1, 2], True])
        out.append((kind, yaml.safe_dump(d)))
    return out


def _refused(load, path, text: str, what: str, i: int, kind: str) -> None:
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        load(path)
    except ConfigError as e:
        line = str(e)
        assert line.startswith(f"{path}: ") and "\n" not in line, line
    except Exception as e:
        raise AssertionError(f"{what} {i} ({kind}) raised {type(e).__name__}: {e}\n{text[:300]}") from e
    else:
        raise AssertionError(f"{what} {i} ({kind}) validated:\n{text[:300]}")


def test_malformed_train_configs(figures, tmp_path):
    n = scaled(N_TRAIN)
    kinds = Counter()
    for i, (kind, text) in enumerate(train_configs(n)):
        kinds[kind] += 1
        _refused(schema.load, tmp_path / "train.yaml", text, "train config", i, kind)
    figures["fuzzed_configs"] += n
    figures["per_kind"].update({f"train-config:{k}": v for k, v in kinds.items()})


def test_malformed_serve_sections(figures, tmp_path):
    n = scaled(N_SERVE)
    kinds = Counter()
    for i, (kind, text) in enumerate(serve_configs(n)):
        kinds[kind] += 1
        _refused(load_config, tmp_path / "serve.yaml", text, "serve config", i, kind)
    figures["fuzzed_configs"] += n
    figures["per_kind"].update({f"serve-config:{k}": v for k, v in kinds.items()})


@pytest.mark.parametrize("loader,data", [(schema.validate, TRAIN), (None, SERVE)], ids=["train", "serve"])
def test_the_valid_bases_validate(loader, data, tmp_path):
    if loader is not None:
        assert loader(copy.deepcopy(data)).r == 8
    else:
        (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
        assert load_config(tmp_path / "s.yaml").serve["replicas"] == 2
    assert not math.isnan(0.0)
