"""The model-level API: restore exactness, lifecycle without growth, bad input leaves no trace."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import fdlora
from fdlora import errors
from fdlora.hub.adapter import LoraAdapter, ModuleLora


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"q_proj": nn.Linear(16, 16), "v_proj": nn.Linear(16, 16), "mlp": nn.Linear(16, 24)})
            for _ in range(3)
        )
        self.conv = nn.Conv2d(2, 16, 3, padding=1)
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b["q_proj"](x) + b["v_proj"](x))
        return self.head(torch.relu(self.blocks[-1]["mlp"](x)))


def lora(paths, rank=4, K=16, N=16, alpha=None, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return LoraAdapter({p: ModuleLora(torch.randn(rank, K, generator=g), torch.randn(N, rank, generator=g) * scale,
                                      alpha) for p in paths})


QV = [f"blocks.{i}.{m}" for i in range(3) for m in ("q_proj", "v_proj")]


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net()


def snapshot(model):
    h = fdlora.handle(model)
    return {
        "modules": {n: id(m) for n, m in model.named_modules()},
        "banks": {p: [t.clone() for t in (l.bank.A, l.bank.B, l.bank.ranks)] for p, l in h.layers.items()},
        "table": h.state.table.host().clone(),
        "slots": dict(h.state.slots.by_name),
        "active": dict(h.state.active),
    }


def assert_same(a, b):
    assert a["modules"] == b["modules"] and a["slots"] == b["slots"] and a["active"] == b["active"]
    assert torch.equal(a["table"], b["table"])
    for p in a["banks"]:
        assert all(torch.equal(u, v) for u, v in zip(a["banks"][p], b["banks"][p]))


def test_restore_is_bit_exact(net):
    x = torch.randn(4, 16)
    before = net(x)
    originals = {p: net.get_submodule(p) for p in QV}
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    h = fdlora.inject(net, ["q_proj", "v_proj"])
    fdlora.add_adapter(net, lora(QV), "a")
    assert not torch.equal(net(x), before)
    h.restore()
    assert all(net.get_submodule(p) is m for p, m in originals.items())
    assert torch.equal(net(x), before)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in weights.items())
    with pytest.raises(errors.FdLoraError, match="no fd-lora layers"):
        fdlora.set_adapters(net, "a")


def test_state_dict_is_untouched_by_injection(net):
    keys = set(net.state_dict())
    fdlora.inject(net, "all-linear")
    fdlora.add_adapter(net, lora(QV), "a")
    assert {k.replace(".base.", ".") for k in net.state_dict()} == keys


def test_targets_follow_peft_semantics(net):
    assert sorted(fdlora.inject(net, r".*\.(q|v)_proj").layers) == sorted(QV)
    fdlora.restore(net)
    h = fdlora.inject(net, "all-linear", exclude=["head"])
    assert "head" not in h.layers and "blocks.0.mlp" in h.layers and "conv" not in h.layers
    fdlora.restore(net)
    h = fdlora.inject(net, ["q_proj"], layers_to_transform=[1], layers_pattern="blocks")
    assert list(h.layers) == ["blocks.1.q_proj"]
    fdlora.restore(net)
    with pytest.raises(errors.TargetError, match="match no module"):
        fdlora.inject(net, ["nope"])
    with pytest.raises(errors.TargetError, match="not"):
        fdlora.inject(net, ["blocks.0"])


def test_lifecycle_has_no_growth(net):
    h = fdlora.inject(net, ["q_proj", "v_proj"], max_slots=2)
    x = torch.randn(2, 16)
    ad = lora(QV)
    buffers = {p: (l.bank.A.data_ptr(), l.bank.B.data_ptr()) for p, l in h.layers.items()}
    table = h.state.table.on(torch.device("cpu"))

    def live_tensors():
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    for _ in range(20):  # warm up every path once
        fdlora.add_adapter(net, ad, "a")
        fdlora.set_adapters(net, ["a"], [0.5])
        net(x)
        fdlora.delete_adapter(net, "a")
    n0 = live_tensors()
    for i in range(1000):
        fdlora.add_adapter(net, ad, "a")
        fdlora.set_adapters(net, ["a"], [i / 1000])
        fdlora.delete_adapter(net, "a")
    assert live_tensors() <= n0
    assert buffers == {p: (l.bank.A.data_ptr(), l.bank.B.data_ptr()) for p, l in h.layers.items()}
    assert h.state.table.on(torch.device("cpu")) is table
    assert all(not any(l.bank.used) for l in h.layers.values())


def test_set_adapters_is_one_table_write(net):
    h = fdlora.inject(net, ["q_proj", "v_proj"])
    fdlora.add_adapter(net, lora(QV, alpha=8), "a")
    fdlora.add_adapter(net, lora(QV, rank=2, seed=1), "b")
    fdlora.set_adapters(net, ["a", "b"], [0.25, 2.0])
    table = h.state.table.on(torch.device("cpu"))
    for layer in h.layers.values():
        assert layer.scale_blend.data_ptr() == table[0, layer.index].data_ptr()  # views, no copies
        assert torch.allclose(layer.scale_blend[:2], torch.tensor([0.25 * 8 / 4, 2.0 * 2 / 2]))
    assert h.active_adapters() == ["a", "b"]


def test_blend_equals_sum_of_singles(net):
    x = torch.randn(3, 16)
    fdlora.inject(net, ["q_proj", "v_proj"])
    fdlora.add_adapter(net, lora(QV, scale=0.1), "a")
    fdlora.add_adapter(net, lora(QV, seed=1, scale=0.1), "b")
    layer = net.blocks[0]["q_proj"]
    fdlora.set_adapters(net, ["a", "b"], [0.5, 1.5])
    both = layer(x)
    fdlora.set_adapters(net, "a", 0.5)
    a = layer(x)
    fdlora.set_adapters(net, "b", 1.5)
    b = layer(x)
    base = layer.base(x)
    assert torch.allclose(both - base, (a - base) + (b - base), atol=1e-5)


def test_per_row_and_per_sample(net):
    fdlora.inject(net, ["q_proj", "v_proj"])
    fdlora.add_adapter(net, lora(QV, scale=0.1), "a")
    fdlora.add_adapter(net, lora(QV, seed=1, scale=0.1), "b")
    x = torch.randn(4, 16)
    single = {}
    for name in ("a", "b"):
        fdlora.set_adapters(net, name)
        single[name] = net(x)
    fdlora.disable(net)
    single[None] = net(x)
    fdlora.enable(net)
    names = ["b", None, "a", "b"]
    with fdlora.per_row(net, names):
        rows = net(x)
    with fdlora.per_sample(net, names):
        samples = net(x)
    for i, n in enumerate(names):
        assert torch.allclose(rows[i], single[n][i], atol=1e-6)
        assert torch.allclose(samples[i], single[n][i], atol=1e-6)
    with fdlora.per_sample(net, [{"a": 0.5, "b": 0.5}] * 4):
        mixed = net(x)
    fdlora.set_adapters(net, ["a", "b"], [0.5, 0.5])
    assert torch.allclose(mixed, net(x), atol=1e-6)


def test_per_sample_on_a_sequence_first_input_is_refused(net):
    """Rows of [S, B, K] do not group by sample: per-sample adapters there raise (they took contiguous rows as one
    sample's before); batch-first [B, S, K], flattened [B*S, K] and packed [1, B*S, K] inputs still work."""
    fdlora.inject(net, QV, max_rank=8)
    fdlora.add_adapter(net, lora(QV, seed=0, scale=0.1), "a")
    layer = net.blocks[0]["q_proj"]
    x = torch.randn(2, 3, 16)  # [B, S, K]
    fdlora.set_adapters(net, "a")
    full = layer(x)
    with fdlora.per_sample(net, ["a", None]):
        for got in (layer(x), layer(x.reshape(6, 16)).view(2, 3, -1), layer(x.reshape(1, 6, 16)).view(2, 3, -1)):
            assert torch.allclose(got[0], full[0], atol=1e-6) and torch.allclose(got[1], layer.base(x)[1], atol=1e-6)
        with pytest.raises(errors.FdLoraError, match="not batch-first"):
            layer(x.transpose(0, 1).contiguous())  # [S, B, K]


def test_multiplier_scales_every_adapter(net):
    fdlora.inject(net, ["q_proj"])
    fdlora.add_adapter(net, lora([p for p in QV if "q_proj" in p], scale=0.1), "a")
    layer = net.blocks[0]["q_proj"]
    x = torch.randn(2, 16)
    fdlora.set_adapters(net, "a", 0.6)
    w = layer(x)
    fdlora.set_adapters(net, "a", 0.2)
    fdlora.handle(net).set_multiplier(3.0)
    assert torch.allclose(layer(x), w, atol=1e-6)


def test_grow_keeps_adapters(net):
    x = torch.randn(2, 16)
    h = fdlora.inject(net, ["q_proj", "v_proj"], max_slots=1, max_rank=16)
    fdlora.add_adapter(net, lora(QV, scale=0.1), "a")
    out = net(x)
    with pytest.raises(errors.CapacityError, match="max_slots"):
        fdlora.add_adapter(net, lora(QV), "b")
    fdlora.delete_adapter(net, "a")
    with pytest.raises(errors.CapacityError, match="max_rank"):
        fdlora.add_adapter(net, lora(QV, rank=20), "big")
    fdlora.add_adapter(net, lora(QV, scale=0.1), "a")
    h.grow(max_slots=3, max_rank=32)
    assert torch.allclose(net(x), out)
    fdlora.add_adapter(net, lora(QV, rank=20), "big")
    assert h.list_adapters() == ["a", "big"]
    h.freeze()
    with pytest.raises(errors.CompiledModelError, match="frozen"):
        h.grow(max_slots=8)


BAD = [
    ("shape-mismatch", lambda: lora(QV, K=15), errors.AdapterShapeError, r"blocks\.0\.q_proj"),
    ("not-a-module", lambda: lora(["blocks.0.nope"]), errors.TargetError, "not a module"),
    ("rank-too-big", lambda: lora(QV, rank=80), errors.CapacityError, "max_rank"),
    ("nan", lambda: LoraAdapter({**lora(QV).modules, "blocks.2.v_proj": ModuleLora(
        torch.full((4, 16), float("nan")), torch.ones(16, 4))}), errors.NonFiniteError, "NaN"),
    ("int-weights", lambda: LoraAdapter({"blocks.1.q_proj": ModuleLora(
        torch.ones(4, 16, dtype=torch.int64), torch.ones(16, 4, dtype=torch.int64))}), errors.AdapterShapeError,
     "must be float"),
    ("conv-into-linear", lambda: LoraAdapter({"blocks.0.q_proj": ModuleLora(
        torch.ones(4, 16, 1, 1), torch.ones(16, 4, 1, 1))}), errors.AdapterShapeError, "conv2d LoRA"),
    ("wrong-out-features", lambda: lora(QV, N=17), errors.AdapterShapeError, r"blocks\.0\.q_proj"),
    ("bias-shape", lambda: LoraAdapter({"blocks.1.v_proj": ModuleLora(
        torch.ones(4, 16), torch.ones(16, 4), bias=torch.ones(15))}), errors.AdapterShapeError, "lora bias"),
    ("duplicate-name", lambda: lora(QV), errors.DuplicateAdapterError, "already loaded"),
]


@pytest.mark.parametrize("make,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_adapter_leaves_model_unchanged(net, make, exc, match):
    fdlora.inject(net, ["q_proj", "v_proj"])
    fdlora.add_adapter(net, lora(QV, seed=5), "a")
    x = torch.randn(2, 16)
    out = net(x)
    before = snapshot(net)
    with pytest.raises(exc, match=match):
        fdlora.add_adapter(net, make(), "a" if exc is errors.DuplicateAdapterError else "new")
    assert_same(before, snapshot(net))
    assert torch.equal(net(x), out)


def test_bad_calls_name_the_fix(net):
    fdlora.inject(net, ["q_proj"])
    fdlora.add_adapter(net, lora([p for p in QV if "q_proj" in p]), "a")
    before = snapshot(net)
    with pytest.raises(errors.UnknownAdapterError, match="loaded: 'a'"):
        fdlora.set_adapters(net, ["a", "zzz"])
    with pytest.raises(errors.FdLoraError, match="one weight per name"):
        fdlora.set_adapters(net, ["a"], [1.0, 2.0])
    with pytest.raises(errors.UnknownAdapterError):
        fdlora.delete_adapter(net, ["a", "zzz"])
    assert_same(before, snapshot(net))
    with pytest.raises(errors.FdLoraError, match="already has fd-lora layers"):
        fdlora.inject(net, ["v_proj"])


def test_add_adapter_wraps_new_modules_and_conv(net):
    fdlora.inject(net, ["q_proj"])
    conv = LoraAdapter({"conv": ModuleLora(torch.randn(3, 2, 3, 3), torch.randn(16, 3, 1, 1), alpha=6)})
    fdlora.add_adapter(net, conv, "locon")
    layer = net.conv
    assert isinstance(layer, fdlora.FusedLoraConv2d)
    img = torch.randn(2, 2, 5, 5)
    ref = layer.base(img) + 2 * torch.nn.functional.conv2d(
        torch.nn.functional.conv2d(img, conv.modules["conv"].A, padding=1), conv.modules["conv"].B)
    assert torch.allclose(layer(img), ref, atol=1e-5)


def test_backend_selection_is_explained():
    from fdlora.kernels import Problem, select

    p = Problem("cpu", torch.float32, "linear", 16, 4)
    sel = select(p)
    assert sel.name == "torch" and any("triton" in r for r in sel.reasons)
    with pytest.raises(errors.BackendUnavailableError) as e:
        select(p, prefer="cuda")
    assert "torch: ok" in str(e.value) and "triton:" in str(e.value) and "set_backend('auto')" in str(e.value)
    with pytest.raises(errors.BackendUnavailableError, match="unknown backend"):
        fdlora.set_backend("cutlass")


def test_set_backend_reselects_layers_and_env(net, monkeypatch):
    h = fdlora.inject(net, ["q_proj"])
    fdlora.set_backend("torch")
    try:
        assert all(l.selection.reasons[0] == "requested 'torch'" for l in h.layers.values())
        assert "backend=torch" in repr(net.blocks[0]["q_proj"])
        with pytest.raises(errors.BackendUnavailableError, match="cuda"):
            fdlora.set_backend("cuda")
        assert all(l.selection.name == "torch" for l in h.layers.values())  # failed switch rolled back
    finally:
        fdlora.set_backend("auto")
    monkeypatch.setenv("FDLORA_BACKEND", "cuda")
    import fdlora.kernels.registry as reg

    monkeypatch.setattr(reg, "_preference", None)
    with pytest.raises(errors.BackendUnavailableError, match="cuda: (not built|no CUDA device)"):
        fdlora.inject(Net(), ["q_proj"])


@pytest.fixture
def gpu_only_backend():
    """A backend that is available but runs on CUDA only (the reference's ops under that capability): what
    FDLORA_BACKEND=triton is on a GPU machine for a model still on the CPU."""
    import fdlora.kernels.registry as reg

    reg.register(reg.Backend("gpu-only", reg.Capability(devices=frozenset({"cuda"}), dtypes=frozenset(
        {torch.float32, torch.float16, torch.bfloat16}), kinds=frozenset({"linear"})), "fdlora.kernels.ops"))
    try:
        yield "gpu-only"
    finally:
        fdlora.set_backend("auto")
        reg._BACKENDS.pop("gpu-only")


def test_a_requested_gpu_backend_lets_a_cpu_model_load_then_refuses_its_calls(gpu_only_backend):
    """Load on the CPU, then .to("cuda"), under a pinned GPU backend: wrapping and loading work, a call on the CPU
    raises the error that names the fix, and the model is as it was (auto then runs it)."""
    m = Net()
    x = torch.randn(2, 3, 16)
    fdlora.set_backend(gpu_only_backend)
    h = fdlora.inject(m, ["blocks.0.q_proj"])
    ad = lora(["blocks.0.q_proj"])
    fdlora.add_adapter(m, ad, "a")
    layer = h.layers["blocks.0.q_proj"]
    assert layer.selection.name == "gpu-only" and "no calls on cpu" in str(layer.selection)
    with pytest.raises(errors.BackendUnavailableError, match=r"does not run on cpu.*Move the model to cuda"):
        m(x)
    fdlora.set_backend("auto")
    assert layer.selection.name == "torch" and fdlora.active_adapters(m) == ["a"]
    mod = ad.modules["blocks.0.q_proj"]  # alpha defaults to the rank: scale 1
    torch.testing.assert_close(layer(x), layer.base(x) + x @ mod.A.t() @ mod.B.t())
    with pytest.raises(errors.BackendUnavailableError, match="unknown backend"):  # a name still must exist
        fdlora.set_backend("gpu_only")


def test_block_wise_weights_and_batch_keyed_samples(net):
    h = fdlora.inject(net, ["q_proj", "v_proj"])
    fdlora.add_adapter(net, lora(QV, scale=0.1), "a")
    x = torch.randn(2, 3, 16)  # batch 2, 3 tokens
    h.set_adapters("a", lambda path: 0.0 if path.startswith("blocks.0") else 2.0)
    assert float(net.blocks[0]["q_proj"].scale_blend[0]) == 0.0
    assert float(net.blocks[1]["q_proj"].scale_blend[0]) == 2.0
    per_layer = net(x)
    h.set_adapters("a", 2.0)
    assert not torch.allclose(per_layer, net(x))
    fdlora.disable(net)
    base = net(x)
    fdlora.enable(net)
    h.set_adapters("a", 1.0)
    full = net(x)
    # one call serving two batch sizes: 2 prompts, and the same prompts doubled (CFG-like)
    with h.per_sample({2: ["a", None], 4: [None, None, "a", None]}):
        two = net(x)
        four = net(torch.cat([x, x]))
    assert torch.allclose(two[0], full[0], atol=1e-6) and torch.allclose(two[1], base[1], atol=1e-6)
    assert torch.allclose(four[2], full[0], atol=1e-6) and torch.allclose(four[0], base[0], atol=1e-6)
    with pytest.raises(errors.FdLoraError, match="batch sizes"), h.per_sample({2: ["a", None]}):
        net(torch.randn(3, 3, 16))


def test_a_path_inside_a_fused_layer_is_refused_and_nothing_is_wrapped_twice():
    """Module paths read off the wrapped model (`0.base`) name fd-lora's own base: a TargetError naming the module
    to use, and the model keeps exactly its layers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    lora = lambda p: LoraAdapter({p: ModuleLora(torch.randn(2, 8), torch.randn(8, 2))})  # noqa: E731
    fdlora.add_adapter(model, lora("0"), "a")
    with pytest.raises(errors.TargetError, match=r"'0\.base', inside fd-lora's layer at '0'; name the module '0'"):
        fdlora.add_adapter(model, lora("0.base"), "b")
    assert sorted(fdlora.handle(model).layers) == ["0"] and type(model[0].base) is torch.nn.Linear
    x = torch.randn(3, 8)
    with torch.no_grad():
        model(x)
