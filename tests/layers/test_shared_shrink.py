"""One shrink for layers that read one input (fdlora.layers.modules.shared_shrink): q/k/v and gate/up of a tiny Llama, q/k/v/proj_mlp
and the context projections of a tiny Flux transformer.

Every case runs the model three ways on identical weights: PEFT (diffusers+PEFT for Flux), fd-lora with the groups
and fd-lora without them, in blend, per-sample and per-row modes; the groups must give the ungrouped outputs and
PEFT's, and must have run one shrink per group per forward (per row: above shared.FEW_ROWS rows, which the tiny
models reach by lowering it; at or below it the groups decline). Staleness cases change x or a bank between two members'
calls and check that h is recomputed. The Triton cases run the same layers under TRITON_INTERPRET=1 in a child
process (test_triton_under_the_interpreter), against a float64 oracle.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import fdlora
from fdlora import env
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.kernels import registry
from fdlora.layers.modules import shared_shrink as shared
from fdlora.layers.modules.shared_shrink import ShrinkGroup
from fdlora.testing import poisoned_empty

peft = pytest.importorskip("peft")
from fdlora.integrations.transformers import adapter_from_peft  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
INTERPRET = env.triton_interpret()


@pytest.fixture(scope="module", autouse=True)
def torch_backend():
    """The torch backend for the models this file builds (its module-scoped ones too), whatever TRITON_INTERPRET
    says: under it, auto would pick Triton on the CPU, whose lora_linear serves plain Linear bases without the
    groups. The interpreted cases ask for Triton themselves (fdlora.use_backend("triton") inside)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_layers", weakref.WeakSet())  # other files' live models keep their backends
        with fdlora.use_backend("torch"):
            yield


def _randomize(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def groups_of(model: nn.Module) -> list[ShrinkGroup]:
    seen = {}
    for layer in fdlora.handle(model).layers.values():
        g = layer.__dict__.get("shrink_group")
        if g is not None:
            seen[id(g)] = g
    return list(seen.values())


def counts(model: nn.Module) -> tuple[int, int]:
    gs = groups_of(model)
    return sum(g.shrinks for g in gs), sum(g.expands for g in gs)


def run(model, fn, grouped: bool, monkeypatch):
    monkeypatch.setattr(shared, "ENABLED", grouped)
    with torch.no_grad():
        return fn()


# --- tiny Llama: q/k/v (GQA: k, v narrower) and gate/up ---------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = LlamaForCausalLM(cfg).eval()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                  init_lora_weights=False), adapter_name="a")
    pm.add_adapter("b", peft.LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"],
                                        init_lora_weights=False))
    _randomize(pm, 1)
    pm.eval()
    fd = copy.deepcopy(base)
    fdlora.inject(fd, targets, max_slots=3, max_rank=16)
    for name in ("a", "b"):
        fdlora.add_adapter(fd, adapter_from_peft(pm, name), name)
    ids = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(2))
    return pm, fd, ids


def test_llama_layers_are_grouped_by_the_table(llama):
    _, fd, _ = llama
    got = sorted(tuple(m.path.rsplit(".", 1)[-1] for m in g.members) for g in groups_of(fd))
    assert got == [("gate_proj", "up_proj")] * 2 + [("q_proj", "k_proj", "v_proj")] * 2
    assert fdlora.handle(fd).layers["model.layers.0.self_attn.o_proj"].__dict__["shrink_group"] is None


LLAMA_CASES = [
    pytest.param("blend", ["a"], id="blend-a"),
    pytest.param("blend", ["a", "b"], id="blend-a0.7-b-0.4"),
    pytest.param("samples", ["a", None, "b"], id="per-sample-a-base-b"),
    pytest.param("rows", ["a", None, "b"], id="per-row-a-base-b"),
]


