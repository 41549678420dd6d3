"""MoE adapters (LoRA on routers and fused expert parameters, PEFT's lora.ParamWrapper) served by fd-lora == PEFT.

A PEFT-oracle check through the public API only, independent of how fd-lora's expert layers are built
(written by a second helper; the unit-level tests are tests/layers/test_experts.py).

Tiny transformers-5 MoE models built from configs, two adapters with random non-zero A and B
(init_lora_weights=False) and different r / alpha / rsLoRA, on "all-linear" (PEFT wraps the router
`weight` and the stacked `gate_up_proj` / `down_proj` itself) and on explicit `target_parameters`.
Every reference is PEFT's own output on the same weights, computed before fd-lora takes the model:

  - each adapter alone, after `fdlora.from_peft` and after `fdlora.load_fd_lora` of the saved folder;
  - a blend 0.7 one + 0.4 two: PEFT with both adapters active and each layer's scaling multiplied by its
    weight (ParamWrapper then adds the sum of both deltas to the stacked parameters);
  - mixed `adapter_names` rows: row i equals PEFT's output for row i with adapter i alone active (PEFT
    itself refuses mixed batches on ParamWrapper);
  - greedy `generate` with mixed rows: each row's tokens equal PEFT's generate of that row alone.

The router carries LoRA too, so an adapter changes which experts a token visits: a wrong per-row
gather shows up as a different routing, not as a rounding error. Switch-Transformers keeps its experts
as nn.Linear modules inside a ModuleDict and gathers each expert's tokens before calling them: its
per-row case checks that row adapters follow the tokens there as well.
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

import fdlora

transformers.logging.set_verbosity_error()
VOCAB = 96
ROWS = ["one", "two", "__base__"]
BLEND = {"one": 0.7, "two": 0.4}
ATOL, RTOL = 3e-5, 1e-4  # fp32: fd-lora adds x A^T B^T, PEFT multiplies by W + B A (grouped_mm): rounding only


def _dense(**kw) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=64, pad_token_id=0, **kw)


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **_dense()))


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        head_dim=8, **_dense()))


def olmoe():
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        intermediate_size=48, num_experts=4, num_experts_per_tok=2, **_dense()))


def deepseek_v3():
    kw = _dense()
    kw["num_key_value_heads"] = 4  # MLA: one kv head per query head
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **kw))


def deepseek_v2():
    kw = _dense()
    kw["num_key_value_heads"] = 4
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, topk_method="group_limited_greedy", n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **kw))


def gpt_oss():
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
        layer_types=["sliding_attention", "full_attention"], **_dense()))


MODELS = {"mixtral": mixtral, "qwen3-moe": qwen3_moe, "olmoe": olmoe, "deepseek-v2": deepseek_v2,
          "deepseek-v3": deepseek_v3, "gpt-oss": gpt_oss}
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
TARGETS = {  # "all-linear": PEFT adds target_parameters for the router and the experts by itself
    "all-linear": dict(target_modules="all-linear"),
    "params": dict(target_modules=["o_proj"], target_parameters=EXPERTS + ["gate.weight"]),
    "params-router": dict(target_modules=["o_proj"], target_parameters=EXPERTS + ["router.weight"]),
}
CASES = [
    pytest.param("mixtral", "all-linear", id="mixtral-all-linear"),
    pytest.param("qwen3-moe", "params", id="qwen3-moe-target_parameters"),
    pytest.param("olmoe", "params", id="olmoe-target_parameters"),
    pytest.param("deepseek-v2", "all-linear", id="deepseek-v2-all-linear"),
    pytest.param("deepseek-v3", "all-linear", id="deepseek-v3-all-linear"),
    pytest.param("gpt-oss", "params-router", id="gpt-oss-target_parameters"),
]
GENERATE = [CASES[0]]  # mixtral only, for the CI budget (deepseek-v3 passes too, at ~3 s CPU more)


def _ids(batch: int, seq: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _peft(build, **kw):
    """(base copy, PEFT model with adapters one and two): random non-zero A and B, different r / alpha / rsLoRA."""
    torch.manual_seed(0)
    base = build().eval()
    pristine = copy.deepcopy(base)
    torch.manual_seed(1)
    pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kw), adapter_name="one")
    torch.manual_seed(2)
    pm.add_adapter("two", LoraConfig(r=2, lora_alpha=3, use_rslora=True, init_lora_weights=False, **kw))
    return pristine, pm.eval()


def _blend_scalings(pm, power: int) -> None:
    """Multiply (power 1) or divide back (power -1) every PEFT layer's scaling by its adapter's BLEND weight."""
    from peft.tuners.lora import LoraLayer

    for layer in pm.modules():
        if isinstance(layer, LoraLayer):
            for n, w in BLEND.items():
                if n in layer.scaling:
                    layer.scaling[n] *= w ** power


@functools.cache
def _case(model_id: str, target: str) -> dict:
    """PEFT's outputs for a case (references), its saved folder, and the PEFT model the tests convert copies of."""
    pristine, pm = _peft(MODELS[model_id], **TARGETS[target])
    assert any(type(m).__name__ == "ParamWrapper" for m in pm.modules()), f"{model_id}/{target}: no ParamWrapper"
    x = _ids(len(ROWS))
    out = {}
    with torch.no_grad():
        for name in ("one", "two"):
            pm.set_adapter(name)
            out[name] = pm(input_ids=x).logits
        with pm.disable_adapter():
            out["__base__"] = pm(input_ids=x).logits
        pm.base_model.set_adapter(list(BLEND))  # PEFT sums both deltas into the stacked parameters
        _blend_scalings(pm, 1)
        out["blend"] = pm(input_ids=x).logits
        _blend_scalings(pm, -1)
    pm.set_adapter("one")
    folder = tempfile.mkdtemp(prefix=f"fdlora-moe-{model_id}-")
    pm.save_pretrained(folder)  # PEFT writes folder/one and folder/two
    return dict(x=x, out=out, pristine=pristine, folder=folder, peft=pm)


