"""DoRA adapters on Transformers models (PEFT use_dora): from a live PeftModel and from a saved adapter folder, equal
to PEFT per adapter and in a blend (PEFT's blend rule; fdlora.layers.modules.dora)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")

import fdlora  # noqa: E402


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval()


def _peft_dora(base):
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                        use_dora=True, init_lora_weights=False))
    pm.add_adapter("second", LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True,
                                        init_lora_weights=False))
    with torch.no_grad():  # magnitudes away from the weight norm, so DoRA's rescaling shows
        for name, p in pm.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1.0 + 0.3 * torch.rand_like(p))
    return pm.eval()


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits


def test_from_peft_and_saved_folder_equal_peft(tmp_path):
    base = _llama()
    pm = _peft_dora(base)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    want = {}
    for name in ("default", "second"):
        pm.set_adapter(name)
        want[name] = _logits(pm, ids)
    pm.save_pretrained(tmp_path)
    assert (want["default"] - _logits(base, ids)).abs().max() > 1e-3  # the adapters do something

    live = fdlora.from_peft(copy.deepcopy(pm))
    loaded = fdlora.load_fd_lora(copy.deepcopy(base), str(tmp_path), adapter_name="default")
    for name in ("default", "second"):
        fdlora.set_adapters(live, [name], [1.0])
        got = _logits(live, ids)
        assert (got - want[name]).abs().max() <= 1e-5 * want[name].abs().max(), name
    fdlora.set_adapters(loaded, ["default"], [1.0])
    got = _logits(loaded, ids)
    assert (got - want["default"]).abs().max() <= 1e-5 * want["default"].abs().max()


@pytest.fixture
def merge_cache():
    fdlora.set_merge_cache(1 << 28)  # off on CPU by default
    yield
    fdlora.set_merge_cache("auto")


def test_blends_on_the_merged_weight_cache_equal_the_eager_path_and_peft(merge_cache):
    """With room in the merged-weight cache a DoRA blend runs one GEMM on W' = W + delta_weight
    (fdlora.layers.modules.dora.merged_weight), merged again when the blend moves: the logits of the eager per-call path, and
    PEFT's for a single adapter."""
    base = _llama()
    pm = _peft_dora(base)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    pm.set_adapter("default")
    peft_default = _logits(pm, ids)
    model = fdlora.from_peft(copy.deepcopy(pm))
    for names, w in ((["default"], [1.0]), (["default", "second"], [0.7, 0.5]), (["second", "default"], [1.2, 0.3]),
                     (["default"], [1.0])):
        fdlora.set_adapters(model, names, w)
        got = _logits(model, ids)
        assert fdlora.merge_cache_bytes("cpu") > 0, "the DoRA layers took no merged copy"
        fdlora.set_merge_cache(0)
        eager = _logits(model, ids)
        fdlora.set_merge_cache(1 << 28)
        assert (got - eager).abs().max() <= 1e-5 * eager.abs().max(), (names, w)
        if names == ["default"]:
            assert (got - peft_default).abs().max() <= 1e-5 * peft_default.abs().max()
    again = _logits(model, ids)  # the key holds: the kept W' serves the call unchanged
    assert torch.equal(again, got)