@pytest.mark.parametrize("mode,names", LLAMA_CASES)
def test_llama_grouped_equals_ungrouped_and_peft(llama, mode, names, monkeypatch):
    pm, fd, ids = llama
    B, T = ids.shape
    monkeypatch.setattr(shared, "FEW_ROWS", B * T - 1)  # per row: the group's smallest call (15 rows: prefill-like)
    if mode == "blend":
        weights = [1.0] if len(names) == 1 else [0.7, -0.4]
        fdlora.set_adapters(fd, names, weights)
        if len(names) == 1:
            pm.base_model.set_adapter(names[0])
            with torch.no_grad():
                want = pm(ids).logits
        else:
            want = None  # PEFT has no weighted blend of live adapters; the ungrouped path is the reference

        def call():
            return fd(ids).logits
    else:
        fdlora.set_adapters(fd, ["a"])
        spec = [n or "__base__" for n in names]
        with torch.no_grad():
            want = pm(ids, adapter_names=spec).logits
        rows = [n for n in names for _ in range(T)]

        def call():
            ctx = fdlora.per_sample(fd, names) if mode == "samples" else fdlora.per_row(fd, rows)
            with ctx:
                return fd(ids).logits
    before = counts(fd)
    grouped = run(fd, call, True, monkeypatch)
    shrinks, expands = (a - b for a, b in zip(counts(fd), before))
    assert (shrinks, expands) == (4, 10), "one shrink per group (2 layers x {qkv, gate/up}), one expand per member"
    plain = run(fd, call, False, monkeypatch)
    assert counts(fd) == (before[0] + 4, before[1] + 10), "ENABLED=False must leave the groups out"
    assert not grouped.isnan().any()
    scale = plain.abs().max()
    assert (grouped - plain).abs().max() <= 1e-5 * scale
    if want is not None:
        assert (grouped - want).abs().max() <= 1e-4 * scale


def test_llama_per_row_at_few_rows_declines_the_group(llama, monkeypatch):
    """Per-row calls of at most FEW_ROWS rows (decode) take each member's own lora_delta_rows: no shrink, no expand,
    the ungrouped outputs."""
    _, fd, ids = llama
    fdlora.set_adapters(fd, ["a"])
    rows = [n for n in ("a", None, "b") for _ in range(ids.shape[1])]
    assert len(rows) <= shared.FEW_ROWS

    def call():
        with fdlora.per_row(fd, rows):
            return fd(ids).logits
    before = counts(fd)
    grouped = run(fd, call, True, monkeypatch)
    assert counts(fd) == before
    assert torch.equal(grouped, run(fd, call, False, monkeypatch))


def test_deep_copied_model_has_its_own_groups(llama, monkeypatch):
    """A deep copy of a loaded model carries groups of its own layers, without the original's caches."""
    _, fd, ids = llama
    fdlora.set_adapters(fd, ["a", "b"], [0.5, 1.0])
    with torch.no_grad():
        want = fd(ids).logits
    for twin in (copy.deepcopy(fd),):
        layers = fdlora.handle(twin).layers
        for g in groups_of(twin):
            assert all(layers[m.path] is m for m in g.members) and g._h is None
        before = counts(twin)
        got = run(twin, lambda t=twin: t(ids).logits, True, monkeypatch)
        assert counts(twin)[0] == before[0] + 4
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


# --- staleness: h is never served for another x or another bank -----------------------------------------------
class QKV(nn.Module):
    """Three projections of one input, as a self-attention has (no rule table needed: grouped explicitly)."""

    def __init__(self, K: int, N: tuple[int, ...], linear=nn.Linear) -> None:
        super().__init__()
        self.q, self.k, self.v = (linear(K, n) for n in N)


