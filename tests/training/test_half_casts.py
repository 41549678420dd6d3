"""fdlora.layers.trainable.half_casts: the half-precision copies of A and B made once per forward pass for the whole model give
the same steps, bit for bit, as each layer making its own, and are never served stale (a change through `.data`,
gradient checkpointing's recompute outside the pass, a deep copy, replaced parameters). On CPU, the eager
half-precision pair that CUDA runs is switched on (its BLAS products are the CPU's)."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig
from torch.utils._python_dispatch import TorchDispatchMode

import fdlora
from fdlora.fixtures import tiny_tasks as tiny
from fdlora.integrations.transformers.trainable.adapters import state_of
from fdlora.kernels import train_ops

HALF = (torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def half_pair(monkeypatch):
    monkeypatch.setattr(train_ops, "_half_pair", lambda u: u.dtype in HALF)


def _model(seed: int = 0, device: str = "cpu"):
    base = tiny.build("tiny-llama", seed).to(device, torch.bfloat16)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)  # B != 0
    return fdlora.add_trainable_adapter(base, "a", cfg)


def _batch(model, seed: int = 1):
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(model.device)
    return {"input_ids": ids, "labels": ids}


def _off(model):
    state_of(model).halves.off = True  # every layer makes its own copies
    return model


def _train(model, steps: int, batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model.train()
    params = fdlora.trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in params]


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
def test_made_once_per_pass_equals_each_layer_making_its_own(device):
    armed = _model(device=device)
    alone = _off(copy.deepcopy(armed))
    batch = _batch(armed)
    got, want = _train(armed, 4, batch), _train(alone, 4, batch)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)
    h = state_of(armed).halves
    (group,) = h.groups.values()
    n = len(fdlora.lora_parameters(armed, "a"))
    assert len(group.A) == n and group.made == h.passes == 4 and h.depth == 0  # remade by the 2nd..4th passes


def test_a_change_through_data_is_seen_by_the_next_pass():
    """The version counters do not see `p.data.mul_`; the next forward pass makes its copies afresh anyway."""
    armed = _model()
    alone = _off(copy.deepcopy(armed))
    batch = _batch(armed)
    for m in (armed, alone):
        m(**batch)
        for A, B in fdlora.lora_parameters(m, "a").values():
            A.data.mul_(2)
            B.data.mul_(-0.5)
    assert torch.equal(armed(**batch).logits, alone(**batch).logits)


def test_replaced_parameters_and_a_layer_called_alone():
    armed = _model()
    alone = _off(copy.deepcopy(armed))
    batch = _batch(armed)
    armed(**batch), alone(**batch)
    for m in (armed, alone):  # new Parameter objects under the same names
        for path, (A, _) in fdlora.lora_parameters(m, "a").items():
            layer = m.get_submodule(path)
            layer.lora_A["a"] = torch.nn.Parameter(A.detach() * 3)
    assert torch.equal(armed(**batch).logits, alone(**batch).logits)
    path = next(iter(fdlora.lora_parameters(armed, "a")))
    x = torch.randn(2, 3, armed.get_submodule(path).in_features, dtype=torch.bfloat16)
    assert state_of(armed).halves.depth == 0  # outside a pass: the layer makes its own
    assert torch.equal(armed.get_submodule(path)(x), alone.get_submodule(path)(x))


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_recompute_saves_what_the_pass_saved(device):
    """Non-reentrant checkpointing recomputes each block in the backward, outside the model's forward pass, and
    hands what the recompute saved to the first forward's nodes: both must be the same tensors."""
    plain = _model(device=device)
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _batch(plain)
    got, want = _train(ckpt, 2, batch), _train(plain, 2, batch)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)


def test_a_deep_copy_makes_its_own():
    armed = _model()
    batch = _batch(armed)
    _train(armed, 1, batch)
    twin = copy.deepcopy(armed)
    with torch.no_grad():
        for A, _ in fdlora.lora_parameters(armed, "a").values():
            A.add_(1)
    assert not torch.equal(armed(**batch).logits, twin(**batch).logits)
    assert state_of(twin).halves is not state_of(armed).halves and state_of(twin).halves.passes == 1
    assert torch.equal(twin(**batch).logits, _off(copy.deepcopy(twin))(**batch).logits)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.mul.out):
            self.casts += 1
        return func(*args, **(kwargs or {}))


def test_no_cast_per_layer_in_a_pass():
    armed = _model()
    alone = _off(copy.deepcopy(armed))
    batch = _batch(armed)
    n = len(fdlora.lora_parameters(armed, "a"))
    counts = []
    for m in (armed, alone):
        m(**batch)  # the first pass registers the layers
        with _Count() as c:
            m(**batch).loss.backward()
        counts.append(c.casts)
    assert counts[1] - counts[0] == 4 * n  # A, s A, B, s B per layer, made by six grouped ops instead


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_layer_equals_the_python_function(device, monkeypatch):
    """fdlora.kernels.host's C++ form of the layer (plain base, casts made ahead) against the Python Function it
    stands in for: the same steps bit for bit. Where no C++ compiler builds it, the layer runs the Function."""
    from fdlora.kernels.host import build

    if build.problem() is not None:
        pytest.skip(f"the C++ training layer cannot be built here: {build.problem()}")
    armed = _model(device=device)
    twin = copy.deepcopy(armed)
    batch = _batch(armed)
    got = _train(armed, 3, batch)
    assert train_ops._HOST not in (None, False), build.status()
    monkeypatch.setattr(train_ops, "_HOST", False)
    want = _train(twin, 3, batch)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)
