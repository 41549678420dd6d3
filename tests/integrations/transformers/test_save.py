"""save_peft writes what PEFT loads back unchanged; merge_and_unload bakes adapters into a plain model."""

from __future__ import annotations

import copy
import json
import os
import tempfile

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

import fdlora
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.layers import registry_of_models
from fdlora.layers.modules.fused import _FusedLora
from integrations.transformers.models import BY_ID, built, ids, randomize_lora
from integrations.transformers.test_equivalence import check_close, peft_run, run


def close(a, b):
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-5 * float(y.abs().max())) for x, y in zip(a, b))


def assert_same_folder(ours: str, peft: str) -> None:
    """Same tensors under the same keys, same adapter_config.json."""
    src, dst = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (peft, ours))
    assert sorted(src) == sorted(dst) and all(torch.equal(src[k], dst[k]) for k in src)
    cfg = [json.load(open(os.path.join(d, "adapter_config.json"))) for d in (peft, ours)]
    for c in cfg:  # PEFT keeps target_modules as a set: its list order is arbitrary
        if isinstance(c["target_modules"], list):
            c["target_modules"] = sorted(c["target_modules"])
    assert cfg[0] == cfg[1]


@pytest.mark.parametrize("case_id", ["llama", "gpt2-conv1d", "bert-seqcls"])
def test_round_trip_through_peft(case_id):
    b, case = built(case_id), BY_ID[case_id]
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    out = fdlora.save_peft(model, tempfile.mkdtemp(), "one")
    assert_same_folder(out, b.dirs["one"])
    peft_model = PeftModel.from_pretrained(copy.deepcopy(b.base), out).eval()
    inputs = case.inputs(2)
    assert close(run(peft_model, inputs), run(model, inputs))


@pytest.mark.parametrize("case_id", ["llama", "mistral", "gpt2-conv1d", "t5", "vit-cls"])
def test_save_after_from_peft_round_trips_through_peft(case_id):
    """A live PEFT model converted by from_peft saves what PEFT saved; PEFT loads it back to the same outputs."""
    b, case = built(case_id), BY_ID[case_id]
    peft_model = copy.deepcopy(b.peft)
    inputs = case.inputs(2)
    before = {n: peft_run(peft_model, n, inputs) for n in ("one", "two")}
    model = fdlora.from_peft(peft_model)
    for name in ("one", "two"):
        out = fdlora.save_peft(model, tempfile.mkdtemp(), name)
        assert_same_folder(out, b.dirs[name])  # b.dirs: PEFT's own save_pretrained of these weights
        again = PeftModel.from_pretrained(copy.deepcopy(b.base), out).eval()
        assert close(run(again, inputs), before[name]), name
    assert not close(before["one"], before["two"])


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


def bert_lora_bias_adapter() -> str:
    """BERT with lora_bias=True on biased linears (query, value, every dense) and its classifier head."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "dense"], lora_bias=True,
                        task_type="SEQ_CLS", init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(built("bert-seqcls").base), config)
    randomize_lora(peft_model)  # lora_B weight and bias, and the classifier copy
    out = tempfile.mkdtemp()
    peft_model.save_pretrained(out)
    return out


MERGE_CASES = [  # (case, adapters merged, a tensor the merge must change: what the case exercises)
    pytest.param("gpt2-conv1d", ["one", "two"], "transformer.h.0.attn.c_attn.weight", id="gpt2-fan_in_fan_out-two"),
    pytest.param("bert-seqcls", ["default"], "bert.encoder.layer.0.attention.self.query.bias", id="bert-lora_bias"),
    pytest.param("vit-cls", ["one"], "classifier.weight", id="vit-modules_to_save"),
]


@pytest.mark.parametrize("case_id, names, changed", MERGE_CASES)
def test_merge_and_unload_matches_peft(case_id, names, changed):
    """fdlora.merge_and_unload == PeftModel.merge_and_unload on the same weights: state dicts and outputs."""
    b, case = built(case_id), BY_ID[case_id]
    dirs = {"default": bert_lora_bias_adapter()} if case_id == "bert-seqcls" else b.dirs
    peft_model = PeftModel.from_pretrained(copy.deepcopy(b.base), dirs[names[0]], adapter_name=names[0])
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), dirs[names[0]], names[0])
    for name in names[1:]:
        peft_model.load_adapter(dirs[name], adapter_name=name)
        fdlora.load_fd_lora(model, dirs[name], name)
    peft_model.base_model.set_adapter(names)
    fdlora.set_adapters(model, names)
    inputs = case.inputs(2)
    oracle = run(copy.deepcopy(peft_model).double().eval(), inputs, torch.float64)  # unmerged, in float64
    theirs = peft_model.merge_and_unload(adapter_names=names).eval()
    ours = fdlora.merge_and_unload(model)
    assert type(ours) is type(theirs) is type(b.base)
    want, got = theirs.state_dict(), ours.state_dict()
    assert sorted(got) == sorted(want)
    assert not torch.allclose(want[changed], b.base.state_dict()[changed])
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6 * float(want[k].abs().max())), k
    check_close(run(ours, inputs), run(theirs, inputs), oracle, "merged")


def test_save_peft_os_errors_name_the_path(tmp_path):
    """A file where the folder should be, or a weight path that is a folder: SaveError (an OSError) naming it."""
    from fdlora.errors import SaveError

    b = built("llama")
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    a_file = tmp_path / "taken"
    a_file.write_text("not a folder")
    cases = {"file-as-dir": a_file, "under-a-file": a_file / "sub"}
    blocked = tmp_path / "blocked"
    (blocked / "adapter_model.safetensors").mkdir(parents=True)  # the weights file's name is a folder
    cases["weights-name-is-a-dir"] = blocked
    for case, target in cases.items():
        with pytest.raises(SaveError, match="could not save adapter 'one' to") as e:
            fdlora.save_peft(model, target, "one")
        assert str(target) in str(e.value) and isinstance(e.value, OSError), case
    assert fdlora.save_peft(model, tmp_path / "ok", "one")  # the model still saves where it can
