"""generate(adapter_names=[...]) == one generation per row with that adapter (greedy and beam search)."""

from __future__ import annotations

import copy

import pytest
import torch

import fdlora
from integrations.transformers.models import built, ids

NAMES = ["one", "__base__", "two"]


def fd_model(case_id):
    b = built(case_id)
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    fdlora.load_fd_lora(model, b.dirs["two"], "two")
    model.generation_config.pad_token_id = 0
    return model


def one_by_one(model, prompts, names, **kw):
    outs = []
    for i, name in enumerate(names):
        if name == "__base__":
            with model.disable_adapter():
                outs.append(model.generate(prompts[i:i + 1], **kw))
        else:
            fdlora.set_adapters(model, name)
            outs.append(model.generate(prompts[i:i + 1], **kw))
    return outs


@pytest.mark.parametrize("case_id", ["llama", "gpt2-conv1d", "t5"])
def test_greedy_mixed_equals_separate(case_id):
    model = fd_model(case_id)
    prompts = ids(3, 5, seed=7)
    kw = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        mixed = model.generate(prompts, adapter_names=NAMES, **kw)
        separate = one_by_one(model, prompts, NAMES, **kw)
    for i, s in enumerate(separate):
        assert torch.equal(mixed[i:i + 1, : s.shape[1]], s), f"row {i} ({NAMES[i]})"
    with torch.no_grad():  # the per-row choice matters: each row's first-step logits change with its adapter
        logits = {n: model.generate(prompts, adapter_names=[n] * 3, max_new_tokens=1, do_sample=False,
                                    return_dict_in_generate=True, output_logits=True).logits[0] for n in NAMES}
    for i in range(3):
        others = [n for n in NAMES if n != NAMES[i]]
        assert all(not torch.allclose(logits[NAMES[i]][i], logits[n][i]) for n in others), f"row {i}"


@pytest.mark.parametrize("case_id", ["llama", "qwen2", "mistral"])
def test_greedy_matches_peft_adapter_names(case_id):
    """Same tokens and, step by step, the same logits as PEFT's generate(adapter_names=...)."""
    model = fd_model(case_id)
    peft_model = built(case_id).peft
    prompts = ids(3, 5, seed=8)
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ours = model.generate(prompts, adapter_names=NAMES, **kw)
        theirs = peft_model.generate(input_ids=prompts, adapter_names=NAMES, pad_token_id=0, **kw)
        with peft_model.disable_adapter():
            base = peft_model.generate(input_ids=prompts, pad_token_id=0, **kw)
    assert torch.equal(ours.sequences, theirs.sequences)
    got, want, plain = (torch.stack(out.logits, 1) for out in (ours, theirs, base))  # [B, steps, vocab]
    tol = 1e-5 * float(want.abs().max())
    assert torch.allclose(got, want, rtol=0, atol=tol)
    for i, name in enumerate(NAMES):  # each adapter row really differs from the base, the base row does not
        assert (name == "__base__") == torch.allclose(want[i], plain[i], rtol=0, atol=100 * tol), name


def test_beams_and_return_sequences_follow_the_batch():
    """Beam search repeats each sample in place; the per-sample spec follows without expansion."""
    model = fd_model("llama")
    prompts = ids(3, 5, seed=9)
    kw = dict(max_new_tokens=5, do_sample=False, num_beams=3, num_return_sequences=2)
    with torch.no_grad():
        mixed = model.generate(prompts, adapter_names=NAMES, **kw)
        separate = one_by_one(model, prompts, NAMES, **kw)
    assert mixed.shape[0] == 6
    for i, s in enumerate(separate):
        assert torch.equal(mixed[2 * i:2 * i + 2, : s.shape[1]], s), f"row {i} ({NAMES[i]})"


def test_adapter_names_must_match_the_batch():
    model = fd_model("llama")
    with pytest.raises(fdlora.FdLoraError, match="exactly one entry per sample"):
        model.generate(ids(3, 5), adapter_names=["one", "two"], max_new_tokens=2)
    with pytest.raises(fdlora.FdLoraError, match="no adapter named 'nope'"):
        model(ids(2, 5), adapter_names=["one", "nope"])
    with pytest.raises(fdlora.FdLoraError, match="a list"):
        model(ids(1, 5), adapter_names="one")


def test_fd_lora_adapters_blend_per_row():
    """fd-lora's own per-sample specs: {name: weight} blends one row, None leaves one at the base."""
    model = fd_model("llama")
    x = ids(2, 5, seed=10)
    with torch.no_grad():
        mixed = model(x, fd_lora_adapters=[{"one": 0.5, "two": -0.7}, None]).logits
        fdlora.set_adapters(model, ["one", "two"], [0.5, -0.7])
        blend = model(x[:1]).logits
        with model.disable_adapter():
            base = model(x[1:]).logits
    expect = torch.cat([blend, base])
    assert torch.allclose(mixed, expect, rtol=0, atol=1e-5 * float(expect.abs().max()))
    with pytest.raises(fdlora.FdLoraError, match="not both"):
        model(x, adapter_names=["one", "two"], fd_lora_adapters=["one", "two"])
    with pytest.raises(fdlora.FdLoraError, match="fd_lora_adapters"):
        model(x, adapter_names=[{"one": 1.0}, "two"])
