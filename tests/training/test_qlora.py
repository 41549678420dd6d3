"""QLoRA: a frozen bitsandbytes nf4 / fp4 / int8 base (manual swap or Transformers' from_pretrained), the adapter
trains through it: gradients equal PEFT's QLoRA layers on the same quantized base, the loss drops, and nothing
quantized reaches the optimizer."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import fdlora
from fdlora.fixtures import tiny_tasks as tiny
from fdlora.training import schema, trainer
from fdlora.training.quant import QuantSpec, hf_quantization_config, quantize_manual, quantized_modules

from .helpers import count_nodes, peft_lora_modules, rel

bnb = pytest.importorskip("bitsandbytes")
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1", "fc2"])


def _quantized(method: str, qtype: str, tmp_path):
    spec = QuantSpec(qtype, "float32", True, ["classifier"])
    if method == "manual":
        model = tiny.build("tiny-vit")
        assert quantize_manual(model, spec)
        return model
    import transformers

    d = tmp_path / "base"
    if not d.exists():
        tiny.build("tiny-vit").save_pretrained(d)
    return transformers.ViTForImageClassification.from_pretrained(d, quantization_config=hf_quantization_config(spec),
                                                                  device_map="cpu")


CASES = [("manual", "nf4"), ("manual", "fp4"), ("hf", "nf4"), ("hf", "fp4"), ("manual", "int8")]


@pytest.mark.parametrize("method,qtype", CASES, ids=[f"{m}-{q}" for m, q in CASES])
def test_grads_equal_peft_qlora(method, qtype, tmp_path):
    pm = get_peft_model(_quantized(method, qtype, tmp_path), LoraConfig(**LORA))
    fm = fdlora.add_trainable_adapter(_quantized(method, qtype, tmp_path), "default", LoraConfig(**LORA))
    assert "vit.layers.0.attention.q_proj.base" in quantized_modules(fm)  # the wrapped base stays quantized
    assert "classifier" not in quantized_modules(fm)  # skip_modules honoured
    ours, theirs = fdlora.lora_parameters(fm, "default"), peft_lora_modules(pm)
    assert sorted(ours) == sorted(theirs)
    with torch.no_grad():
        for path, (A, B) in ours.items():
            theirs[path].lora_B["default"].weight.normal_(0, 0.1)
            A.copy_(theirs[path].lora_A["default"].weight)
            B.copy_(theirs[path].lora_B["default"].weight)
    batch = tiny.synthetic_batch("image-classification", fm, 4, 0)
    nodes = []
    for m in (pm, fm):
        loss = tiny.loss_of("image-classification", m, batch)
        nodes.append(count_nodes(loss, "MatMul4BitBackward"))
        loss.backward()
    # a 4-bit base under a trainable layer runs inside fd-lora's op: no backward node of its own (the untargeted
    # ones keep theirs); int8 bases run their own backward
    assert nodes[1] < nodes[0] if qtype != "int8" else nodes[1] == nodes[0], nodes
    for path, (A, B) in ours.items():
        assert rel(A.grad, theirs[path].lora_A["default"].weight.grad) < 1e-5, path
        assert rel(B.grad, theirs[path].lora_B["default"].weight.grad) < 1e-5, path
    params = fdlora.trainable_parameters(fm)
    assert all(p.is_floating_point() and p.dtype == torch.float32 for p in params)
    assert {id(p) for p in params} == {id(p) for ab in ours.values() for p in ab}


@pytest.mark.parametrize("method", ["manual", "hf"])
def test_qlora_trains(method, tmp_path):
    cfg = schema.validate({
        "model": {"name": "tiny-vit"},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "fc1", "fc2"],
                 "modules_to_save": ["classifier"]},
        "quantization": {"enabled": True, "method": method, "type": "nf4", "skip_modules": ["classifier"]},
        "train": {"steps": 10, "batch_size": 8, "lr": 5e-3},
        "output": str(tmp_path / "out"),
    })
    r = trainer.train(cfg, progress=False)
    assert sum(r.losses[-3:]) < 0.7 * sum(r.losses[:3])
    quant = [m for m in r.model.modules() if type(m).__name__ == "Linear4bit"]
    assert len(quant) >= 8 and all(not m.weight.requires_grad for m in quant)


# (id, quant type, double quant, compute dtype, input dtype)
FROZEN_CASES = [("nf4-dq-bf16", "nf4", True, torch.bfloat16, torch.bfloat16),
                ("nf4-dq-fp32", "nf4", True, torch.float32, torch.float32),
                ("fp4-fp32", "fp4", False, torch.float32, torch.float32),
                ("nf4-fp32-in-bf16", "nf4", False, torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("case", FROZEN_CASES, ids=[c[0] for c in FROZEN_CASES])
def test_frozen_4bit_equals_the_module(case):
    """fdlora.layers.trainable.frozen_4bit runs a frozen Linear4bit without its Python layers: the module's own output, bit for
    bit, and W as its MatMul4Bit backward rebuilds it (dequantized, then cast to gy's dtype), bit for bit; with a
    forward hook on the module it runs the module itself."""
    from fdlora.layers.trainable.frozen_4bit import frozen_4bit

    _, qtype, dq, compute, dtype = case

    def layer():
        torch.manual_seed(0)
        lin = torch.nn.Linear(128, 96)
        q = bnb.nn.Linear4bit(128, 96, compute_dtype=compute, compress_statistics=dq, quant_type=qtype)
        q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type=qtype, compress_statistics=dq)
        q.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
        return q.to("cpu").train()

    x = torch.randn(3, 7, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    mine, theirs = layer(), layer()
    run = frozen_4bit(mine)
    with torch.no_grad():
        y, saved = run.forward(x)
        want = theirs(x)
    assert saved is not None and y.dtype == want.dtype and torch.equal(y, want)
    w = theirs.weight
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(run.weight(saved, dt), bnb.functional.dequantize_4bit(w, w.quant_state).to(dt))
    calls = []
    mine.register_forward_hook(lambda m, a, o: calls.append(1))
    with torch.no_grad():
        y, saved = run.forward(x)
    assert calls and saved is None and torch.equal(y, want)


def test_frozen_4bit_keeps_its_block_scales_while_the_quant_state_holds():
    """The double-quantized block scales are dequantized once and kept (the base is frozen), and made again once the
    quant state's scales change in place: the output then follows the module's own."""
    from fdlora.layers.trainable.frozen_4bit import frozen_4bit

    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 96)
    q = bnb.nn.Linear4bit(128, 96, compute_dtype=torch.float32, compress_statistics=True, quant_type="nf4")
    q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4", compress_statistics=True)
    q = q.to("cpu").train()
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    run = frozen_4bit(q)
    with torch.no_grad():
        first, saved = run.forward(x)
        again, saved2 = run.forward(x)
        assert saved2[2] is saved[2] and torch.equal(first, again)  # the scales made once
        q.weight.quant_state.absmax.mul_(2)  # the stored (quantized) scales change in place: made again
        y, saved3 = run.forward(x)
        want = q(x)
    assert saved3[2] is not saved[2] and torch.equal(y, want) and not torch.equal(y, first)
