# ruff: noqa: E402  (transformers and peft go through importorskip before the imports that need them)
"""fdlora.layers.modules.moe_experts / router / routed at unit level: the factor layout against PEFT's own ΔW, the grouped
call structure (one lora_delta per expert's token group, rows gathered with the tokens), per-row modes against
a float64 oracle, and the refusals.

Model-level equality with PEFT (from_peft, load_fd_lora, blends, rows, generate, save, merge) is in
tests/integrations/transformers/test_moe.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")  # the core-install job runs tests/layers without it
peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model

import fdlora
from fdlora.errors import AdapterShapeError, FdLoraError
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.integrations.transformers import adapter_from_peft
from fdlora.layers.modules import moe_experts as ex
from fdlora.layers.modules.moe_router import FusedLoraRouter

transformers.logging.set_verbosity_error()
H, E = 16, 4


def mixtral():  # experts [E, N, K]
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=H, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=32))


def gpt_oss():  # experts stored transposed, [E, K, N], with biases; a router with a bias
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=64, hidden_size=H, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=32,
        layer_types=["full_attention"]))


ROUTER = {"mixtral": "gate.weight", "gpt-oss": "router.weight"}
BUILD = {"mixtral": mixtral, "gpt-oss": gpt_oss}


def peft_model(arch: str, r: int = 3, modules: tuple[str, ...] = ()):
    torch.manual_seed(0)
    base = BUILD[arch]().eval()
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=r, lora_alpha=5, init_lora_weights=False, target_modules=list(modules),
        target_parameters=["experts.gate_up_proj", "experts.down_proj", ROUTER[arch]]))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape) * 0.3)
    return base, pm.eval()


@pytest.mark.parametrize("arch", ["mixtral", "gpt-oss"])
def test_factors_reproduce_peft_delta(arch):
    """peft_factors + fd-lora's per-expert B_e A_e == PEFT's ParamWrapper.get_delta_weight, in float64, for both
    orientations; and the bank's merged delta (merge_and_unload's) is the same tensor."""
    base, pm = peft_model(arch)
    model = fdlora.from_peft(copy.deepcopy(pm))
    h = fdlora.handle(model)
    wrappers = [m for m in pm.modules() if type(m).__name__ == "ParamWrapper" and m.num_experts > 1]
    assert len(wrappers) == 2
    for w in wrappers:
        experts_module, param = w.get_base_layer(), w.parameter_name
        A3, B3 = ex.peft_factors(experts_module, param, w.lora_A["default"].weight.double(),
                                 w.lora_B["default"].weight.double())
        ours = w.scaling["default"] * torch.einsum("enr,erk->enk", B3, A3)
        if experts_module.is_transposed:
            ours = ours.transpose(1, 2)
        expect = w.double().get_delta_weight("default")
        assert ours.shape == getattr(experts_module, param).shape
        torch.testing.assert_close(ours, expect, rtol=1e-12, atol=1e-12)
        layer = h.layers[f"model.layers.0.mlp.experts.{param}"]
        slot = h.state.slots.slot("default")
        s = torch.zeros(h.state.slots.capacity)
        s[slot] = h.state.table.scaling[layer.index, slot]
        torch.testing.assert_close(ex.delta_weight(layer, s).double(), expect, rtol=1e-5, atol=1e-6)


def test_grouped_calls_carry_each_tokens_adapter(monkeypatch):
    """Per-row adapters through the experts: one lora_delta per (expert, parameter) with the tokens routed to that
    expert, each with its own token's slot weights (gathered with it); no per-token call and no dense ΔW."""
    base, pm = peft_model("mixtral")
    pm2 = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=2, lora_alpha=2, init_lora_weights=False, target_modules=[],
        target_parameters=["experts.gate_up_proj", "experts.down_proj", "gate.weight"]))
    model = fdlora.from_peft(copy.deepcopy(pm))
    fdlora.add_adapter(model, adapter_from_peft(pm2, "default"), "b")
    h = fdlora.handle(model)
    slot = h.state.slots.slot
    bank = h.layers["model.layers.0.mlp.experts.gate_up_proj"].bank
    assert tuple(bank.A.shape[:3]) == (E, 2, 3)  # only what is loaded: 2 slots, the largest rank 3 (no padding)
    calls = []
    real = ex.expert_delta
    monkeypatch.setattr(ex, "expert_delta", lambda *a: (calls.append(a), real(*a))[1])
    rows, T, k = ["default", "b", "__base__"], 5, 2
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (3, T)), adapter_names=rows)
    assert 2 <= len(calls) <= 2 * E  # a call per hit expert and parameter
    assert sum(c[1].shape[0] for c in calls) == 2 * 3 * T * k  # every (token, choice) pair once per parameter
    gw = torch.cat([c[5] for c in calls])  # [pairs, S]: one-hot rows of the pairs' adapters
    for name, n in (("default", T * k * 2), ("b", T * k * 2)):
        assert int((gw[:, slot(name)] == 1).sum()) == n
    assert int((gw.sum(1) == 0).sum()) == T * k * 2  # the base row's pairs: no adapter
    assert all(c[2].dim() == 3 and c[2].shape[:2] == c[3].shape[1:] for c in calls)  # one expert: A [S,R,K], B [N,S,R]


class ToyRouter(nn.Module):
    def __init__(self, linear: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H))
        self.linear = linear

    def forward(self, x):
        logits = nn.functional.linear(x, self.weight) if self.linear else x @ self.weight.t()
        return logits.softmax(-1)


