"""LoRA on quantized bases through the opaque-base path: base(x) + fused delta, no dequantising.

bitsandbytes 4-bit (nf4) and 8-bit models are built with Transformers' own quantization on CPU
(bitsandbytes >= 0.46 runs there) and compared with PEFT's bnb LoRA layers on the same base; a
stand-in int8 Linear-like module covers the path where bitsandbytes is not installed.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

import fdlora
from fdlora import errors
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.layers.modules.fused import FusedLoraLinear
from integrations.transformers.models import ids, randomize_lora


@pytest.fixture(scope="module")
def llama_dirs():
    """(base dir, PEFT adapter dir) of a small Llama wide enough for bitsandbytes' CPU 4-bit kernels
    (every in_features a multiple of their block size, 64)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = transformers.LlamaForCausalLM(cfg).eval()
    d = tempfile.mkdtemp()
    base.save_pretrained(d + "/base")
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights=False), adapter_name="two")
    randomize_lora(peft_model)
    peft_model.save_pretrained(d)
    return d + "/base", d + "/two"


QUANT = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32),
    "int8": dict(load_in_8bit=True),
}


@pytest.mark.parametrize("kind", list(QUANT))
def test_bitsandbytes_base_matches_peft(kind, llama_dirs):
    bnb = pytest.importorskip("bitsandbytes")
    q = transformers.BitsAndBytesConfig(**QUANT[kind])
    base_dir, adapter = llama_dirs

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=q, device_map="cpu")

    peft_model = PeftModel.from_pretrained(load(), adapter).eval()
    model = fdlora.load_fd_lora(load(), adapter, "two")
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(layer, FusedLoraLinear)
    assert isinstance(layer.base, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
    assert not layer.base.weight.is_floating_point()  # still quantized: nothing was dequantised
    x = ids(2)
    with torch.no_grad():
        ours, theirs = model(x).logits, peft_model(x).logits
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))
    with pytest.raises(errors.UnsupportedFeatureError, match="quantized"):
        fdlora.merge_and_unload(model)
    converted = fdlora.from_peft(peft_model)  # PEFT's bnb LoRA layers -> fused layers on the same bnb base
    assert isinstance(converted.get_submodule("model.layers.0.self_attn.q_proj").base, type(layer.base))
    with torch.no_grad():
        again = converted(x).logits
    assert torch.allclose(again, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))


class Int8Linear(nn.Module):
    """A stand-in quantized linear: int8 weight + per-row scale, in_features / out_features like bnb's."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        scale = w.abs().amax(1, keepdim=True) / 127
        self.register_buffer("weight", torch.round(w / scale).to(torch.int8))
        self.register_buffer("scale", scale)
        self.compute_dtype = torch.float32

    def forward(self, x):
        return x @ (self.weight.float() * self.scale).t()


def test_opaque_linear_like_base():
    torch.manual_seed(0)
    net = nn.Sequential(Int8Linear(nn.Linear(16, 24)), nn.ReLU(), Int8Linear(nn.Linear(24, 8)))
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    A, B = torch.randn(4, 16, generator=g), torch.randn(24, 4, generator=g)
    model = fdlora.load_fd_lora(net, LoraAdapter({"0": ModuleLora(A, B, alpha=8.0)}), "q")
    x = torch.randn(5, 16, generator=g)
    with torch.no_grad():
        expect = ref[2](torch.relu(ref[0](x) + (x @ A.t() @ B.t()) * 2.0))
        got = model(x)
    assert torch.allclose(got, expect, rtol=1e-5, atol=1e-5)
    assert model.get_submodule("0").base.weight.dtype == torch.int8
