"""fdlora.config: every broken config gives a ConfigError naming the key path, the bad value and what is allowed."""

from __future__ import annotations

import pytest

import fdlora
from fdlora.config import load_config, validate
from fdlora.errors import ConfigError, FdLoraError

AD = {"name": "pixel", "source": "user/pixel"}

CASES = [
    ({"pipline": "tiny-sd15"}, "pipline: unknown key 'pipline'; allowed keys: pipeline, model"),
    ({"pipeline": "tiny-sd15", "adapters": [{**AD, "scale": 1}]},
     "adapters[0].scale: unknown key 'scale'; allowed keys: name, source, weight, hub"),
    ({"pipeline": "tiny-sd15", "adapters": [{**AD, "hub": {"revison": "main"}}]},
     "adapters[0].hub.revison: unknown key 'revison'"),
    ({"dtype": "float32"}, "missing required key 'pipeline' or 'model'"),
    ({"pipeline": "tiny-sd15", "model": "tiny-llama"}, "give either 'pipeline' or 'model', not both"),
    ({"pipeline": "tiny-sd15", "adapters": [{"name": "pixel"}]}, "adapters[0]: missing required key 'source'"),
    ({"pipeline": "tiny-sd15", "quantization": {}}, "quantization: missing required key 'bits'"),
    ({"pipeline": 15}, "pipeline: got 15 (int); expected a Hub id"),
    ({"pipeline": "tiny-sd15", "adapters": {"pixel": 1}}, "adapters: got {'pixel': 1} (dict); expected a list"),
    ({"pipeline": "tiny-sd15", "steps": "two"}, "steps: got 'two' (str); expected an integer"),
    ({"pipeline": "tiny-sd15", "steps": 0}, "steps: got 0; expected an integer >= 1"),
    ({"pipeline": "tiny-sd15", "prompt": ["a", "b"]}, "prompt: got ['a', 'b'] (list); expected a string"),
    ({"pipeline": "tiny-sd16"}, "pipeline: got 'tiny-sd16'; allowed values: tiny-sd15, tiny-sdxl"),
    ({"model": "tiny-sd15"}, "model: got 'tiny-sd15'; allowed values: tiny-llama"),
    ({"pipeline": "tiny-sd15", "dtype": "float8"}, "dtype: got 'float8'; allowed values: float32, float16, bfloat16"),
    ({"pipeline": "tiny-sd15", "backend": "cudnn"},
     "backend: got 'cudnn'; allowed values: auto, triton, cuda, triton+cuda, torch"),
    ({"pipeline": "tiny-sd15", "device": "tpu"}, "device: got 'tpu'; allowed values: auto, cpu, cuda, cuda:N"),
    ({"pipeline": "tiny-sd15", "quantization": {"bits": 3}}, "quantization.bits: got 3; allowed values: 4, 8"),
    ({"pipeline": "tiny-sd15", "adapters": [{**AD, "weight": "high"}]},
     "adapters[0].weight: got 'high' (str); expected a number"),
    ({"pipeline": "tiny-sd15", "adapters": [{**AD, "weight": True}]}, "adapters[0].weight: got True (bool)"),
    ({"pipeline": "tiny-sd15", "adapters": [{**AD, "weight": float("nan")}]},
     "adapters[0].weight: got nan; expected a finite number"),
    ({"pipeline": "tiny-sd15", "adapters": [AD, AD]}, "adapters[1].name: got 'pixel' twice"),
    ({"model": "tiny-llama", "prompt": "hi"}, "prompt: only pipelines generate images"),
    ({"pipeline": "tiny-sd15", "output": "x.png"}, "output: an output needs a 'prompt'"),
    (["pipeline", "tiny-sd15"], "<top>: got ['pipeline', 'tiny-sd15'] (list); expected a mapping"),
]
IDS = ["unknown-top-key", "unknown-adapter-key", "unknown-hub-key", "missing-base", "both-bases",
       "missing-source", "missing-bits", "base-wrong-type", "adapters-wrong-type", "steps-wrong-type", "steps-zero",
       "prompt-wrong-type", "bad-tiny-pipeline", "bad-tiny-model", "bad-dtype", "bad-backend", "bad-device",
       "bad-bits", "weight-string", "weight-bool", "weight-nan", "duplicate-name", "prompt-on-model",
       "output-without-prompt", "not-a-mapping"]


@pytest.mark.parametrize("data, fragment", CASES, ids=IDS)
def test_broken_config_names_the_problem(data, fragment):
    with pytest.raises(ConfigError) as e:
        validate(data, "cfg.yaml")
    assert str(e.value).startswith("cfg.yaml: ")
    assert fragment in str(e.value)
    assert isinstance(e.value, FdLoraError)


def test_valid_config_round_trip(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("model: tiny-llama\ndtype: bfloat16\ndevice: cuda:1\nbackend: torch\nquantization: {bits: 4}\n"
                 "adapters:\n  - {name: a, source: ./a, weight: 2}\n  - {name: b, source: u/b, hub: {revision: v1}}\n")
    cfg = load_config(p)
    assert (cfg.kind, cfg.base, cfg.dtype, cfg.device, cfg.backend, cfg.quantization_bits) == (
        "model", "tiny-llama", "bfloat16", "cuda:1", "torch", 4)
    assert [(a.name, a.weight, a.hub) for a in cfg.adapters] == [("a", 2.0, {}), ("b", 1.0, {"revision": "v1"})]


def test_invalid_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("pipeline: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_from_config_tiny_llama_with_peft_adapter(tmp_path):
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from fdlora.config import _tiny_llama

    base = _tiny_llama()
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                 init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "ad")
    p = tmp_path / "m.yaml"
    p.write_text(f"model: tiny-llama\ndevice: cpu\nadapters:\n"
                 f"  - {{name: a, source: {tmp_path / 'ad'}, weight: 0.5}}\n")
    model = fdlora.from_config(p)
    assert fdlora.active_adapters(model) == ["a"]
    from diffusers.utils.peft_utils import set_weights_and_activate_adapters

    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        got = model(input_ids=ids).logits
        set_weights_and_activate_adapters(peft_model, ["default"], [0.5])
        want = peft_model(input_ids=ids).logits
        plain = base(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert float((got - plain).abs().max()) > 1e-3
