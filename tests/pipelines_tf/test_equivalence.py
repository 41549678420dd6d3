"""load_fd_lora(PEFT folder) == PEFT on identical weights, per architecture, against a float64 oracle.

Every float tensor a model returns (logits / last hidden state and every hidden state) is compared.
The bound is derived from eager's own error: PEFT in fp32 against PEFT in float64 gives eager's
error on each tensor and its worst relative error through the network; fd-lora may have FACTOR times
that, plus a few ulps, on every tensor. Missing or mis-scaled LoRA shows up 4-5 orders of magnitude
above this bound.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fdlora
from fdlora.testing import EPS, max_err
from pipelines_tf.models import CASES, built, first_tensor

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


def check_close(ours, peft, oracle, what=""):
    """Each tensor within FACTOR x eager's error on it (its own, or eager's worst relative error at its scale)."""
    assert len(ours) == len(peft) == len(oracle) > 0
    rel = max(max_err(p, o) / float(o.abs().max().clamp_min(1e-30)) for p, o in zip(peft, oracle))
    for i, (f, p, o) in enumerate(zip(ours, peft, oracle)):
        scale = float(o.abs().max())
        limit = FACTOR * max(max_err(p, o), rel * scale) + 4 * EPS[torch.float32] * scale + 1e-12
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
