"""Which modules an adapter targets: fd-lora's `peft_targets` == the modules PEFT itself wraps.

PEFT saves weights only for what it targets, so a targeting rule fd-lora gets wrong never shows in a
round trip of PEFT's own files. Here the oracle is `get_peft_model`: every case's config, a regex
string, exclude_modules (list and regex), layers_to_transform (int, list, with layers_pattern) and
explicit lists that name output heads and modules_to_save. Files with LoRA weights PEFT would not
load (excluded, outside layers_to_transform, untargeted) must be ignored as PEFT ignores them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import re
import shutil
import tempfile

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

import fdlora
from fdlora.integrations.transformers.loraconfig import peft_targets
from integrations.transformers.models import CASES, built, ids, randomize_lora, second_config
from integrations.transformers.test_equivalence import run

PATTERNS = ["layers", "h", "layer", "block"]  # one list for every case: T5 paths hold both "block.i" and "layer.i"


def kinds(model: nn.Module) -> list[str]:
    """Last name of every Linear / Conv1D module, heads included."""
    return sorted({p.rsplit(".", 1)[-1] for p, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))})


def head_fields(case) -> dict:
    return {k: v for k, v in case.extra.items() if k in ("task_type", "modules_to_save")}


# variant id -> (LoraConfig for a case and its base, does it restrict an otherwise wider target set?)
VARIANTS = {
    "case": (lambda c, m: c.config(), False),
    "second": (lambda c, m: second_config(c), False),
    "regex": (lambda c, m: LoraConfig(target_modules=r".*\.1\..*(q_proj|v_proj|c_attn|query|value|\.q|\.v|fc1)",
                                      **head_fields(c)), False),
    "named-heads": (lambda c, m: LoraConfig(target_modules=kinds(m), **head_fields(c)), False),
    "exclude-list": (lambda c, m: LoraConfig(target_modules="all-linear", exclude_modules=kinds(m)[::2],
                                             **head_fields(c)), True),
    "exclude-regex": (lambda c, m: LoraConfig(target_modules=kinds(m), exclude_modules=r".*\.0\..*",
                                              **head_fields(c)), True),
    "layers-int": (lambda c, m: LoraConfig(target_modules=kinds(m), layers_to_transform=1, **head_fields(c)), True),
    "layers-pattern": (lambda c, m: LoraConfig(target_modules=kinds(m), layers_to_transform=[0],
                                               layers_pattern=PATTERNS, **head_fields(c)), True),
}
GRID = [pytest.param(case, v, id=f"{case.id}-{v}") for case in CASES for v in VARIANTS]


def peft_wrapped(base: nn.Module, config: LoraConfig) -> set[str]:
    """Module paths (relative to the base model) that get_peft_model puts LoRA layers on."""
    peft_model = get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    return {p for p, m in peft_model.base_model.model.named_modules() if isinstance(m, LoraLayer)}


@functools.cache
def fused(case_id: str) -> nn.Module:
    """The case's base with both its adapters loaded by fd-lora (fused layers and module copies in place)."""
    b = built(case_id)
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    fdlora.load_fd_lora(model, b.dirs["two"], "two", activate=False)
    return model


@pytest.mark.parametrize("case, variant", GRID)
def test_peft_targets_equal_what_peft_wraps(case, variant):
    base = built(case.id).base
    make, restricts = VARIANTS[variant]
    config = make(case, base)
    theirs = peft_wrapped(base, config)
    assert theirs, "the variant must target something"
    if restricts:  # the rule under test removes modules PEFT would otherwise wrap
        wider = dataclasses.replace(config, exclude_modules=None, layers_to_transform=None, layers_pattern=None)
        assert theirs < peft_wrapped(base, wider)
    assert set(peft_targets(base, config)) == theirs
    assert set(peft_targets(fused(case.id), config)) == theirs  # fused layers and module copies count as their base


