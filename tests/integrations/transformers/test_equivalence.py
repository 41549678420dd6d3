"""load_fd_lora(PEFT folder) == PEFT on identical weights, per architecture, against a float64 oracle.

Every float tensor a model returns (logits / last hidden state and every hidden state) is compared.
The bound is derived from eager's own error: PEFT in fp32 against PEFT in float64 gives eager's
error on each tensor and its worst relative error through the network; fd-lora may have FACTOR times
that, plus a few ulps, on every tensor. Missing or mis-scaled LoRA shows up 4-5 orders of magnitude
above this bound.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from peft import LoraConfig, get_peft_model

import fdlora
from fdlora.layers.modules import shared_shrink as shared
from fdlora.testing import EPS, max_err
from integrations.transformers.models import CASES, built, first_tensor, ids, randomize_lora

IDS = [c.id for c in CASES]
FACTOR = 4  # two independent fp32 rounding paths through a whole network: eager's error is one sample of it


def float_tensors(out) -> list[torch.Tensor]:
    """Every floating tensor of a model output, nested tuples included."""
    items = out.to_tuple() if hasattr(out, "to_tuple") else out if isinstance(out, (tuple, list)) else [out]
    found = []
    for x in items:
        if isinstance(x, torch.Tensor):
            found += [x] if x.is_floating_point() else []
        elif isinstance(x, (tuple, list)):
            found += float_tensors(x)
    return found


def run(model, inputs, dtype=torch.float32, **kw):
    kw = {**{k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}, **kw}
    with torch.no_grad():
        return float_tensors(model(**kw, output_hidden_states=True, use_cache=False))


def peft_run(peft_model, name, inputs, dtype=torch.float32, **kw):
    peft_model.set_adapter(name)
    return run(peft_model, inputs, dtype, **kw)


def check_close(ours, peft, oracle, what="", also=()):
    """Each tensor within FACTOR x eager's error on it (its own, or eager's worst relative error at its scale).

    `also`: more eager fp32 results of the same computation (e.g. the rows of a mixed batch run one by one);
    eager's error is then the worst of its samples, a steadier estimate where a network amplifies rounding (T5).
    """
    samples = [peft, *also]
    assert len(ours) == len(oracle) > 0 and all(len(s) == len(oracle) for s in samples)
    errs = [max(max_err(s[i], o) for s in samples) for i, o in enumerate(oracle)]
    rel = max(e / float(o.abs().max().clamp_min(1e-30)) for e, o in zip(errs, oracle))
    for i, (f, o) in enumerate(zip(ours, oracle)):
        scale = float(o.abs().max())
        limit = FACTOR * max(errs[i], rel * scale) + 4 * EPS[torch.float32] * scale + 1e-12
        err = max_err(f, o)
        assert err <= limit, f"{what} tensor {i}: fd-lora err {err:.3g} > {limit:.3g} (eager rel err {rel:.3g})"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_load_matches_peft(case):
    b = built(case.id)
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    fdlora.load_fd_lora(model, b.dirs["two"], "two", activate=False)
    oracle = copy.deepcopy(b.peft).double()
    inputs = case.inputs(3)
    for name in ("one", "two"):
        fdlora.set_adapters(model, name)
        check_close(run(model, inputs), peft_run(b.peft, name, inputs), peft_run(oracle, name, inputs, torch.float64),
                    name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_mixed_rows_equal_single_runs(case):
    """adapter_names=[one, base, two] == each row run alone with its adapter == PEFT's mixed batch."""
    b = built(case.id)
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    fdlora.load_fd_lora(model, b.dirs["two"], "two")
    inputs = case.inputs(3)
    names = ["one", "__base__", "two"]
    mixed = run(model, inputs, adapter_names=names)
    rows = []
    for i, name in enumerate(names):
        row = {k: v[i:i + 1] for k, v in inputs.items()}
        if name == "__base__":
            with model.disable_adapter():
                rows.append(run(model, row))
        else:
            fdlora.set_adapters(model, name)
            rows.append(run(model, row))
    single = [torch.cat(ts) for ts in zip(*rows)]
    oracle = copy.deepcopy(b.peft).double()
    expect = peft_run(oracle, "one", inputs, torch.float64, adapter_names=names)
    peft = peft_run(b.peft, "one", inputs, adapter_names=names)
    check_close(mixed, peft, expect, "mixed")
    check_close(single, peft, expect, "one by one")
    base_row = {k: v[1:2] for k, v in inputs.items()}
    with torch.no_grad():  # a "__base__" row is the base model, bit for bit
        assert torch.equal(first_tensor(model(**base_row, adapter_names=["__base__"])),
                           first_tensor(b.base(**base_row)))