def qkv_model(dtype=torch.float32, linear=nn.Linear, K=24, N=(32, 16, 16), slots=2, device="cpu"):
    torch.manual_seed(0)
    net = QKV(K, N, linear).to(device, dtype)
    fdlora.inject(net, ["q", "k", "v"], max_slots=slots, max_rank=16)
    g = torch.Generator().manual_seed(1)
    for s in range(slots):
        mods = {p: ModuleLora(torch.randn(4 + 4 * s, K, generator=g) / K ** 0.5,
                              torch.randn(n, 4 + 4 * s, generator=g), alpha=8.0) for p, n in zip("qkv", N)}
        fdlora.add_adapter(net, LoraAdapter(mods), f"s{s}")
    fdlora.set_adapters(net, [f"s{s}" for s in range(slots)], [1.0, -0.5, 0.25][:slots])
    layers = fdlora.handle(net).layers
    group = ShrinkGroup([layers[p] for p in "qkv"])
    return net, group


def test_inplace_change_of_x_between_members_recomputes_h(monkeypatch):
    net, group = qkv_model()
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        q = net.q(x)
        x.mul_(-2.0)  # the model (or a hook) changes x in place before k: k must not see the old h
        k, v = net.k(x), net.v(x)
    assert group.shrinks == 2 and group._h is not None  # recomputed for k; kept (q has not used the new x)
    monkeypatch.setattr(shared, "ENABLED", False)
    with torch.no_grad():
        want_k, want_v = net.k(x), net.v(x)
        want_q = net.q(x / -2.0)
    for a, b in ((q, want_q), (k, want_k), (v, want_v)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_bank_write_between_members_recomputes_h():
    net, group = qkv_model()
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        net.q(x)
        h_q = group._h[2]
        layer = fdlora.handle(net).layers["k"]
        layer.bank.A[0].mul_(3.0)  # a write between two members' calls (a load racing a forward, by hand)
        layer.bank.mark(0, layer.bank.host_ranks[0])
        k = net.k(x)
    assert group.shrinks == 2 and group._h[2] is not h_q
    want = layer.base(x)
    b = layer.bank
    S, R = b.extent()
    scale = layer.scale_blend[:S]
    h = (x.double() @ b.A[:S, :R].double().reshape(S * R, -1).t()).view(-1, S, R) * scale.double()[:, None]
    want = want.double() + h.reshape(-1, S * R) @ b.B[:, :S, :R].double().reshape(b.B.shape[0], -1).t()
    assert (k.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_row_slots_rewritten_between_members_recompute_h(monkeypatch):
    """Per row, h (by row: each row's own slot only) and the one-hot row weights follow the row slots: slots written in
    place between two members' calls (same tensor, new version) make the next member recompute them."""
    monkeypatch.setattr(shared, "FEW_ROWS", 0)
    net, group = qkv_model()
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(3))
    first, then = ["s0", None, "s1", "s1", "s0", None], ["s1", "s0", None, "s0", "s1", "s1"]
    with torch.no_grad(), fdlora.per_row(net, first):
        q = net.q(x)
        with fdlora.per_row(net, then):  # the same row_slot tensor, written in place
            k = net.k(x)
    assert group.shrinks == 2
    monkeypatch.setattr(shared, "ENABLED", False)
    with torch.no_grad():
        with fdlora.per_row(net, first):
            want_q = net.q(x)
        with fdlora.per_row(net, then):
            want_k = net.k(x)
    for a, b in ((q, want_q), (k, want_k)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_row_onehot_is_kept_while_the_row_slots_stay_and_follows_them():
    """The state's one-hot row weights (every group's per-row expand weights) are built once while the row slots are the
    same tensor at the same version, and rebuilt when they are written in place, replaced, or asked for more slots."""
    from fdlora.layers.state import ModelState

    st = ModelState(layers=1, slots=4)
    st.set_row_slot(torch.tensor([2, -1, 0, 2], dtype=torch.int32))
    dev = torch.device("cpu")

    def oracle(rows, S):
        return torch.tensor([[1.0 if r == s else 0.0 for s in range(S)] for r in rows])

    w = st.row_onehot(dev, 3)
    assert torch.equal(w, oracle([2, -1, 0, 2], 3))
    assert st.row_onehot(dev, 3) is w  # kept
    assert torch.equal(st.row_onehot(dev, 4), oracle([2, -1, 0, 2], 4))  # more slots: rebuilt
    st.set_row_slot(torch.tensor([1, 1, -1, 3], dtype=torch.int32))  # same shape: written in place
    assert torch.equal(st.row_onehot(dev, 4), oracle([1, 1, -1, 3], 4))
    st.set_row_slot(torch.tensor([0, 3], dtype=torch.int32))  # another shape: a new tensor
    assert torch.equal(st.row_onehot(dev, 4), oracle([0, 3], 4))


def test_another_tensor_with_the_same_address_and_version_recomputes_h():
    """Another tensor object over the same memory, version and shape (as a freed x whose memory a new x reuses):
    address and version alone are not trusted, the weak reference to x tells them apart."""
    net, group = qkv_model()
    with torch.no_grad():
        x = torch.randn(6, 24)
        net.q(x)
        other = x.view(6, 24)
        assert other.data_ptr() == x.data_ptr() and other._version == x._version and other is not x
        net.k(other)
    assert group.shrinks == 2


def test_any_member_order_and_repeats_share_one_shrink():
    net, group = qkv_model()
    x = torch.randn(6, 24)
    with torch.no_grad():
        net.v(x), net.v(x), net.q(x)
        assert group.shrinks == 1 and group._h is not None
        net.k(x)
    assert group.shrinks == 1 and group.expands == 4 and group._h is None


def test_blend_shrinks_only_the_active_slots(monkeypatch):
    """Three adapters loaded, the last one active: the stack holds that slot of each member only."""
    net, group = qkv_model(slots=3)
    fdlora.set_adapters(net, ["s2"], [0.8])
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(4))
    grouped = run(net, lambda: [net.q(x), net.k(x), net.v(x)], True, monkeypatch)
    st = group._stack
    assert (st.lo, st.hi) == (2, 3) and st.A.shape[:2] == (3, st.R) and st.R == 16 and not st.by_row
    plain = run(net, lambda: [net.q(x), net.k(x), net.v(x)], False, monkeypatch)
    for a, b in zip(grouped, plain):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_autograd_and_inference_mode_take_the_regular_path():
    net, group = qkv_model()
    x = torch.randn(6, 24, requires_grad=True)
    net.q(x).sum().backward()
    with torch.inference_mode():
        net.k(torch.randn(6, 24))
    assert group.shrinks == 0 and x.grad is not None


class Summed(QKV):
    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], -1)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "not-frozen"])