class Toy(nn.Module):
    def __init__(self, linear: bool = True) -> None:
        super().__init__()
        self.gate = ToyRouter(linear)


def _router_adapter(seed: int) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    return LoraAdapter({"gate": ModuleLora(torch.randn(2, H, generator=g), torch.randn(E, 2, generator=g), 3.0)})


def test_router_rows_match_float64_oracle():
    """Per-row adapters on a router (LoRA added to its F.linear inside its own forward) == float64 reference."""
    torch.manual_seed(0)
    model = Toy()
    oracle = copy.deepcopy(model).double()
    ad = {"a": _router_adapter(1), "b": _router_adapter(2)}
    for n, a in ad.items():
        fdlora.add_adapter(model, a, n)
    assert isinstance(model.gate, FusedLoraRouter)
    x = torch.randn(4, H)
    with torch.no_grad(), fdlora.per_row(model, ["a", None, "b", "a"]):
        got = model.gate(x)
    W = oracle.gate.weight
    for i, n in enumerate(["a", None, "b", "a"]):
        w = W if n is None else W + 1.5 * ad[n].modules["gate"].B.double() @ ad[n].modules["gate"].A.double()
        torch.testing.assert_close(got[i].double(), (x[i].double() @ w.t()).softmax(-1), rtol=1e-5, atol=1e-6)


def test_router_without_f_linear_raises_naming_it():
    model = Toy(linear=False)
    fdlora.add_adapter(model, _router_adapter(1), "a")
    with pytest.raises(FdLoraError, match="never calls F.linear on its weight"):
        model.gate(torch.randn(2, H))


def test_wrong_expert_shape_or_expert_parallel_is_refused_before_anything_changes():
    from fdlora.errors import UnsupportedFeatureError

    model = mixtral().eval()
    experts_module = model.model.layers[0].mlp.experts
    q = ModuleLora(torch.randn(2, H), torch.randn(H, 2))
    bad = ModuleLora(torch.randn(E + 1, 2, H), torch.randn(E + 1, 48, 2))  # one expert too many
    with pytest.raises(AdapterShapeError, match=r"takes A \[4, r, 16\]"):
        fdlora.add_adapter(model, LoraAdapter({"model.layers.0.mlp.experts.gate_up_proj": bad}), "x")
    assert model.model.layers[0].mlp.experts is experts_module
    fdlora.add_adapter(model, LoraAdapter({"model.layers.0.self_attn.q_proj": q}), "q")
    experts_module._is_expert_parallel = True
    good = ModuleLora(torch.randn(E, 2, H), torch.randn(E, 48, 2))
    with pytest.raises(UnsupportedFeatureError, match="expert-parallel"):
        fdlora.add_adapter(model, LoraAdapter({"model.layers.0.self_attn.o_proj": q,
                                               "model.layers.0.mlp.experts.gate_up_proj": good}), "y")
    assert model.model.layers[0].mlp.experts is experts_module
    assert list(fdlora.handle(model).layers) == ["model.layers.0.self_attn.q_proj"]  # o_proj was not wrapped


def test_restore_puts_the_experts_module_back():
    base, pm = peft_model("mixtral")
    model = fdlora.from_peft(copy.deepcopy(pm))
    wrapped = model.model.layers[0].mlp.experts
    assert isinstance(wrapped, ex.FusedLoraExperts) and set(wrapped.loras) == {"gate_up_proj", "down_proj"}
    original = wrapped.base
    fdlora.restore(model)
    assert model.model.layers[0].mlp.experts is original
    x = torch.randint(0, 64, (2, 4))
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, base(input_ids=x).logits)


def test_training_refuses_parameter_lora_before_changing_anything():
    """fd-lora trains module LoRA only: LoRA on routers / experts (PEFT's ParamWrapper) raises, model untouched."""
    from fdlora.errors import UnsupportedFeatureError

    model = mixtral().eval()
    experts_module = model.model.layers[0].mlp.experts
    with pytest.raises(UnsupportedFeatureError, match="does not train"):
        fdlora.add_trainable_adapter(model, "t", LoraConfig(r=2, target_modules="all-linear"))
    assert model.model.layers[0].mlp.experts is experts_module
    _, pm = peft_model("mixtral")
    with pytest.raises(UnsupportedFeatureError, match="cannot be kept trainable"):
        fdlora.from_peft(pm, trainable=True)
    assert any(type(m).__name__ == "ParamWrapper" for m in pm.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["mixtral", "gpt-oss"])
def test_cuda_matches_peft(arch):
    """On CUDA (routers on the selected kernel backend, experts on the torch reference, attention on the fused
    Linear kernels): the adapter and per-row [adapter, base] equal PEFT on the GPU."""
    base, pm = peft_model(arch, modules=("q_proj",))
    pm = pm.cuda()
    base = base.cuda()
    x = torch.randint(0, 64, (2, 6), device="cuda")
    with torch.no_grad():
        want = pm(input_ids=x).logits
        plain = base(input_ids=x).logits
        model = fdlora.from_peft(pm)
        got = model(input_ids=x).logits
        rows = model(input_ids=x, adapter_names=["default", "__base__"]).logits
    assert not torch.allclose(want, plain, atol=1e-2)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(rows, torch.stack([want[0], plain[1]]), rtol=1e-3, atol=1e-3)