OPS = ("lora_delta", "lora_delta_rows", "lora_linear", "lora_conv_delta")  # every op a fused forward may call


def counting(op, name, owner, calls):
    """`op`, recording (name, the fused layer it serves, args) of each call; a layer is known by its bank's A (the
    address of its first element: an op gets A or a leading slice of it)."""
    def counted(*args):
        layer = [owner[a.data_ptr()] for a in args if torch.is_tensor(a) and a.data_ptr() in owner]
        calls.append((name, layer[0] if layer else None, args))
        return op(*args)
    return counted


def test_mixed_batch_is_one_op_per_layer(monkeypatch):
    """3 adapters + "__base__" in one batch: one backend op call per fused layer, carrying every adapter's rows
    (no Python loop over adapters), and the result is PEFT's."""
    b = built("llama")
    peft_model = copy.deepcopy(b.peft)
    third = get_peft_model(copy.deepcopy(b.base), LoraConfig(r=2, lora_alpha=4, init_lora_weights=False,
                                                             target_modules=["q_proj", "v_proj", "down_proj"]))
    randomize_lora(third, seed=4)
    folder = tempfile.mkdtemp()
    third.save_pretrained(folder)
    peft_model.load_adapter(folder, adapter_name="three")
    peft_model.eval()
    model = fdlora.load_fd_lora(copy.deepcopy(b.base), b.dirs["one"], "one")
    fdlora.load_fd_lora(model, b.dirs["two"], "two")
    fdlora.load_fd_lora(model, folder, "three")
    layers = fdlora.handle(model).layers
    owner = {layer.bank.A.data_ptr(): path for path, layer in layers.items()}  # banks share arena storage
    calls = []
    for ops in {id(layer._ops): layer._ops for layer in layers.values()}.values():
        for name in OPS:
            if hasattr(ops, name):
                monkeypatch.setattr(ops, name, counting(getattr(ops, name), name, owner, calls))
    names = ["three", "one", "__base__", "two"]
    inputs = {"input_ids": ids(4)}
    # the per-layer op form; q/k/v and gate/up groups (one lora_shrink per group, one lora_expand_add per layer,
    # every adapter's rows in each) are counted in tests/layers/test_shared_shrink.py
    monkeypatch.setattr(shared, "ENABLED", False)
    ours = run(model, inputs, adapter_names=names)
    monkeypatch.undo()
    assert sorted(path for _, path, _ in calls) == sorted(layers)  # exactly one call per fused layer
    q = "model.layers.0.self_attn.q_proj"  # every adapter targets it: the one call holds all three, one per row
    (op, _, args), = [c for c in calls if c[1] == q]
    assert op == "lora_delta"
    slot = fdlora.handle(model).state.slots.slot
    expect = torch.zeros(4, args[5].shape[1])
    for row, name in enumerate(names):
        if name != "__base__":
            expect[row, slot(name)] = 1.0
    assert torch.equal(args[5], expect)  # group_weight [rows, slots]: one-hot per sample, zero for the base
    oracle = copy.deepcopy(peft_model).double()
    check_close(ours, peft_run(peft_model, "one", inputs, adapter_names=names),
                peft_run(oracle, "one", inputs, torch.float64, adapter_names=names), "mixed")
