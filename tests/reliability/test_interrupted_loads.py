"""Pipeline- and model-level loads interrupted by Ctrl-C roll back like failed ones (issue 28).

A KeyboardInterrupt is not an Exception; the loads catch BaseException, so after one the name is free
for a retry and every component is bit-identical (parameters, buffers, module types).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from support.tiny import same_snapshot, snapshot

import fdlora
from fdlora.errors import PartialLoadWarning
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.hub.pool import AdapterPool
from fdlora.layers import registry_of_models
from fdlora.layers.storage.bank import AdapterBank


@pytest.fixture(scope="module")
def sd15_files(tmp_path_factory):
    from fdlora.fixtures import tiny_pipeline as tiny

    pipe = tiny.sd15()
    out = {}
    for seed in (1, 2):
        root = tmp_path_factory.mktemp(f"lora{seed}")
        for name, data in tiny.random_lora_files(pipe, seed=seed).items():
            (root / name).write_bytes(data)
        out[seed] = str(root)
    return pipe, out


def _components(pipe):
    return {c: snapshot(m) for c, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _same(a, b):
    return a.keys() == b.keys() and all(same_snapshot(a[c], b[c]) for c in a)


@pytest.mark.parametrize("first", [True, False], ids=["first-load", "second-adapter"])
def test_pipeline_load_interrupted_at_second_component(sd15_files, monkeypatch, first):
    base, files = sd15_files
    pipe = copy.deepcopy(base)
    pipe.set_progress_bar_config(disable=True)
    if not first:
        pipe.load_fd_lora(files[1], "keep")
    before, names = _components(pipe), pipe.get_list_adapters()
    calls = []
    real = AdapterPool.commit

    def commit(self, planned, **kw):
        calls.append(self)
        if len(calls) == 2:  # the first component is committed, then Ctrl-C
            raise KeyboardInterrupt
        return real(self, planned, **kw)

    monkeypatch.setattr(AdapterPool, "commit", commit)
    with pytest.raises(KeyboardInterrupt):
        pipe.load_fd_lora(files[2], "new")
    monkeypatch.undo()
    assert len(calls) == 2
    assert pipe.get_list_adapters() == names
    assert _same(_components(pipe), before)
    pipe.load_fd_lora(files[2], "new")  # the retry finds the name free
    assert all("new" in v for v in pipe.get_list_adapters().values())


def test_pipeline_load_warns_for_components_the_pipe_lacks(sd15_files):
    base, files = sd15_files
    pipe = copy.deepcopy(base)
    pipe.text_encoder = None  # the adapter has text encoder weights this pipe cannot take
    with pytest.warns(PartialLoadWarning, match=r"skipping 1 component\(s\).*text_encoder"):
        pipe.load_fd_lora(files[1], "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialLoadWarning)
        with pytest.raises(PartialLoadWarning):  # every time, and filterable like any warning
            pipe.load_fd_lora(files[2], "b")


def test_model_level_loads_interrupted(monkeypatch):
    """fdlora.add_adapter and the Transformers load_fd_lora: a first load interrupted leaves no fused layer."""
    from integrations.transformers.models import built

    b = built("llama")
    model = copy.deepcopy(b.base)
    ref = snapshot(model)

    def interrupted(writes):
        raise KeyboardInterrupt

    monkeypatch.setattr(AdapterBank, "write_many", staticmethod(interrupted))
    with pytest.raises(KeyboardInterrupt):
        fdlora.load_fd_lora(model, b.dirs["one"], "one")
    assert model not in registry_of_models and same_snapshot(snapshot(model), ref)
    g = torch.Generator().manual_seed(0)
    q = "model.layers.0.self_attn.q_proj"
    adapter = LoraAdapter({q: ModuleLora(torch.randn(4, 32, generator=g), torch.randn(32, 4, generator=g))})
    with pytest.raises(KeyboardInterrupt):
        fdlora.add_adapter(model, adapter, "two")
    assert model not in registry_of_models and same_snapshot(snapshot(model), ref)
    monkeypatch.undo()
    fdlora.load_fd_lora(model, b.dirs["one"], "one")  # the retry works
    assert fdlora.handle(model).list_adapters() == ["one"]


def test_interrupt_between_two_swaps_puts_the_swapped_modules_back(monkeypatch):
    """A second adapter that wraps more modules, interrupted after some of them were swapped in: the model holds
    exactly the layers it had (the first adapter still works), and a retry loads."""
    from fdlora.layers.model.handle import FdLoraHandle

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
    g = torch.Generator().manual_seed(1)

    def lora(paths):
        return LoraAdapter({p: ModuleLora(torch.randn(2, 8, generator=g), torch.randn(8, 2, generator=g))
                            for p in paths})

    fdlora.add_adapter(model, lora(["0"]), "first")
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = model(x)
    before = [type(m).__name__ for m in model]
    real, swaps = FdLoraHandle._swap, []

    def swap(self, path, module):
        swaps.append(path)
        if len(swaps) == 3:
            raise KeyboardInterrupt
        real(self, path, module)

    monkeypatch.setattr(FdLoraHandle, "_swap", swap)
    with pytest.raises(KeyboardInterrupt):
        fdlora.add_adapter(model, lora(["1", "2", "3", "4"]), "second")
    monkeypatch.undo()
    assert [type(m).__name__ for m in model] == before and sorted(fdlora.handle(model).layers) == ["0"]
    with torch.no_grad():
        assert torch.equal(model(x), want)
    fdlora.add_adapter(model, lora(["1", "2", "3", "4"]), "second")  # the retry works
    assert sorted(fdlora.handle(model).layers) == ["0", "1", "2", "3", "4"]
