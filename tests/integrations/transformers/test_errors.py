"""Bad input raises fdlora errors that name the problem and the fix, and leaves the model as it was."""

from __future__ import annotations

import copy
import importlib.util
import tempfile

import pytest
import torch
import transformers
from peft import IA3Config, LoraConfig, get_peft_model

import fdlora
from fdlora import errors
from fdlora.layers import registry_of_models
from integrations.transformers.models import BY_ID, built, ids, randomize_lora


def saved(model, config, name="default"):
    peft_model = get_peft_model(copy.deepcopy(model), config, adapter_name=name)
    randomize_lora(peft_model)
    out = tempfile.mkdtemp()
    peft_model.save_pretrained(out)
    return out


def llama(layers=2, hidden=32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=48, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_adapter_for_another_architecture_names_the_modules():
    target = llama()
    with pytest.raises(errors.TargetError, match=r"transformer\.h\.0\.attn\.c_attn.*another architecture"):
        fdlora.load_fd_lora(target, built("gpt2-conv1d").dirs["one"])
    with pytest.raises(errors.TargetError, match=r"model\.layers\.3\."):
        fdlora.load_fd_lora(target, saved(llama(layers=4), LoraConfig(target_modules=["q_proj"])))
    with pytest.raises(errors.AdapterShapeError, match="another base model"):
        fdlora.load_fd_lora(target, saved(llama(hidden=64), LoraConfig(target_modules=["q_proj"])))
    assert target not in registry_of_models and not any("base" in n for n, _ in target.named_modules())


def test_dora_without_its_magnitudes_and_other_variants_are_refused():
    target = llama()
    folder = saved(llama(), LoraConfig(target_modules=["q_proj"], use_dora=True))  # DoRA loads (test_dora.py) ...
    import json
    from pathlib import Path

    cfg = Path(folder) / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "use_dora": False}))
    with pytest.raises(errors.FormatError, match="DoRA magnitude vector .* use_dora=False"):  # ... a mismatch does not
        fdlora.load_fd_lora(target, folder)
    with pytest.raises(errors.FormatError, match="IA3 adapter, not LoRA"):
        fdlora.load_fd_lora(target, saved(llama(), IA3Config(target_modules=["q_proj", "down_proj"],
                                                             feedforward_modules=["down_proj"])))
    with pytest.raises(errors.UnsupportedFeatureError, match="embeddings"):
        fdlora.load_fd_lora(target, saved(llama(), LoraConfig(target_modules=["embed_tokens", "q_proj"])))
    assert target not in registry_of_models


def test_trained_base_biases_are_refused():
    case = BY_ID["bert-seqcls"]
    base = built(case.id).base
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(target_modules=["query"], bias="all"))
    with torch.no_grad():
        peft_model.base_model.model.bert.encoder.layer[0].output.dense.bias.add_(1.0)
    out = tempfile.mkdtemp()
    peft_model.save_pretrained(out)
    with pytest.raises(errors.UnsupportedFeatureError, match="bias='all'"):
        fdlora.load_fd_lora(copy.deepcopy(base), out)


def test_unknown_names_and_duplicates():
    b = built("llama")
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    with pytest.raises(errors.UnknownAdapterError, match="no adapter named 'three'.*loaded: 'one'"):
        model(ids(2), adapter_names=["one", "three"])
    with pytest.raises(errors.UnknownAdapterError):
        fdlora.set_adapters(model, "three")
    with pytest.raises(errors.DuplicateAdapterError, match="pick another adapter_name"):
        fdlora.load_fd_lora(model, b.dirs["two"], "one")
    with pytest.raises(errors.ResolveError, match="cannot choose a weight file"):
        fdlora.load_fd_lora(model, tempfile.mkdtemp(), "x")
    assert fdlora.handle(model).list_adapters() == ["one"]


def test_two_module_copies_cannot_blend():
    b = built("vit-cls")
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    fdlora.load_fd_lora(model, b.dirs["two"], "two")
    fdlora.set_adapters(model, ["one", "two"])
    with pytest.raises(errors.FdLoraError, match="only one can be used at a time"):
        model(**BY_ID["vit-cls"].inputs(1))


def test_missing_bitsandbytes_says_how_to_install(monkeypatch):
    model = llama()
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    with pytest.raises(errors.UnsupportedFeatureError, match="pip install bitsandbytes"):
        fdlora.load_fd_lora(model, built("llama").dirs["two"])