def _close(got, want, what: str) -> None:
    assert torch.isfinite(got).all(), what
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _rows_reference(out: dict) -> torch.Tensor:
    return torch.stack([out[name][i] for i, name in enumerate(ROWS)])


def _check(model, ref: dict) -> None:
    out, x = ref["out"], ref["x"]
    for other in ("two", "__base__"):  # the adapters matter, so every comparison below can fail
        assert not torch.allclose(out["one"], out[other], atol=1e-2)
    with torch.no_grad():
        for name in ("one", "two"):
            fdlora.set_adapters(model, name)
            _close(model(input_ids=x).logits, out[name], f"adapter {name}")
        fdlora.set_adapters(model, list(BLEND), list(BLEND.values()))
        _close(model(input_ids=x).logits, out["blend"], f"blend {BLEND}")
        fdlora.set_adapters(model, "one")
        _close(model(input_ids=x, adapter_names=ROWS).logits, _rows_reference(out), f"rows {ROWS}")


@pytest.mark.parametrize("model_id,target", CASES)
def test_from_peft_equals_peft(model_id, target):
    ref = _case(model_id, target)
    model = fdlora.from_peft(copy.deepcopy(ref["peft"]))
    assert not any(type(m).__name__ == "ParamWrapper" for m in model.modules())
    _check(model, ref)


@pytest.mark.parametrize("model_id,target", CASES)
def test_load_saved_adapter_equals_peft(model_id, target):
    ref = _case(model_id, target)
    model = fdlora.load_fd_lora(copy.deepcopy(ref["pristine"]), os.path.join(ref["folder"], "one"),
                               adapter_name="one")
    fdlora.load_fd_lora(model, os.path.join(ref["folder"], "two"), adapter_name="two")
    _check(model, ref)


@pytest.mark.parametrize("model_id,target", GENERATE)
def test_generate_mixed_rows_equals_peft_row_by_row(model_id, target):
    ref = _case(model_id, target)
    pm = copy.deepcopy(ref["peft"])
    prompts, kw = _ids(len(ROWS), 5, seed=7), dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = []
    with torch.no_grad():
        for i, name in enumerate(ROWS):
            if name == "__base__":
                with pm.disable_adapter():
                    want.append(pm.generate(input_ids=prompts[i:i + 1], **kw))
            else:
                pm.set_adapter(name)
                want.append(pm.generate(input_ids=prompts[i:i + 1], **kw))
        model = fdlora.from_peft(pm)
        mixed = model.generate(input_ids=prompts, adapter_names=ROWS, **kw)
    for i, w in enumerate(want):
        assert torch.equal(mixed[i:i + 1, :w.shape[1]], w), f"row {i} ({ROWS[i]})"


