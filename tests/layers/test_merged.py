"""The merged-weight cache (fdlora.layers.fastpath.merged): same outputs as the unmerged paths, every change
invalidates it, the byte budget holds, and compiled / per-sample / training calls never use it."""

from __future__ import annotations

import gc

import pytest
import torch
from support.tiny_sequential import PATHS, close, lora, net, oracle
from torch import nn

import fdlora
from fdlora.hub.adapter import LoraAdapter, ModuleLora


@pytest.fixture
def cache():
    fdlora.set_merge_cache(1 << 30)
    yield
    fdlora.set_merge_cache("auto")


def cached(model):
    return [p for p, layer in fdlora.handle(model).layers.items() if layer.merged.buf is not None]


def test_cached_output_matches_oracle_and_every_change_invalidates(cache):
    model = net()
    h = fdlora.inject(model, PATHS, max_slots=4, max_rank=8)
    a, b = lora(1), lora(2, rank=8, alpha=4.0, paths=["2"])
    x = torch.randn(5, 32)
    with torch.no_grad():
        h.add_adapter(a, "a")
        close(model(x), oracle(model, x, {"a": (a, 1.0)}))
        assert cached(model) == PATHS
        assert fdlora.merge_cache_bytes() == (32 * 48 + 48 * 40) * 4
        h.set_adapters(["a"], [0.3])
        close(model(x), oracle(model, x, {"a": (a, 0.3)}))
        h.add_adapter(b, "b", activate=False)
        h.set_adapters(["a", "b"], [0.5, -1.0])
        close(model(x), oracle(model, x, {"a": (a, 0.5), "b": (b, -1.0)}))
        h.set_multiplier(2.0)
        close(model(x), oracle(model, x, {"a": (a, 1.0), "b": (b, -2.0)}))
        h.set_multiplier(1.0)
        h.delete_adapter("a")
        close(model(x), oracle(model, x, {"b": (b, -1.0)}))
        model[2].base.weight.mul_(0.5)  # an in-place edit of the base weight
        close(model(x), oracle(model, x, {"b": (b, -1.0)}))
        h.disable()
        close(model(x), oracle(model, x, {}))
        h.enable()
        close(model(x), oracle(model, x, {"b": (b, -1.0)}))
        # the cached path gives what the per-call path gives
        y_cached = model(x)
        fdlora.set_merge_cache(0)
        assert fdlora.merge_cache_bytes() == 0 and cached(model) == []
        torch.testing.assert_close(model(x), y_cached, rtol=1e-5, atol=1e-6)


def test_budget_limits_which_layers_cache_and_restore_releases(cache):
    model = net()
    h = fdlora.inject(model, PATHS, max_slots=2, max_rank=4)
    h.add_adapter(lora(1), "a")
    fdlora.set_merge_cache(48 * 40 * 4)  # room for one layer: the first to run takes it
    x = torch.randn(3, 32)
    with torch.no_grad():
        y = model(x)
    assert cached(model) == ["0"] and fdlora.merge_cache_bytes() == 32 * 48 * 4
    close(y, oracle(model, x, {"a": (lora(1), 1.0)}))
    fdlora.handle(model).restore()
    assert fdlora.merge_cache_bytes() == 0
    fdlora.set_merge_cache("50%")
    model = net()
    fdlora.inject(model, PATHS, max_slots=2, max_rank=4).add_adapter(lora(1), "a")
    with torch.no_grad():
        model(x)
    assert fdlora.merge_cache_bytes() > 0
    del model
    gc.collect()
    assert fdlora.merge_cache_bytes() == 0  # a collected model gives its bytes back


def test_not_used_for_per_sample_training_or_with_lora_bias(cache):
    model = net()
    h = fdlora.inject(model, PATHS, max_slots=2, max_rank=4)
    a = lora(1)
    h.add_adapter(a, "a")
    x = torch.randn(4, 32)
    y = model(x)  # grad mode with trainable base weights: autograd must see W, so no cache
    assert cached(model) == [] and y.requires_grad
    close(y.detach(), oracle(model, x, {"a": (a, 1.0)}))
    with torch.no_grad():
        with h.per_sample(["a", None, "a", None]):
            y = model(x)
        assert cached(model) == []
        close(y[::2], oracle(model, x[::2], {"a": (a, 1.0)}))
        close(y[1::2], oracle(model, x[1::2], {}))
        close(model(x), oracle(model, x, {"a": (a, 1.0)}))
        assert cached(model) == PATHS
    model = net()
    g = torch.Generator().manual_seed(3)
    biased = LoraAdapter({"0": ModuleLora(a.modules["0"].A, a.modules["0"].B, None, bias=torch.randn(48, generator=g))})
    fdlora.inject(model, ["0"], max_slots=2, max_rank=4).add_adapter(biased, "b")
    with torch.no_grad():
        model(x)
    assert cached(model) == []


