"""Malformed YAML run configs: every one fails validation with a ConfigError (one line naming the key path), before
anything is built or downloaded. Seeded; FDLORA_RELIABILITY_SCALE sets how many."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import yaml

from fdlora.config import load_config, validate
from fdlora.errors import ConfigError

from .conftest import scaled

N_CONFIGS = 240
VALID = {"pipeline": "tiny-sd15", "dtype": "float32", "device": "cpu", "backend": "torch", "steps": 2, "seed": 0,
         "prompt": "a cat", "adapters": [{"name": "pixel", "source": "user/pixel", "weight": 0.8,
                                          "hub": {"revision": "main", "local_files_only": True}}]}
BAD_VALUES = {  # key path -> values that must each be refused
    "pipeline": ["tiny-nope", 5, None, ["tiny-sd15"], True],
    "dtype": ["float8", 16, None, "Float32"],
    "device": ["gpu", "cuda:x", 0, "cuda:-1"],
    "backend": ["cutlass", 1, True],
    "steps": [0, -1, 10 ** 30, 2.5, "2", True],
    "seed": [-1, 2 ** 70, "0", 1.0],
    "size": [0, 10 ** 12, "512"],
    "prompt": [5, ["a"], {"x": 1}],
    "hub": [5, {"revision": 3}, {"nope": 1}, {"local_files_only": "yes"}, {"subfolder": "../.."}],
    "adapters": ["x", 5, [5], [{}], [{"name": "a"}], [{"name": "__base__", "source": "u/r"}],
                 [{"name": 7, "source": "u/r"}], [{"name": "a", "source": "u/r", "weight": 10 ** 400}],
                 [{"name": "a", "source": "u/r", "weight": float("nan")}],
                 [{"name": "a", "source": "u/r", "weight": "0.8"}],
                 [{"name": "a", "source": "u/r", "hub": {"weight_name": "../../x"}}],
                 [{"name": "a", "source": "u/r"}, {"name": "a", "source": "u/s"}],
                 [{"name": "a", "source": "u/r", "extra": 1}], [{"name": "", "source": "u/r"}]],
    "quantization": [{"bits": 3}, {}, 4, {"bits": True}],
    "output": [5],
}
TEXTS = [  # whole files that are not a config at all
    "", "[1, 2", "a: [", "\t- x", "- 1\n- 2", "just text", "a: 2001-13-45", "a: !!float abc", "a: !!int 0x",
    "a: !!python/object/apply:os.system ['echo pwned']", "a: !!binary '@@@'", "[" * 5000 + "]" * 5000,
    "{a: " * 3000 + "}" * 3000, "pipeline: tiny-sd15\npipeline: tiny-sdxl\nbogus: 1",
    "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, "
    "*b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\npipeline: *e",
    "\x00\x01\x02", "pipeline: tiny-sd15\nsteps: 99999999999999999999999999999",
]


def configs(n: int) -> list[tuple[str, str]]:
    """(kind, YAML text) for n malformed configs: one to three bad values, unknown keys, missing keys, raw text."""
    rng = random.Random(28)
    out = [("text", t) for t in TEXTS]
    while len(out) < n:
        d = yaml.safe_load(yaml.safe_dump(VALID))
        kind = rng.choice(["value", "value", "values", "unknown-key", "missing-key", "model-with-prompt"])
        if kind in ("value", "values"):
            for key in rng.sample(list(BAD_VALUES), 1 if kind == "value" else rng.randint(2, 3)):
                d[key] = rng.choice(BAD_VALUES[key])
        elif kind == "unknown-key":
            d[rng.choice(["pipelin", "adapter", "step", "Steps", 5, "hub_"])] = 1
        elif kind == "missing-key":
            del d["pipeline"]
        else:
            d["model"] = d.pop("pipeline").replace("tiny-sd15", "tiny-llama")
        out.append((kind, yaml.safe_dump(d) if rng.random() < 0.9 else repr(d)))
    return out[:n]


def test_malformed_configs(figures, tmp_path):
    n = scaled(N_CONFIGS)
    kinds, outcomes = Counter(), Counter()
    path = tmp_path / "cfg.yaml"
    for i, (kind, text) in enumerate(configs(n)):
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        kinds[kind] += 1
        try:
            load_config(path)
        except ConfigError as e:
            assert str(e).startswith(f"{path}: "), e
            outcomes["ConfigError"] += 1
        except Exception as e:
            raise AssertionError(f"config {i} ({kind}) raised {type(e).__name__}: {e}\n{text[:300]}") from e
        else:
            raise AssertionError(f"config {i} ({kind}) validated:\n{text[:300]}")
    figures["fuzzed_configs"] += n
    figures["per_kind"].update({f"config:{k}": v for k, v in kinds.items()})
    figures["outcomes"].update({f"config:{k}": v for k, v in outcomes.items()})


def test_the_valid_config_validates():
    assert validate(VALID).adapters[0].weight == 0.8


@pytest.mark.parametrize("size", [2 << 20])
def test_oversized_file(size, tmp_path):
    (tmp_path / "big.yaml").write_text("#" * size)
    with pytest.raises(ConfigError, match="too large"):
        load_config(tmp_path / "big.yaml")
