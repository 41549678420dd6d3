"""LoRA over a torchao-quantized Transformers model (int8 / float8 weight-only, `quantize_` on CPU): the same
PEFT adapter through fd-lora (`load_fd_lora`, `from_peft` of PEFT's TorchaoLoraLinear layers) equals PEFT on the same
quantized base, per-row adapters equal PEFT's adapter_names, no layer keeps a merged (dequantized) copy with the
merged-weight cache on, and merging into the quantized weights is refused. (torchao weights sit inside a plain
nn.Linear and report a float dtype: fdlora.layers.quant.quantized tells them apart.)
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

import fdlora
from fdlora import errors
from fdlora.layers.modules.fused import FusedLoraLinear
from fdlora.layers.quant import quantized
from integrations.transformers.models import ids, randomize_lora

pytest.importorskip("torchao", reason="torchao not installed (pip install 'fd-lora[quant]')")
warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def llama_dirs():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = transformers.LlamaForCausalLM(cfg).eval()
    d = tempfile.mkdtemp()
    base.save_pretrained(d + "/base")
    for i, name in enumerate(("one", "two")):
        torch.manual_seed(i + 1)
        pm = get_peft_model(transformers.LlamaForCausalLM.from_pretrained(d + "/base"),
                            LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
                            adapter_name=name)
        randomize_lora(pm)
        pm.save_pretrained(d)
    return d + "/base", d + "/one", d + "/two"


def load(base_dir: str, how: str):
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    m = transformers.LlamaForCausalLM.from_pretrained(base_dir).eval()
    quantize_(m, {"int8": Int8WeightOnlyConfig, "float8": Float8WeightOnlyConfig}[how]())
    return m


@pytest.fixture
def merge_cache_on():
    fdlora.set_merge_cache(1 << 30)
    yield
    fdlora.set_merge_cache("auto")


@pytest.mark.parametrize("how", ["int8", "float8"])
def test_torchao_llama_equals_peft(how, llama_dirs, merge_cache_on):
    base_dir, one, two = llama_dirs
    peft_model = PeftModel.from_pretrained(load(base_dir, how), one, adapter_name="one").eval()
    peft_model.load_adapter(two, adapter_name="two")
    model = fdlora.load_fd_lora(load(base_dir, how), one, "one")
    fdlora.load_fd_lora(model, two, "two")
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(layer, FusedLoraLinear) and quantized.kind(layer.base).startswith("torchao ")
    x = ids(4)
    scale = 1e-5
    for name in ("one", "two"):
        peft_model.set_adapter(name)
        fdlora.set_adapters(model, [name])
        with torch.no_grad():
            ours, theirs = model(x).logits, peft_model(x).logits
        assert float((ours - theirs).abs().max()) <= scale * float(theirs.abs().max()), name
    rows = ["one", "two", None, "one"]
    with torch.no_grad():
        ours = model(x, adapter_names=rows).logits
        theirs = peft_model(x, adapter_names=["one", "two", "__base__", "one"]).logits
    assert float((ours - theirs).abs().max()) <= scale * float(theirs.abs().max())
    fused = [m for m in model.modules() if isinstance(m, FusedLoraLinear)]
    assert fused and all(not m._plain and m.merged.buf is None for m in fused)
    assert fdlora.merge_cache_bytes() == 0
    with pytest.raises(errors.UnsupportedFeatureError, match="torchao"):
        fdlora.merge_and_unload(model, copy=True)
    converted = fdlora.from_peft(peft_model)  # PEFT's TorchaoLoraLinear -> fused layers on the same torchao base
    fdlora.set_adapters(converted, ["two"])
    peft_ref = PeftModel.from_pretrained(load(base_dir, how), two, adapter_name="two").eval()
    with torch.no_grad():
        again, theirs = converted(x).logits, peft_ref(x).logits
    assert float((again - theirs).abs().max()) <= scale * float(theirs.abs().max())
    assert fdlora.merge_cache_bytes() == 0
