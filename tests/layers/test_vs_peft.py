"""Fused layers vs PEFT's LoraLayer on identical weights, against a float64 oracle.

One tiny model holds every layer kind fd-lora wraps (Linear, transformers Conv1D, Conv2d with a
kohya-LoCon-shaped LoRA); three PEFT adapters cover plain, rsLoRA + rank/alpha patterns, and
lora_bias. Every scenario runs in fp32, fp16 and bf16 on CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers.pytorch_utils import Conv1D

import fdlora
from fdlora.integrations.transformers import adapter_from_peft
from fdlora.testing import EPS

TARGETS = ["q", "c1", "conv", "out"]
CONFIGS = {
    "plain": LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False),
    "rs_pattern": LoraConfig(r=8, lora_alpha=5, use_rslora=True, target_modules=["q", "conv", "out"],
                             rank_pattern={"out": 2}, alpha_pattern={"q": 3.0}, init_lora_weights=False),
    "with_bias": LoraConfig(r=16, lora_alpha=16, target_modules=["q", "c1"], lora_bias=True, init_lora_weights=False),
}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(12, 20)
        self.c1 = Conv1D(20, 12)  # GPT-2 style: weight [in, out]
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.out = nn.Linear(20, 7)

    def forward(self, x, img):
        return self.out(torch.relu(self.q(x)) + self.c1(x)), self.conv(img)


def build(dtype):
    torch.manual_seed(0)
    base = Tiny()
    nn.init.normal_(base.c1.weight, std=0.3)
    peft_model = get_peft_model(copy.deepcopy(base), CONFIGS["plain"], adapter_name="plain")
    for name in ("rs_pattern", "with_bias"):
        peft_model.add_adapter(name, CONFIGS[name])
    with torch.no_grad():
        for n, p in peft_model.named_parameters():  # make every weight exact in `dtype`
            if "lora_B" in n:
                p.normal_(std=0.5)
            p.copy_(p.to(dtype).float())
        for n, p in base.named_parameters():
            p.copy_(peft_model.get_submodule("base_model.model").get_parameter(n))
    peft_model.eval()
    fused = copy.deepcopy(base).to(dtype)
    for name in CONFIGS:
        fdlora.add_adapter(fused, adapter_from_peft(peft_model, name), name, max_slots=4)
    return peft_model, fused


def peft_set(peft_model, weights: dict[str, float]):
    for m in peft_model.modules():
        if isinstance(m, LoraLayer):
            m.set_adapter([n for n in weights if n in m.lora_A])
            for n, w in weights.items():
                if n in m.lora_A:
                    m.set_scale(n, w)


SCENARIOS = ["single-plain", "single-rs_pattern", "single-with_bias", "blend-weights", "per-sample", "disabled"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fused_matches_peft(scenario, dtype):
    peft_model, fused = build(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 12, generator=gen).to(dtype)
    img = torch.randn(3, 3, 9, 9, generator=gen).to(dtype)
    oracle_model = copy.deepcopy(peft_model).double()

    def run_all(set_fn, call_kwargs=None, scope=None):
        set_fn(peft_model)
        set_fn(oracle_model)
        kw = call_kwargs or {}
        with torch.no_grad():
            p_out = peft_model.to(dtype)(x, img, **kw)
            o_out = oracle_model(x.double(), img.double(), **kw)
            with scope if scope is not None else torch.no_grad():
                f_out = fused(x, img)
        return p_out, o_out, f_out

    if scenario.startswith("single-"):
        name = scenario.removeprefix("single-")
        fdlora.set_adapters(fused, name)
        outs = run_all(lambda m: peft_set(m, {name: 1.0}))
    elif scenario == "blend-weights":
        w = {"plain": 0.7, "rs_pattern": -0.4, "with_bias": 1.3}
        fdlora.set_adapters(fused, list(w), list(w.values()))
        outs = run_all(lambda m: peft_set(m, w))
    elif scenario == "per-sample":
        names = ["plain", "__base__", "with_bias"]
        outs = run_all(lambda m: peft_set(m, dict.fromkeys(CONFIGS, 1.0)), {"adapter_names": names},
                       fdlora.per_sample(fused, ["plain", None, "with_bias"]))
    else:  # disabled
        fdlora.set_adapters(fused, ["plain", "with_bias"])
        fdlora.disable(fused)

        def off(m):
            peft_set(m, {"plain": 1.0, "with_bias": 1.0})
            for layer in m.modules():
                if isinstance(layer, LoraLayer):
                    layer.enable_adapters(False)

        outs = run_all(off)
    for p_out, o_out, f_out in zip(*outs):
        assert f_out.dtype == dtype and not torch.isnan(f_out).any()
        peft_err = float((p_out.double() - o_out).abs().max())
        ours = float((f_out.double() - o_out).abs().max())
        floor = 4 * EPS[dtype] * float(o_out.abs().max())
        assert ours <= 2 * peft_err + floor, f"fd-lora err {ours:.3g} vs PEFT err {peft_err:.3g}"
    if scenario == "disabled":  # bit-identical to the base model with fd-lora removed
        fdlora.restore(fused)
        with torch.no_grad():
            base_out = fused(x, img)
        assert all(torch.equal(u, v) for u, v in zip(base_out, outs[2]))
