"""Phi-3's fused projections (qkv_proj [q|k|v], gate_up_proj [gate|up]): a PEFT adapter on them is one LoRA per
fused layer (one A shared by the slices, one B over all of them), so it loads as is, from a saved directory and from a
live PeftModel, and gives PEFT's outputs; nothing to group (the shared shrink of fdlora.layers.modules.shared_shrink is that layer's
own shrink)."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import fdlora  # noqa: E402


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  pad_token_id=0)
    base = transformers.Phi3ForCausalLM(cfg).eval()
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                  init_lora_weights=False), adapter_name="one")
    pm.add_adapter("two", peft.LoraConfig(r=8, lora_alpha=4, target_modules=["qkv_proj", "gate_up_proj"],
                                          init_lora_weights=False))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    pm.eval()
    saved = tmp_path_factory.mktemp("phi3")
    pm.save_pretrained(saved)  # (adapters not named "default" go to saved/<name>)
    ids = torch.randint(1, 64, (3, 6), generator=torch.Generator().manual_seed(2))
    return base, pm, saved, ids


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def test_phi3_fused_projections_load_from_a_directory_and_match_peft(phi3):
    base, pm, saved, ids = phi3
    fd = copy.deepcopy(base)
    fdlora.load_fd_lora(fd, saved / "two", adapter_name="two")
    fdlora.load_fd_lora(fd, saved / "one", adapter_name="one")
    layers = fdlora.handle(fd).layers
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"} <= set(layers)
    for name in ("one", "two"):
        pm.base_model.set_adapter(name)
        fdlora.set_adapters(fd, [name])
        want, got = _logits(pm, ids), _logits(fd, ids)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), name
        assert (want - _logits(base, ids)).abs().max() > 1e-3  # the adapter has an effect
    spec = ["one", "__base__", "two"]
    want = _logits(pm, ids, adapter_names=spec)
    got = _logits(fd, ids, adapter_names=["one", None, "two"])
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_phi3_live_peft_model_converts_and_matches(phi3):
    _, pm, _, ids = phi3
    live = copy.deepcopy(pm)
    live.base_model.set_adapter("two")
    want = _logits(live, ids)
    fd = fdlora.from_peft(live)
    got = _logits(fd, ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