# one config with all three rules; each extra module is one PEFT would not load
RULES = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1], layers_pattern="layers",
             exclude_modules=r".*layers\.1\.self_attn\.v_proj", init_lora_weights=False)
EXTRA = {
    "excluded": "model.layers.1.self_attn.v_proj",
    "outside-layers": "model.layers.0.self_attn.q_proj",
    "untargeted": "model.layers.1.mlp.up_proj",
}


@functools.cache
def rules_adapter() -> str:
    base = built("llama").base
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**RULES))
    randomize_lora(peft_model)
    out = tempfile.mkdtemp()
    peft_model.save_pretrained(out)
    return out


def with_extra_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """A copy of rules_adapter() whose safetensors also holds `tensors`."""
    src = rules_adapter()
    out = tempfile.mkdtemp()
    shutil.copy(os.path.join(src, "adapter_config.json"), out)
    saved = load_file(os.path.join(src, "adapter_model.safetensors"))
    save_file({**saved, **tensors}, os.path.join(out, "adapter_model.safetensors"))
    return out


def lora_tensors(model: nn.Module, path: str, r: int = 4, seed: int = 3) -> dict[str, torch.Tensor]:
    layer = model.get_submodule(path)
    g = torch.Generator().manual_seed(seed)
    return {f"base_model.model.{path}.lora_A.weight": torch.randn(r, layer.in_features, generator=g),
            f"base_model.model.{path}.lora_B.weight": torch.randn(layer.out_features, r, generator=g)}


@pytest.mark.parametrize("why", list(EXTRA))
def test_lora_weights_peft_does_not_load_are_ignored_with_a_warning(why):
    b = built("llama")
    path = EXTRA[why]
    assert path not in peft_wrapped(b.base, LoraConfig(**RULES))
    folder = with_extra_tensors(lora_tensors(b.base, path))
    inputs = {"input_ids": ids(2)}
    peft_model = PeftModel.from_pretrained(copy.deepcopy(b.base), folder).eval()
    clean = PeftModel.from_pretrained(copy.deepcopy(b.base), rules_adapter()).eval()
    with pytest.warns(UserWarning, match=rf"adapter 'x'.*\['{re.escape(path)}'\].*does not target; PEFT ignores them"):
        model = fdlora.load_fd_lora(copy.deepcopy(b.base), folder, "x")
    assert list(fdlora.handle(model).layers) == ["model.layers.1.self_attn.q_proj"]
    ours, theirs = run(model, inputs), run(peft_model, inputs)
    assert all(torch.allclose(a, t, rtol=1e-5, atol=1e-5 * float(t.abs().max())) for a, t in zip(ours, theirs))
    assert all(torch.equal(t, c) for t, c in zip(theirs, run(clean, inputs)))  # PEFT dropped the extra weights
    assert not torch.allclose(theirs[0], run(b.base, inputs)[0])  # and kept the one it targets


def test_lora_bias_keys_without_lora_bias_are_ignored():
    """A lora_B.bias in the file of a lora_bias=False adapter: PEFT's lora_B has no bias and drops the key."""
    b = built("llama")
    path = "model.layers.1.self_attn.q_proj"
    bias = torch.randn(32, generator=torch.Generator().manual_seed(4))
    folder = with_extra_tensors({f"base_model.model.{path}.lora_B.bias": bias})
    inputs = {"input_ids": ids(2)}
    theirs = run(PeftModel.from_pretrained(copy.deepcopy(b.base), folder).eval(), inputs)
    assert all(torch.equal(t, c) for t, c in zip(theirs, run(PeftModel.from_pretrained(
        copy.deepcopy(b.base), rules_adapter()).eval(), inputs)))
    with pytest.warns(UserWarning, match="lora_bias=False"):
        model = fdlora.load_fd_lora(copy.deepcopy(b.base), folder, "x")
    ours = run(model, inputs)
    assert all(torch.allclose(a, t, rtol=1e-5, atol=1e-5 * float(t.abs().max())) for a, t in zip(ours, theirs))
