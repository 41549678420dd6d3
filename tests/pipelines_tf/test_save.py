"""save_peft writes what PEFT loads back unchanged; merge_and_unload bakes adapters into a plain model."""

from __future__ import annotations

import copy
import json
import os
import tempfile

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

import fdlora
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.layers import registry_of_models
from fdlora.layers.fused import _FusedLora
from pipelines_tf.models import BY_ID, built, ids
from pipelines_tf.test_equivalence import run


def close(a, b):
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-5 * float(y.abs().max())) for x, y in zip(a, b))


@pytest.mark.parametrize("case_id", ["llama", "gpt2-conv1d", "bert-seqcls"])
def test_round_trip_through_peft(case_id):
    b, case = built(case_id), BY_ID[case_id]
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    out = tempfile.mkdtemp()
    fdlora.save_peft(model, out, "one")
    src, dst = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (b.dirs["one"], out))
    assert sorted(src) == sorted(dst) and all(torch.equal(src[k], dst[k]) for k in src)
    cfg = [json.load(open(os.path.join(d, "adapter_config.json"))) for d in (b.dirs["one"], out)]
    for c in cfg:  # PEFT keeps target_modules as a set: its list order is arbitrary
        if isinstance(c["target_modules"], list):
            c["target_modules"] = sorted(c["target_modules"])
    assert cfg[0] == cfg[1]
    peft_model = PeftModel.from_pretrained(copy.deepcopy(b.base), out).eval()
    inputs = case.inputs(2)
    assert close(run(peft_model, inputs), run(model, inputs))


def test_save_writes_a_config_for_adapters_without_one():
    """A canonical adapter (mixed ranks, alphas, rsLoRA, a lora bias): the config is built from the banks."""
    b = built("llama")
    g = torch.Generator().manual_seed(5)
    mods = {
        "model.layers.0.self_attn.q_proj": ModuleLora(torch.randn(4, 32, generator=g), torch.randn(32, 4, generator=g),
                                                      alpha=3.0, bias=torch.randn(32, generator=g)),
        "model.layers.1.mlp.down_proj": ModuleLora(torch.randn(8, 48, generator=g), torch.randn(32, 8, generator=g)),
    }
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), LoraAdapter(mods, use_rslora=True), "canon")
    out = fdlora.save_peft(model, tempfile.mkdtemp(), "canon")
    peft_model = PeftModel.from_pretrained(copy.deepcopy(b.base), out).eval()
    inputs = {"input_ids": ids(2)}
    assert close(run(peft_model, inputs), run(model, inputs))
    with torch.no_grad():
        assert not torch.allclose(b.base(**inputs).logits, model(**inputs).logits)


def test_merge_and_unload_copy_then_in_place():
    b = built("gpt2-conv1d")  # Conv1D bases: the merged delta is transposed
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    fdlora.load_fd_lora(model, b.dirs["two"], "two")
    fdlora.set_adapters(model, ["one", "two"], [0.6, -0.3])
    inputs = {"input_ids": ids(2)}
    served = run(model, inputs)
    merged = fdlora.merge_and_unload(model, copy=True)
    assert not any(isinstance(m, _FusedLora) for m in merged.modules()) and merged not in registry_of_models
    assert type(merged) is type(b.base)
    assert close(run(merged, inputs), served)
    assert close(run(model, inputs), served)  # the fd-lora model still serves its adapters
    plain = model.merge_and_unload(["one"])  # in place, "one" at its current weight 0.6
    assert plain is model and plain not in registry_of_models and not isinstance(plain, fdlora.FdLoraModel)
    assert type(plain) is type(b.base) and not any(isinstance(m, _FusedLora) for m in plain.modules())
    again = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    fdlora.set_adapters(again, "one", 0.6)
    assert close(run(plain, inputs), run(again, inputs))
