"""The PEFT-integration methods of a Transformers model, served by fd-lora (modules_to_save included)."""

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
from fdlora import errors
from integrations.transformers.models import BY_ID, built
from integrations.transformers.test_equivalence import peft_run, run


def close(a, b):
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-5 * float(y.abs().max())) for x, y in zip(a, b))


def test_load_switch_delete_save_unload():
    b, case = built("vit-cls"), BY_ID["vit-cls"]
    original = copy.deepcopy(b.base)
    head = original.classifier
    model = fdlora.load_fd_lora(original, b.dirs["one"], "one")
    assert model is original and isinstance(model, fdlora.FdLoraModel) and isinstance(model, type(b.base))
    assert type(model).__name__ == type(b.base).__name__
    two = b.dirs["two"]
    with open(os.path.join(two, "adapter_config.json")) as f:
        config = json.load(f)
    model.load_adapter(adapter_name="two", peft_config=config,
                       adapter_state_dict=load_file(os.path.join(two, "adapter_model.safetensors")))
    assert model.active_adapters() == ["one"]  # as in Transformers: loading does not switch
    inputs = case.inputs(2)
    model.set_adapter("two")
    assert close(run(model, inputs), peft_run(b.peft, "two", inputs))
    model.disable_adapters()
    assert close(run(model, inputs), run(b.base, inputs))
    model.enable_adapters()
    out = tempfile.mkdtemp()
    model.save_pretrained(out)  # the active adapter, PEFT layout (as Transformers does with PEFT adapters)
    assert close(run(PeftModel.from_pretrained(copy.deepcopy(b.base), out).eval(), inputs), run(model, inputs))
    model.delete_adapter("two")
    with pytest.raises(errors.UnknownAdapterError):
        model.set_adapter("two")
    model.set_adapter("one")
    assert close(run(model, inputs), peft_run(b.peft, "one", inputs))
    plain = model.unload()
    assert type(plain) is type(b.base) and plain.classifier is head  # the original module object is back
    assert close(run(plain, inputs), run(b.base, inputs))