def test_compiled_group_members_trace_without_breaks_or_recompiles(frozen):
    """Compiled calls never take the group (a traced graph must not depend on a host-side cache): fullgraph traces
    through the hook, switching adapters does not recompile, and outputs equal the eager grouped ones."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Summed(24, (32, 16, 16))
    h = fdlora.inject(net, ["q", "k", "v"], max_slots=2, max_rank=16)
    g = torch.Generator().manual_seed(1)
    for s in range(2):
        h.add_adapter(LoraAdapter({p: ModuleLora(torch.randn(4, 24, generator=g) / 5, torch.randn(n, 4, generator=g))
                                   for p, n in zip("qkv", (32, 16, 16))}), f"s{s}")
    group = ShrinkGroup([h.layers[p] for p in "qkv"])
    if frozen:
        h.freeze()
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 24)
    old = torch._dynamo.config.error_on_recompile
    try:
        with torch.no_grad():
            compiled(x)
            torch._dynamo.config.error_on_recompile = True
            for names, w in ((["s0"], [1.0]), (["s0", "s1"], [0.5, -1.0])):
                h.set_adapters(names, w)
                got = compiled(x)
                before = group.shrinks
                want = net(x)  # eager: the group path (unless frozen)
                assert group.shrinks == before + (0 if frozen else 1)
                assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    finally:
        torch._dynamo.config.error_on_recompile = old
    assert group.expands == (0 if frozen else 6)


# --- Flux: q/k/v/proj_mlp of single blocks, q/k/v and the context projections of double blocks --------------------
@pytest.fixture(scope="module")
def flux():
    pytest.importorskip("diffusers")
    from tests.support.tiny import flux_inputs, flux_transformer

    targets = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "proj_mlp", "to_out.0"]
    base = flux_transformer()
    with_peft = copy.deepcopy(base)
    with_peft.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False),
                          adapter_name="a")
    with_peft.add_adapter(peft.LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "proj_mlp"],
                                          init_lora_weights=False), adapter_name="b")
    _randomize(with_peft, 4)
    fd = copy.deepcopy(base)
    fdlora.inject(fd, targets, max_slots=2, max_rank=16)
    for name in ("a", "b"):
        fdlora.add_adapter(fd, adapter_from_peft(with_peft, name), name)
    return with_peft, fd, flux_inputs(fd, batch=2)


def test_flux_groups(flux):
    _, fd, _ = flux
    got = sorted(tuple(m.path for m in g.members) for g in groups_of(fd))
    assert got == [
        ("single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k",
         "single_transformer_blocks.0.attn.to_v", "single_transformer_blocks.0.proj_mlp"),
        ("transformer_blocks.0.attn.add_q_proj", "transformer_blocks.0.attn.add_k_proj",
         "transformer_blocks.0.attn.add_v_proj"),
        ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v"),
    ]


@pytest.mark.parametrize("mode", ["blend", "samples"])
def test_flux_grouped_equals_ungrouped_and_diffusers_peft(flux, mode, monkeypatch):
    with_peft, fd, inputs = flux
    fdlora.set_adapters(fd, ["a"])
    if mode == "blend":
        with_peft.set_adapters(["a"])
        with torch.no_grad():
            want = with_peft(**inputs).sample

        def call():
            return fd(**inputs).sample
    else:
        want = None
        with torch.no_grad():  # diffusers+PEFT: each sample alone with its adapter
            outs = []
            for i, name in enumerate(("a", "b")):
                with_peft.set_adapters([name])
                one = {k: (v[i:i + 1] if k not in ("img_ids", "txt_ids") else v) for k, v in inputs.items()}
                outs.append(with_peft(**one).sample)
            want = torch.cat(outs)

        def call():
            with fdlora.per_sample(fd, ["a", "b"]):
                return fd(**inputs).sample
    before = counts(fd)
    grouped = run(fd, call, True, monkeypatch)
    assert tuple(a - b for a, b in zip(counts(fd), before)) == (3, 10)
    plain = run(fd, call, False, monkeypatch)
    scale = plain.abs().max()
    assert not grouped.isnan().any()
    assert (grouped - plain).abs().max() <= 1e-5 * scale
    assert (grouped - want).abs().max() <= 1e-4 * scale


# --- Triton: the same group path on the Triton backend (interpreter on CPU, marked gpu on CUDA) ---------------------
class Sub(nn.Linear):
    """A Linear the fused layer does not run as one lora_linear op (as a quantized base): the per-call delta path."""


TRITON_CASES = [
    pytest.param(torch.float32, "blend", id="fp32-blend"),
    pytest.param(torch.float32, "samples", id="fp32-per-sample"),
    pytest.param(torch.float16, "rows", id="fp16-per-row"),
    pytest.param(torch.bfloat16, "rows", id="bf16-per-row"),
    pytest.param(torch.float32, "rows-shared-A", id="fp32-per-row-shared-A"),
    pytest.param(torch.float32, "rows-few", id="fp32-per-row-few-rows-declined"),
]
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}  # of the output's max: ~10 ulps of its dtype


def _triton_case(dtype, mode, device, monkeypatch):
    """q/k/v on the Triton backend against a float64 oracle. Per row, above FEW_ROWS (lowered to 4 for 10 rows) the
    group shrinks by row over a slot-major stack (one copy of A when q, k and v share it), with unwritten h poisoned;
    at or below it the group declines."""
    monkeypatch.setattr(registry, "_layers", weakref.WeakSet())  # other tests' live models keep their backends
    if mode in ("rows", "rows-shared-A"):
        monkeypatch.setattr(shared, "FEW_ROWS", 4)
    with fdlora.use_backend("triton"):
        net, group = qkv_model(dtype, Sub, K=40, N=(48, 24, 24), device=device)  # (pinned triton refuses a CPU bank)
        x = torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(5)).to(device, dtype)
        layers = fdlora.handle(net).layers
        assert all(layers[p].selection.name == "triton" for p in "qkv")
        if mode == "rows-shared-A":
            with torch.no_grad():
                for p in "kv":  # q's A in k and v too, every slot (kohya's fused qkv)
                    b = layers[p].bank
                    b.A.copy_(layers["q"].bank.A)
                    for s in range(2):
                        b.mark(s, b.host_ranks[s])
        if mode == "blend":
            ctx, w = torch.no_grad(), torch.tensor([[1.0, -0.5]] * 10)
        elif mode == "samples":
            ctx, w = fdlora.per_sample(net, ["s0", "s1"]), torch.tensor([[1.0, 0.0]] * 5 + [[0.0, 1.0]] * 5)
        else:
            rows = ["s1", None, "s0", "s0", None, "s1", "s1", None, "s0", "s1"]
            ctx = fdlora.per_row(net, rows)
            w = torch.tensor([[float(r == "s0"), float(r == "s1")] for r in rows])
        with torch.no_grad(), ctx, poisoned_empty():
            out = [net.q(x), net.k(x), net.v(x)]
        if mode == "rows-few":
            assert (group.shrinks, group.expands) == (0, 0)
        else:
            assert group.shrinks == 1 and group.expands == 3
        if mode in ("rows", "rows-shared-A"):  # slot-major: [S, n*R, K], or [S, R, K] for one shared A
            st = group._stack
            assert st.by_row and st.A.shape[:2] == (2, 16 if mode == "rows-shared-A" else 48)
        for p, y in zip("qkv", out):
            layer = layers[p]
            b, base = layer.bank, layer.base
            S, R, K = b.A.shape
            x2 = x.reshape(-1, K).double().cpu()
            unit = layer.scale_unit.double().cpu()
            h = (x2 @ b.A.double().cpu().reshape(S * R, K).t()).view(-1, S, R) * (w.double() * unit)[:, :, None]
            want = (x2 @ base.weight.double().cpu().t() + base.bias.double().cpu()
                    + h.reshape(-1, S * R) @ b.B.double().cpu().reshape(-1, S * R).t())
            got = y.reshape(-1, y.shape[-1]).double().cpu()
            tol = TOL[dtype] * want.abs().max()
            assert not got.isnan().any() and (got - want).abs().max() <= tol, p


@pytest.mark.skipif(not INTERPRET, reason="runs in the interpreter's child process")
@pytest.mark.parametrize("dtype,mode", TRITON_CASES)
def test_triton_group_matches_oracle_interpreted(dtype, mode, monkeypatch):
    _triton_case(dtype, mode, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,mode", TRITON_CASES)
def test_triton_group_matches_oracle_cuda(dtype, mode, monkeypatch):
    pytest.importorskip("triton")
    _triton_case(dtype, mode, "cuda", monkeypatch)  # per row: eager decode (fdlora.layers.fastpath.decode) hands it over


@pytest.mark.skipif(INTERPRET, reason="this process already interprets")
def test_triton_under_the_interpreter():
    pytest.importorskip("triton")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "-k", "interpreted",
           str(Path(__file__))]
    proc = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"interpreter tests failed (rc={proc.returncode}):\n{out[-6000:]}"
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) == len(TRITON_CASES), out[-3000:]


# --- kohya Flux: one lora_down for q, k, v (img_attn qkv) and q, k, v, proj_mlp (single blocks' linear1) -------------
def test_kohya_fused_qkv_shrinks_its_one_A_once(monkeypatch, tmp_path):
    """diffusers' converter gives to_q / to_k / to_v the file's one lora_down each; the group sees the members' A are
    equal and stacks it once (h of rank r, not 3r), and the output is diffusers+PEFT's. (Single blocks' linear1 goes
    the same way; diffusers splits it at full Flux widths only, so the tiny model cannot carry one.) On the torch
    backend, whatever TRITON_INTERPRET says: Triton's lora_linear serves plain Linear bases without the group."""
    pytest.importorskip("diffusers")
    from diffusers.loaders import FluxLoraLoaderMixin
    from safetensors.torch import save_file

    from fdlora.hub import AdapterPool, load_adapters
    from fdlora.layers import FdLoraHandle
    from tests.support.tiny import flux_inputs, flux_transformer

    monkeypatch.setattr(registry, "_layers", weakref.WeakSet())  # other tests' live models keep their backends
    with fdlora.use_backend("torch"):
        flux = flux_transformer()
        D = 32
        g = torch.Generator().manual_seed(7)
        sd = {}
        for name, N in (("lora_unet_double_blocks_0_img_attn_qkv", 3 * D),):
            sd[f"{name}.lora_down.weight"] = torch.randn(6, D, generator=g) / D ** 0.5
            sd[f"{name}.lora_up.weight"] = torch.randn(N, 6, generator=g)
            sd[f"{name}.alpha"] = torch.tensor(3.0)
        path = tmp_path / "flux_lora.safetensors"
        save_file(sd, path)
        adapters, _ = load_adapters(path, cache=None)
        fd = copy.deepcopy(flux)
        handle = FdLoraHandle(fd)
        AdapterPool(handle).add("x", adapters["transformer"], activate=True)
        groups = {id(lay.shrink_group): lay.shrink_group for lay in handle.layers.values()
                  if lay.__dict__.get("shrink_group") is not None}
        assert len(groups) == 1
        ref = copy.deepcopy(flux)
        st, alphas = FluxLoraLoaderMixin.lora_state_dict(str(path), return_alphas=True)
        FluxLoraLoaderMixin.load_lora_into_transformer(st, alphas, ref, adapter_name="x")
        inputs = flux_inputs(flux)
        with torch.no_grad():
            want, base = ref(**inputs).sample, flux(**inputs).sample
        grouped = run(fd, lambda: fd(**inputs).sample, True, monkeypatch)
        for grp in groups.values():
            st = grp._stack
            S = st.hi - st.lo
            assert st.A.shape[0] == S and st.columns == [0] * len(grp.members)  # one A, every member reads the same h
            assert grp.shrinks == 1 and h_width(grp) == S * st.R
        plain = run(fd, lambda: fd(**inputs).sample, False, monkeypatch)
        scale = want.abs().max()
        assert (grouped - base).abs().max() > 1e-3 * scale
        assert (grouped - plain).abs().max() <= 1e-5 * scale and (grouped - want).abs().max() <= 1e-4 * scale


def h_width(group: ShrinkGroup) -> int:
    return group._stack.A.shape[0] * group._stack.A.shape[1]


def test_some_slots_shared_gathers_each_members_columns(monkeypatch):
    """Slot 0 shared by q, k, v (a kohya fused file), slot 1 their own (a per-module LoRA): member 0's slots come
    first in h, the others' own slot after, and k / v read theirs through a column index."""
    net, group = qkv_model()
    layers = fdlora.handle(net).layers
    with torch.no_grad():
        for p in "kv":  # slot 0's A of q, now k's and v's too: what the kohya converter loads
            b = layers[p].bank
            b.A[0].copy_(layers["q"].bank.A[0])
            b.mark(0, b.host_ranks[0])
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(9))
    grouped = run(net, lambda: [net.q(x), net.k(x), net.v(x)], True, monkeypatch)
    st = group._stack
    S = st.hi - st.lo
    assert st.A.shape[0] == S + 2 and st.columns[0] == 0 and all(isinstance(c, torch.Tensor) for c in st.columns[1:])
    plain = run(net, lambda: [net.q(x), net.k(x), net.v(x)], False, monkeypatch)
    for a, b in zip(grouped, plain):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