def test_frozen_and_compiled_calls_use_the_cache_checked_on_the_device(cache):
    """Frozen (and compiled) blend calls go through fdlora::merged_linear: the merge launches every call and skips
    on the device unless the weights or the bank changed, so every switch shows up without a host-side check
    and without recompiling; eager and frozen calls share one buffer and stay right when they alternate."""
    import torch._dynamo

    model = net()
    h = fdlora.inject(model, PATHS, max_slots=3, max_rank=8)
    a, b = lora(1), lora(2, rank=8, alpha=4.0)
    x = torch.randn(5, 32)
    with torch.no_grad():
        h.add_adapter(a, "a")
        h.freeze()
        close(model(x), oracle(model, x, {"a": (a, 1.0)}))
        assert cached(model) == PATHS
        stamps = {p: layer.merged.stamp.clone() for p, layer in h.layers.items()}
        close(model(x), oracle(model, x, {"a": (a, 1.0)}))
        assert all(torch.equal(layer.merged.stamp, stamps[p]) for p, layer in h.layers.items())
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        close(compiled(x), oracle(model, x, {"a": (a, 1.0)}))
        old = torch._dynamo.config.error_on_recompile
        torch._dynamo.config.error_on_recompile = True
        try:
            steps = [
                (lambda: h.set_adapters("a", 0.3), {"a": (a, 0.3)}),
                (lambda: h.add_adapter(b, "b", activate=False), {"a": (a, 0.3)}),
                (lambda: h.set_adapters(["a", "b"], [0.5, -1.0]), {"a": (a, 0.5), "b": (b, -1.0)}),
                (lambda: h.set_multiplier(2.0), {"a": (a, 1.0), "b": (b, -2.0)}),
                (lambda: h.delete_adapter("a"), {"b": (b, -2.0)}),
                (lambda: h.set_adapters([], []), {}),
                (lambda: h.set_adapters("b", 1.0), {"b": (b, 2.0)}),
            ]
            for step, want in steps:
                step()
                close(compiled(x), oracle(model, x, want))
                close(model(x), oracle(model, x, want))
        finally:
            torch._dynamo.config.error_on_recompile = old
        h.unfreeze()  # eager again: the host key decides, over the same buffer
        h.set_multiplier(1.0)
        close(model(x), oracle(model, x, {"b": (b, 1.0)}))
        h.freeze()
        h.set_adapters("b", 0.5)
        close(model(x), oracle(model, x, {"b": (b, 0.5)}))
        h.unfreeze()
        close(model(x), oracle(model, x, {"b": (b, 0.5)}))
        fdlora.set_merge_cache(0)  # no room: the op falls back to the per-call path
        h.freeze()
        close(model(x), oracle(model, x, {"b": (b, 0.5)}))
        assert cached(model) == []


def test_a_frozen_call_not_being_captured_skips_the_merge_launch_while_nothing_changed(cache, monkeypatch):
    """Compiled graphs run eagerly every step: their merged_linear launches no device check while the host key of
    the last merge still holds, and the first call after a switch merges (outputs against the oracle)."""
    from fdlora.layers.modules.fused import FusedLoraLinear

    model = net()
    h = fdlora.inject(model, PATHS, max_slots=3, max_rank=8)
    a = lora(1)
    x = torch.randn(5, 32)
    launches = []
    real = FusedLoraLinear.prepare_merge
    monkeypatch.setattr(FusedLoraLinear, "prepare_merge", lambda self, *a: launches.append(self.path) or real(self, *a))
    with torch.no_grad():
        h.add_adapter(a, "a")
        h.freeze()
        close(model(x), oracle(model, x, {"a": (a, 1.0)}))
        assert sorted(launches) == PATHS
        launches.clear()
        for _ in range(3):
            close(model(x), oracle(model, x, {"a": (a, 1.0)}))
        assert launches == []
        h.set_adapters("a", 0.3)
        close(model(x), oracle(model, x, {"a": (a, 0.3)}))
        assert sorted(launches) == PATHS
        h.layers["0"].base.weight.mul_(0.5)  # in place under the layer: its key moves, the other's holds
        launches.clear()
        close(model(x), oracle(model, x, {"a": (a, 0.3)}))
        assert launches == ["0"]


