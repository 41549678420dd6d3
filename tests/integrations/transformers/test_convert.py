"""from_peft / from_diffusers: live PEFT layers become fused layers, outputs and adapter state unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.lora import LoraLayer

import fdlora
from fdlora.layers import registry_of_models
from integrations.transformers.models import BY_ID, built, ids, randomize_lora
from integrations.transformers.test_equivalence import check_close, float_tensors, peft_run, run


def peft_copy(case_id):
    return copy.deepcopy(built(case_id).peft)


def one_row_at_a_time(peft_model, inputs, rows):
    """PEFT's outputs for a mixed batch, each row run alone with its adapter (another eager sample of it)."""
    outs = []
    for i, name in enumerate(rows):
        row = {k: v[i:i + 1] for k, v in inputs.items()}
        if name == "__base__":
            with peft_model.disable_adapter():
                outs.append(run(peft_model, row))
        else:
            outs.append(peft_run(peft_model, name, row))
    return [torch.cat(ts) for ts in zip(*outs)]


@pytest.mark.parametrize("case_id", ["llama", "gpt2-conv1d", "t5", "vit-cls"])
def test_from_peft_keeps_outputs_and_adapters(case_id):
    peft_model = peft_copy(case_id)
    inputs = BY_ID[case_id].inputs(3)
    oracle = copy.deepcopy(peft_model).double()
    before = {n: peft_run(peft_model, n, inputs) for n in ("one", "two")}
    expect = {n: peft_run(oracle, n, inputs, torch.float64) for n in ("one", "two")}
    rows = ["two", "__base__", "one"]
    mixed_before = peft_run(peft_model, "one", inputs, adapter_names=rows)
    mixed_expect = peft_run(oracle, "one", inputs, torch.float64, adapter_names=rows)
    mixed_alone = one_row_at_a_time(peft_model, inputs, rows)
    peft_model.set_adapter("two")
    model = fdlora.from_peft(peft_model)
    assert isinstance(model, fdlora.FdLoraModel) and isinstance(model, type(built(case_id).base))
    assert not any(isinstance(m, LoraLayer) for m in model.modules())
    assert fdlora.active_adapters(model) == ["two"] and fdlora.handle(model).list_adapters() == ["one", "two"]
    check_close(run(model, inputs), before["two"], expect["two"], "two")
    fdlora.set_adapters(model, "one")
    check_close(run(model, inputs), before["one"], expect["one"], "one")
    check_close(run(model, inputs, adapter_names=rows), mixed_before, mixed_expect, "mixed", also=[mixed_alone])
    base = model.unload()  # the original modules and class, bit for bit
    assert type(base) is type(built(case_id).base)
    with torch.no_grad():
        ref = float_tensors(built(case_id).base(**inputs, output_hidden_states=True, use_cache=False))
        got = float_tensors(base(**inputs, output_hidden_states=True, use_cache=False))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_from_peft_keeps_weights_blends_and_disabled():
    """Weights PEFT carries (set_scale: shared -> the fd-lora weight, block-wise -> a weight per layer; the adapters
    keep their alpha) and the disabled flag."""
    peft_model = peft_copy("llama")
    lora = peft_model.base_model
    lora.set_adapter(["one", "two"])
    for path, m in lora.model.named_modules():
        if isinstance(m, LoraLayer):
            m.set_scale("one", 0.5)
            if "two" in m.lora_A:
                m.set_scale("two", 2.0 if "layers.0." in path else -1.0)  # block-wise
    inputs = {"input_ids": ids(2)}
    with torch.no_grad():
        before = lora(**inputs).logits
        lora.disable_adapter_layers()
        off = lora(**inputs).logits
    ref = copy.deepcopy(lora)
    ref.enable_adapter_layers()
    model = fdlora.from_peft(lora)  # a LoraModel works as well as a PeftModel
    h = fdlora.handle(model)
    two = h.state.active["two"]
    assert h.state.active["one"] == 0.5 and not h.state.enabled
    assert two and all(w == (2.0 if "layers.0." in p else -1.0) for p, w in two.items())
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, off)
        fdlora.enable(model)
        assert torch.allclose(model(**inputs).logits, before, rtol=1e-5, atol=1e-5)
        for m in ref.modules():  # weight 1 in PEFT is weight 1 in fd-lora: alpha / r, nothing folded in
            if isinstance(m, LoraLayer):
                for n in m.lora_A:
                    m.set_scale(n, 1.0)
        fdlora.set_adapters(model, ["one", "two"], [1.0, 1.0])
        assert torch.allclose(model(**inputs).logits, ref(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_from_peft_refuses_other_variants_and_leaves_the_model_alone():
    from peft.tuners.lora.layer import LoraLayer

    peft_model = peft_copy("llama")
    peft_model.add_adapter("emb", LoraConfig(r=4, target_modules=["embed_tokens"]))
    layers = {n: type(m) for n, m in peft_model.named_modules()}
    assert any(isinstance(m, LoraLayer) and len(m.lora_embedding_A) for m in peft_model.modules())
    with pytest.raises(fdlora.errors.UnsupportedFeatureError, match="embeddings"):
        fdlora.from_peft(peft_model)
    assert {n: type(m) for n, m in peft_model.named_modules()} == layers
    assert peft_model.base_model.model not in registry_of_models


def _lora_state(model, targets, r, seed, prefix=""):
    m = copy.deepcopy(model)
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False), m, "x")
    randomize_lora(m, seed, std=0.05)
    return {prefix + k: v for k, v in get_peft_model_state_dict(m, adapter_name="x").items()}


def test_from_diffusers_converts_every_component():
    from support.tiny import unet_inputs

    from fdlora.fixtures import tiny_pipeline as tiny

    pipe = tiny.sd15()
    sd = {**_lora_state(pipe.unet, ["to_q", "to_v", "proj_in"], 4, 1, "unet."),
          **_lora_state(pipe.text_encoder, ["q_proj", "v_proj"], 4, 2, "text_encoder.")}
    pipe.load_lora_weights(sd, adapter_name="a")
    pipe.unet.load_lora_adapter(_lora_state(pipe.unet, ["to_k", "conv1"], 8, 3), adapter_name="b", prefix=None)
    pipe.set_adapters(["a", "b"], [0.7, 0.4])
    x = unet_inputs(pipe.unet)
    tokens = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    oracle = copy.deepcopy(pipe.unet).double()
    with torch.no_grad():
        unet_before = pipe.unet(**x).sample
        unet_expect = oracle(**{k: v.double() if torch.is_tensor(v) else v for k, v in x.items()}).sample
        te_before = pipe.text_encoder(tokens)[0]
    assert fdlora.from_diffusers(pipe) is pipe
    for comp in (pipe.unet, pipe.text_encoder):
        assert not any(isinstance(m, LoraLayer) for m in comp.modules()) and "peft_config" not in vars(comp)
    assert fdlora.handle(pipe.unet).state.active == {"a": 0.7, "b": 0.4}
    assert fdlora.handle(pipe.text_encoder).state.active == {"a": 0.7}
    with torch.no_grad():
        check_close([pipe.unet(**x).sample], [unet_before], [unet_expect], "unet")
        assert torch.allclose(pipe.text_encoder(tokens)[0], te_before, rtol=1e-5, atol=1e-6)