def test_per_row_blends_partial_adapter_delete_and_unload():
    """fd_lora_adapters blends per row, a third adapter on one expert parameter only, delete_adapter, and unload
    giving back the very modules (and the bit-exact base output) it replaced; PEFT is the oracle throughout."""
    ref = _case("mixtral", "all-linear")
    out, x = ref["out"], ref["x"]
    pm = copy.deepcopy(ref["peft"])
    pm.base_model.set_adapter(list(BLEND))
    _blend_scalings(pm, 1)
    torch.manual_seed(0)
    base = mixtral().eval()
    torch.manual_seed(5)
    three = get_peft_model(copy.deepcopy(base), LoraConfig(r=3, lora_alpha=5, init_lora_weights=False,
                                                           target_modules=[], target_parameters=EXPERTS[1:]),
                           adapter_name="three").eval()
    folder = tempfile.mkdtemp(prefix="fdlora-moe-three-")
    three.save_pretrained(folder)
    with torch.no_grad():
        want_blend, want_three = pm(input_ids=x).logits, three(input_ids=x).logits
    live = copy.deepcopy(ref["peft"])
    originals = {n.removeprefix("base_model.model."): m.get_base_layer() for n, m in live.named_modules()
                 if n.endswith(("mlp.experts", "mlp.gate"))}  # the modules PEFT wrapped: unload gives them back
    model = fdlora.from_peft(live)
    fdlora.load_fd_lora(model, os.path.join(folder, "three"), adapter_name="three")
    with torch.no_grad():
        got = model(input_ids=x, fd_lora_adapters=[BLEND, "three", None]).logits
        _close(got, torch.stack([want_blend[0], want_three[1], out["__base__"][2]]), "per-row blend / three / base")
        model.delete_adapter("one")
        got = model(input_ids=x, adapter_names=["two", "three", "__base__"]).logits
        _close(got, torch.stack([out["two"][0], want_three[1], out["__base__"][2]]), "after delete_adapter(one)")
        plain = model.unload()
        assert all(plain.get_submodule(n) is m for n, m in originals.items())
        assert not any("Fused" in type(m).__name__ for m in plain.modules())
        assert torch.equal(plain(input_ids=x).logits, ref["pristine"](input_ids=x).logits)


@pytest.mark.parametrize("model_id,target", [CASES[0], CASES[5]])
def test_save_peft_and_merge_equal_peft(model_id, target):
    """save_peft writes PEFT's ParamWrapper layout that PEFT itself loads back (with the adapter's own LoraConfig,
    and with one written from the banks for an adapter that came without a config); merge_and_unload (a copy, then
    in place) bakes the expert and router deltas into the original modules."""
    from peft import PeftModel

    from fdlora.integrations.transformers import adapter_from_peft, enable

    ref = _case(model_id, target)
    out, x = ref["out"], ref["x"]
    model = fdlora.from_peft(copy.deepcopy(ref["peft"]))
    bare = copy.deepcopy(ref["pristine"])
    fdlora.add_adapter(bare, adapter_from_peft(ref["peft"], "one"), "one")
    enable(bare)
    classes = {n: type(m) for n, m in ref["pristine"].named_modules()}
    with torch.no_grad():
        for what, served in (("own LoraConfig", model), ("config from the banks", bare)):
            folder = tempfile.mkdtemp(prefix="fdlora-moe-save-")
            fdlora.save_peft(served, folder, "one")
            back = PeftModel.from_pretrained(copy.deepcopy(ref["pristine"]), folder).eval()
            _close(back(input_ids=x).logits, out["one"], f"PEFT loading save_peft ({what})")
        fdlora.set_adapters(model, "one")
        merged = fdlora.merge_and_unload(model, copy=True)
        _close(merged(input_ids=x).logits, out["one"], "merge_and_unload(copy=True)")
        _close(model(input_ids=x).logits, out["one"], "the model after merging a copy")
        merged = fdlora.merge_and_unload(model)
        _close(merged(input_ids=x).logits, out["one"], "merge_and_unload in place")
    assert {n: type(m) for n, m in merged.named_modules()} == classes


def switch():
    return transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=4, encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=64, router_jitter_noise=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def test_switch_transformers_rows_follow_routed_tokens():
    """Switch experts are nn.Linear modules called on each expert's gathered tokens: rows must follow the tokens."""
    _, pm = _peft(switch, target_modules="all-linear")
    assert any(".experts.expert_" in n and hasattr(m, "lora_A") for n, m in pm.named_modules())
    kw = dict(input_ids=_ids(len(ROWS)), decoder_input_ids=_ids(len(ROWS), 4, seed=2))
    out = {}
    with torch.no_grad():
        for name in ("one", "two"):
            pm.set_adapter(name)
            out[name] = pm(**kw).logits
        with pm.disable_adapter():
            out["__base__"] = pm(**kw).logits
        for other in ("two", "__base__"):
            assert not torch.allclose(out["one"], out[other], atol=1e-2)
        model = fdlora.from_peft(pm)
        for name in ("one", "two"):
            fdlora.set_adapters(model, name)
            _close(model(**kw).logits, out[name], f"adapter {name}")
        _close(model(**kw, adapter_names=ROWS).logits, _rows_reference(out), f"rows {ROWS}")
