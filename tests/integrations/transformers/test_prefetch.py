"""fdlora.integrations.prefetch.prefetch on a Transformers model: a PEFT adapter read off the model's lock, attached
under it, never activated; equal to the Transformers load_fd_lora; errors on .result(), model unchanged."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

import fdlora
from fdlora import errors
from fdlora.integrations.prefetch import prefetch
from fdlora.layers import registry_of_models
from integrations.transformers.models import randomize_lora


def llama(hidden=32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).eval()


def saved(model) -> str:
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(target_modules=["q_proj", "v_proj"]))
    randomize_lora(peft_model)
    out = tempfile.mkdtemp()
    peft_model.save_pretrained(out)
    return out


def test_prefetch_equals_load_on_a_transformers_model():
    base = llama()
    folder = saved(base)
    loaded, fetched = copy.deepcopy(base), copy.deepcopy(base)
    fdlora.load_fd_lora(loaded, folder, adapter_name="chat")
    assert prefetch(fetched, folder, "chat").result(60) is fetched
    assert fdlora.active_adapters(fetched) == []  # never activated
    fdlora.set_adapters(fetched, ["chat"])
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.inference_mode():
        assert torch.equal(fetched(ids).logits, loaded(ids).logits)
        assert not torch.equal(fetched(ids).logits, base(ids).logits)


def test_a_bad_prefetch_raises_on_result_and_changes_nothing():
    target = llama()
    job = prefetch(target, saved(llama(hidden=64)), "other")
    with pytest.raises(errors.AdapterShapeError, match="another base model"):
        job.result(60)
    assert target not in registry_of_models
    with pytest.raises(errors.FdLoraError, match="never activates"):
        prefetch(target, saved(target), "x", activate=True)