def test_bad_limit_names_the_fix():
    with pytest.raises(fdlora.errors.ConfigError, match="byte count"):
        fdlora.set_merge_cache("lots")
    with pytest.raises(fdlora.errors.ConfigError, match="25%"):
        fdlora.set_merge_cache(-1)


class ConvNet(nn.Module):
    """A transformers Conv1D (GPT-2, weight [K, N]) and an nn.Conv2d (kohya LoCon), each fused."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        torch.manual_seed(0)
        self.c_attn = Conv1D(24, 12)  # nf=24 out, nx=12 in
        self.conv = nn.Conv2d(3, 5, 3, padding=1, stride=2)

    def forward(self, x, img):
        return self.c_attn(x), self.conv(img)


def test_conv1d_and_conv2d_bases_cache_and_match_the_oracle(cache):
    model = ConvNet()
    g = torch.Generator().manual_seed(5)
    lin = ModuleLora(torch.randn(4, 12, generator=g) / 4, torch.randn(24, 4, generator=g) / 4, 8.0)
    conv = ModuleLora(torch.randn(4, 3, 3, 3, generator=g) / 4, torch.randn(5, 4, 1, 1, generator=g) / 4, None)
    ad = LoraAdapter({"c_attn": lin, "conv": conv})
    x, img = torch.randn(2, 7, 12), torch.randn(2, 3, 9, 9)
    W1, b1 = model.c_attn.weight.detach().double().clone(), model.c_attn.bias.detach().double()
    W2, b2 = model.conv.weight.detach().double().clone(), model.conv.bias.detach().double()
    h = fdlora.inject(model, ["c_attn", "conv"], max_slots=2, max_rank=4)
    h.add_adapter(ad, "a")
    with torch.no_grad():
        for w in (1.0, -0.4):
            h.set_adapters(["a"], [w])
            y1, y2 = model(x, img)
            d1 = w * lin.scaling() * (lin.B.double() @ lin.A.double())  # [N, K]
            d2 = w * conv.scaling() * (conv.B.double().flatten(1) @ conv.A.double().flatten(1)).view(5, 3, 3, 3)
            close(y1, x.double() @ (W1 + d1.t()) + b1)
            close(y2, torch.nn.functional.conv2d(img.double(), W2 + d2, b2, stride=2, padding=1))
        assert sorted(cached(model)) == ["c_attn", "conv"]
        fdlora.set_merge_cache(0)  # the per-call paths agree
        z1, z2 = model(x, img)
        torch.testing.assert_close(z1, y1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(z2, y2, rtol=1e-5, atol=1e-6)


def test_a_deep_copy_merges_its_own_weight_and_counts_it(cache):
    """The cache is derived state: a copied model starts empty, merges on first use, and its bytes are budgeted."""
    import copy

    model = net()
    fdlora.inject(model, PATHS, max_slots=2, max_rank=4).add_adapter(lora(1), "a")
    x = torch.randn(3, 32)
    with torch.no_grad():
        y = model(x)
        held = fdlora.merge_cache_bytes()
        twin = copy.deepcopy(model)
        assert cached(twin) == [] and fdlora.merge_cache_bytes() == held
        assert torch.equal(twin(x), y) and cached(twin) == PATHS and fdlora.merge_cache_bytes() == 2 * held
    del twin
    gc.collect()
    assert fdlora.merge_cache_bytes() == held


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_and_inductor_replays_merge_only_after_a_switch(cache):
    """On the GPU (Triton backend, bf16): a frozen model captured in a CUDA graph and compiled by inductor follows
    every switch made between replays (each checked against the float64 oracle), a replay with nothing changed
    leaves the merged buffers alone (poisoned here to prove it), and a switch merges them again."""
    import torch._dynamo

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 384), nn.Tanh(), nn.Linear(384, 320)).cuda().bfloat16()
    shapes = {"0": (256, 384), "2": (384, 320)}

    def ad(seed, rank):
        g = torch.Generator().manual_seed(seed)
        return LoraAdapter({p: ModuleLora(torch.randn(rank, k, generator=g) / k**0.5,
                                          torch.randn(n, rank, generator=g) / rank**0.5, None)
                            for p, (k, n) in shapes.items()})

    a, b = ad(1, 16), ad(2, 8)
    h = fdlora.inject(model, PATHS, max_slots=3, max_rank=16)
    h.add_adapter(a, "a")
    h.freeze()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def check(y, want):
        ref = oracle(model, x.float().cpu(), want)
        err = float((y.double().cpu() - ref).abs().max())
        assert err <= 0.03 * float(ref.abs().max()), err

    with torch.no_grad():
        model(x)  # warm: kernels compile, buffers are taken outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = model(x)
        torch._dynamo.reset()
        import importlib.util

        # inductor generates Triton code on CUDA; without triton (the CUDA C++ backend) the graph compiles whole
        # through aot_eager, which still traces the ops and their fake kernels
        compiled = torch.compile(model, fullgraph=True,
                                 backend="inductor" if importlib.util.find_spec("triton") else "aot_eager")
        prev = torch._dynamo.config.error_on_recompile
        try:
            compiled(x)
            torch._dynamo.config.error_on_recompile = True
            graph.replay()
            check(static, {"a": (a, 1.0)})
            for layer in h.layers.values():
                layer.merged.buf.fill_(float("nan"))
            graph.replay()  # nothing changed: the merges return at once, the poison stays
            assert static.isnan().all()
            for step, want in [(lambda: h.set_adapters("a", 0.5), {"a": (a, 0.5)}),
                               (lambda: h.add_adapter(b, "b", activate=False), {"a": (a, 0.5)}),
                               (lambda: h.set_adapters(["a", "b"], [0.5, -1.0]), {"a": (a, 0.5), "b": (b, -1.0)}),
                               (lambda: h.delete_adapter("a"), {"b": (b, -1.0)})]:
                step()
                graph.replay()
                check(static, want)
                check(compiled(x), want)
        finally:
            torch._dynamo.config.error_on_recompile = prev


def test_budget_counts_what_a_per_process_fraction_allows(monkeypatch):
    """Under `torch.cuda.set_per_process_memory_fraction` the copies' budget and the 1 GiB kept free count what the
    process may use, not the whole device: copies must not take the room a capped process needs for activations."""
    from types import SimpleNamespace

    from fdlora.layers.fastpath import merged

    G = 2**30
    state = {"fraction": 1.0, "reserved": 20 * G}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=100 * G))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (80 * G, 100 * G))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: state["fraction"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: state["reserved"])
    dev = torch.device("cuda", 0)
    b = merged.MergeBudget()
    b.spec = "auto"
    assert b.limit(dev) == 25 * G and b.reserve(10 * G, dev)  # uncapped: a quarter of the device, 80 GiB free
    state["fraction"], b.used[dev] = 0.3, 0  # 30 GiB for this process, 20 of them reserved already
    assert b.limit(dev) == int(0.25 * 30 * G) and merged._free_memory(dev) == 10 * G
    assert b.reserve(int(7.4 * G), dev)  # within the budget and within the cap's room
    state["reserved"] = 25 * G  # 5 GiB left under the cap: 4.5 would leave less than the 1 GiB kept free
    assert not b.reserve(int(0.2 * G), dev)  # over the budget now (7.4 + 0.2 > 7.5)
    b.used[dev] = 0
    assert not b.reserve(int(4.5 * G), dev) and b.reserve(4 * G, dev) and b.used[dev] == 4 * G


def test_set_merge_cache_returns_the_limit_it_replaces():
    """A caller that turns the cache off for a while (a memory-capped fault run, a benchmark case) puts back whatever
    the user had: "auto", a share, or a byte count, parsed as set."""
    from fdlora.layers.fastpath import merged

    original = merged.set_merge_cache("40%")
    try:
        assert merged.set_merge_cache(0) == 0.4
        assert merged.set_merge_cache(3 * 2**30) == 0
        assert merged.set_merge_cache("auto") == 3 * 2**30
    finally:
        assert merged.set_merge_cache(original) == "auto"
    assert merged.BUDGET.spec == original
