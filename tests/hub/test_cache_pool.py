"""The RAM cache of converted adapters and the per-model GPU slot pool (run here on CPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from support import loras, tiny

import fdlora
from fdlora.errors import AdapterShapeError, CapacityError, NonFiniteError, UnknownAdapterError
from fdlora.hub import (
    AdapterCache,
    AdapterPool,
    LoraAdapter,
    ModuleLora,
    add_to_pools,
    align_paths,
    load_adapters,
    load_many,
    pack_adapters,
    to_device,
)
from fdlora.hub import load as load_module
from fdlora.layers import FdLoraHandle

PATHS = ("layers.0.q_proj", "layers.1.q_proj", "layers.2.fc")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"q_proj": torch.nn.Linear(16, 16),
                                                               "fc": torch.nn.Linear(16, 16)}) for _ in range(3))

    def forward(self, x):
        for b in self.layers:
            x = torch.tanh(b["q_proj"](x)) + b["fc"](x)
        return x


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))


def write_lora(d, seed, rank=2):
    d.mkdir(parents=True, exist_ok=True)
    save_file(loras.peft_state(loras.make_lora({p: (16, 16) for p in PATHS}, rank=rank, seed=seed)),
              d / "pytorch_lora_weights.safetensors")
    return d


def no_disk(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("read a file")
    monkeypatch.setattr(load_module, "read_weights", refuse)


# --- RAM cache -----------------------------------------------------------------------------------
def test_cache_hit_skips_read_and_convert(tmp_path, monkeypatch):
    d = write_lora(tmp_path / "a", 0)
    ram = AdapterCache(max_bytes=1 << 20)
    first, r1 = load_adapters(d, cache=ram, name="one")
    no_disk(monkeypatch)
    again, r2 = load_adapters(d, cache=ram, name="two")
    assert r2.from_cache and not r1.from_cache and (ram.hits, ram.misses) == (1, 1)
    assert again["model"].name == "two" and first["model"].name == "one"  # fresh objects, shared tensors
    assert again["model"].modules["layers.0.q_proj"].A is first["model"].modules["layers.0.q_proj"].A


def test_cache_key_has_dtype_and_the_file_identity(tmp_path):
    d = write_lora(tmp_path / "a", 0)
    ram = AdapterCache(max_bytes=1 << 20)
    load_adapters(d, cache=ram)
    h, _ = load_adapters(d, cache=ram, dtype=torch.float16)
    assert len(ram) == 2 and h["model"].modules["layers.0.q_proj"].A.dtype == torch.float16
    write_lora(d, 1)  # same path, new bytes: a new entry, not a stale hit
    new, report = load_adapters(d, cache=ram)
    assert not report.from_cache and len(ram) == 3


def test_cache_evicts_least_recently_used_within_budget(tmp_path):
    dirs = [write_lora(tmp_path / str(i), i) for i in range(3)]
    one = load_adapters(dirs[0], cache=None)[0]["model"].nbytes()
    ram = AdapterCache(max_bytes=int(2.5 * one))
    load_adapters(dirs[0], cache=ram)
    load_adapters(dirs[1], cache=ram)
    load_adapters(dirs[0], cache=ram)  # 0 is now the most recent
    load_adapters(dirs[2], cache=ram)  # evicts 1
    assert ram.evictions == 1 and ram.nbytes <= ram.max_bytes
    assert load_adapters(dirs[0], cache=ram)[1].from_cache and not load_adapters(dirs[1], cache=ram)[1].from_cache
    tiny = AdapterCache(max_bytes=one // 2)
    load_adapters(dirs[0], cache=tiny)
    assert len(tiny) == 0  # an entry above the whole budget is not cached


def test_pack_adapters_is_one_buffer_with_equal_values(tmp_path):
    adapters, _ = load_adapters(write_lora(tmp_path / "a", 0), cache=None)
    packed = pack_adapters(adapters, pin=False)
    mods, orig = packed["model"].modules, adapters["model"].modules
    ptrs = {t.untyped_storage().data_ptr() for m in mods.values() for t in (m.A, m.B)}
    assert len(ptrs) == 1 and all(torch.equal(mods[p].A, orig[p].A) and torch.equal(mods[p].B, orig[p].B)
                                  for p in orig)


@pytest.mark.parametrize("packed", [True, False])
def test_to_device_checks_finite_in_one_pass(packed):
    g = torch.Generator().manual_seed(0)
    a = LoraAdapter({"a": ModuleLora(torch.randn(3, 5, generator=g), torch.randn(7, 3, generator=g)),
                     "b": ModuleLora(torch.randn(2, 5, generator=g), torch.randn(7, 2, generator=g))}, name="x")
    host = pack_adapters({"": a}, pin=False)[""] if packed else a
    if packed:  # NaN bytes in the alignment padding after a.A (60 of 64 bytes used) must not count
        flat = torch.empty(0, dtype=torch.uint8).set_(host.modules["a"].A.untyped_storage())
        flat[60:64] = torch.tensor([float("nan")]).view(torch.uint8)
    moved = to_device(host, "cpu", check_finite=True)
    assert all(m.finite for m in moved.modules.values()) and all(m.finite for m in host.modules.values())
    assert all(torch.equal(moved.modules[p].A, a.modules[p].A) and torch.equal(moved.modules[p].B, a.modules[p].B)
               for p in a.modules)
    bad = pack_adapters({"": a}, pin=False)[""] if packed else LoraAdapter(
        {p: ModuleLora(m.A.clone(), m.B.clone()) for p, m in a.modules.items()}, name="x")
    bad.modules["b"].B[1, 1] = float("inf")
    with pytest.raises(NonFiniteError, match=r"b\.B"):
        to_device(bad, "cpu", check_finite=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_cache_pins_on_cuda(tmp_path):
    adapters, _ = load_adapters(write_lora(tmp_path / "a", 0), cache=AdapterCache(max_bytes=1 << 20))
    assert adapters["model"].modules["layers.0.q_proj"].A.is_pinned()


def test_load_many_names_and_progress(tmp_path, capsys):
    dirs = {f"style{i}": write_lora(tmp_path / str(i), i) for i in range(3)}
    out = load_many(dirs, cache=None)
    assert list(out) == list(dirs) and all(a["model"].name == n for n, (a, _) in out.items())
    assert "fd-lora adapters" in capsys.readouterr().err


# --- the slot pool -------------------------------------------------------------------------------
def reference(adapters: dict, names, weights) -> torch.Tensor:
    """Output with exactly `names` loaded straight into a fresh model (no pool, no eviction)."""
    m = Net()
    for n in names:
        fdlora.add_adapter(m, adapters[n], n, max_slots=4)
    fdlora.set_adapters(m, names, weights)
    with torch.no_grad():
        return m(X)


@pytest.fixture()
def five(tmp_path):
    return {f"a{i}": load_adapters(write_lora(tmp_path / str(i), 10 + i), cache=None)[0]["model"] for i in range(5)}


def test_more_adapters_than_slots(five, monkeypatch):
    model = Net()
    pool = AdapterPool(FdLoraHandle(model, max_slots=2))
    for name, adapter in five.items():
        pool.add(name, adapter)
    assert pool.resident() == ["a3", "a4"] and pool.evictions == 3 and len(pool.known()) == 5
    no_disk(monkeypatch)  # evicted adapters come back from RAM
    for names, weights in ((["a0"], None), (["a1", "a4"], [0.5, 1.5]), (["a0", "a2"], [1.0, -1.0]), (["a4"], None)):
        pool.set_adapters(names, weights)
        with torch.no_grad():
            torch.testing.assert_close(model(X), reference(five, names, weights), rtol=1e-5, atol=1e-5)
    assert pool.reloads >= 3 and len(pool.resident()) == 2


def test_active_adapters_are_not_evicted_by_add(five):
    pool = AdapterPool(FdLoraHandle(Net(), max_slots=2))
    pool.add("a0", five["a0"])
    pool.add("a1", five["a1"])
    pool.set_adapters(["a0", "a1"])
    with pytest.raises(CapacityError, match="active"):
        pool.add("a2", five["a2"])
    assert pool.known() == ["a0", "a1"] and pool.handle.active_adapters() == ["a0", "a1"]
    pool.set_adapters(["a0"])
    pool.add("a2", five["a2"])  # a1 is inactive now: it makes room
    with pytest.raises(CapacityError, match="max_slots"):
        pool.set_adapters(["a0", "a1", "a2"])


def test_per_sample_after_ensure(five):
    model = Net()
    pool = AdapterPool(FdLoraHandle(model, max_slots=2))
    for n in ("a0", "a1", "a2"):
        pool.add(n, five[n])
    pool.ensure(["a0", "a2"])
    with pool.handle.per_sample(["a0", "a2"]), torch.no_grad():
        y = model(torch.stack([X[0], X[1]]))
    with torch.no_grad():
        torch.testing.assert_close(y[0], reference(five, ["a0"], None)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y[1], reference(five, ["a2"], None)[1], rtol=1e-5, atol=1e-5)


def test_delete_and_unknown(five):
    pool = AdapterPool(FdLoraHandle(Net(), max_slots=2))
    pool.add("a0", five["a0"])
    pool.delete("a0")
    assert pool.known() == [] and pool.resident() == []
    with pytest.raises(UnknownAdapterError):
        pool.set_adapters(["a0"])


def test_add_to_pools_is_all_or_nothing(five):
    pools = {"unet": AdapterPool(FdLoraHandle(Net())), "text_encoder": AdapterPool(FdLoraHandle(Net()))}
    before = tiny.snapshot(pools["unet"].handle.model)
    bad = LoraAdapter({"layers.0.q_proj": module(8)})
    with pytest.raises(AdapterShapeError):
        add_to_pools(pools, {"unet": five["a0"], "text_encoder": bad}, "style")
    assert pools["unet"].known() == [] and pools["unet"].handle.list_adapters() == []
    assert tiny.same_snapshot(before, tiny.snapshot(pools["unet"].handle.model))  # not even a module swapped
    add_to_pools(pools, {"unet": five["a0"], "text_encoder": five["a1"]}, "style", activate=True)
    assert all(p.handle.active_adapters() == ["style"] for p in pools.values())


def test_a_failed_load_evicts_nothing(five):
    pools = {"unet": AdapterPool(FdLoraHandle(Net(), max_slots=2)), "text_encoder": AdapterPool(FdLoraHandle(Net()))}
    unet = pools["unet"]
    unet.add("a0", five["a0"])
    unet.add("a1", five["a1"])  # full, a0 inactive: the next good load would evict it
    before = tiny.snapshot(unet.handle.model)
    bad = LoraAdapter({"layers.0.q_proj": module(8), "layers.2.fc": module(8)})
    for load in (lambda: unet.add("a2", bad),  # bad shapes
                 lambda: add_to_pools(pools, {"unet": five["a2"], "text_encoder": bad}, "a2")):  # bad elsewhere
        with pytest.raises(AdapterShapeError, match=r"2 modules(?s:.*)layers\.0\.q_proj(?s:.*)layers\.2\.fc"):
            load()
        assert unet.resident() == ["a0", "a1"] and unet.evictions == 0 and unet.known() == ["a0", "a1"]
        assert tiny.same_snapshot(before, tiny.snapshot(unet.handle.model))
    unet.add("a2", five["a2"])  # a good one still makes room
    assert unet.resident() == ["a1", "a2"] and unet.evictions == 1


def module(k: int) -> ModuleLora:
    return ModuleLora(torch.ones(2, k), torch.ones(16, 2))


def test_align_paths_fits_text_model_prefix():
    a = LoraAdapter({"text_model.encoder.layers.0.q": module(4), "encoder.layers.1.q": module(4)})
    fitted = align_paths(a, {"encoder.layers.0.q", "text_model.encoder.layers.1.q"})
    assert set(fitted.modules) == {"encoder.layers.0.q", "text_model.encoder.layers.1.q"}
    assert align_paths(a, set(a.modules)) is a


def test_pack_adapters_zeroes_its_padding(monkeypatch):
    """Padding between packed tensors is zero even where the fresh buffer held NaN bytes (torch.empty poisoned), so
    stage's one-pass finite check over the buffer settles a clean adapter without the exact host check."""
    real_empty = torch.empty

    def poisoned(*a, **kw):
        return real_empty(*a, **kw).fill_(255)  # (all-ones bytes: a NaN in every float dtype)

    g = torch.Generator().manual_seed(0)
    a = LoraAdapter({"a": ModuleLora(torch.randn(3, 5, generator=g), torch.randn(7, 3, generator=g)),
                     "b": ModuleLora(torch.randn(2, 5, generator=g), torch.randn(7, 2, generator=g))}, name="x")
    monkeypatch.setattr(torch, "empty", poisoned)
    host = pack_adapters({"": a}, pin=False)[""]
    monkeypatch.setattr(torch, "empty", real_empty)
    flat = torch.empty(0, dtype=torch.uint8).set_(host.modules["a"].A.untyped_storage())
    used = torch.zeros(flat.numel(), dtype=torch.bool)
    base = flat.data_ptr()
    for m in host.modules.values():
        for t in (m.A, m.B):
            used[t.data_ptr() - base:t.data_ptr() - base + t.nbytes] = True
    assert (~used).sum() > 0 and bool((flat[~used] == 0).all())  # (3x5 and 7x3 fp32 leave padding)
    exact = []
    monkeypatch.setattr(LoraAdapter, "check_finite", lambda self, name=None: exact.append(name))
    moved = to_device(host, "cpu", check_finite=True)
    assert exact == [] and all(m.finite for m in moved.modules.values())
    assert all(torch.equal(moved.modules[p].A, a.modules[p].A) and torch.equal(moved.modules[p].B, a.modules[p].B)
               for p in a.modules)
