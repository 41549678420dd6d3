"""The eager merged-weight cache's refresh (fdlora.layers.fastpath.remerge): the first stale layer re-merges the whole model,
a slider moved 1000 times never drifts, and a budget too small for every layer goes where a copy saves the most per
byte (the smallest weights first where the layers run alike rows, the layer with more rows where sizes are alike).
Runs on the torch backend here and on the Triton backend under TRITON_INTERPRET=1 (test_triton_interpret.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fdlora
from fdlora import env
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.layers.fastpath import remerge
from fdlora.layers.fastpath.merged import blend_key

MOVES = 60 if env.triton_interpret() else 1000  # the interpreter runs each merge kernel slowly
SIZES = [(16, 32), (32, 48), (48, 16), (16, 16)]  # (in, out) per layer


def model_and_adapters():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(k, n) for k, n in SIZES])
    g = torch.Generator().manual_seed(1)
    ads = [LoraAdapter({str(i): ModuleLora(torch.randn(4, k, generator=g) * 0.2, torch.randn(n, 4, generator=g) * 0.2,
                                           alpha=8.0) for i, (k, n) in enumerate(SIZES)}) for _ in range(2)]
    h = fdlora.inject(model, [str(i) for i in range(len(SIZES))])
    h.add_adapter(ads[0], "a")
    h.add_adapter(ads[1], "b")
    return model, h, ads


def oracle(model, ads, weights, x):
    y = x.double()
    for i, layer in enumerate(model):
        W = layer.base.weight.double() + sum(w * 2.0 * (ad.modules[str(i)].B.double() @ ad.modules[str(i)].A.double())
                                             for ad, w in zip(ads, weights))
        y = y @ W.t() + layer.base.bias.double()
    return y


@pytest.fixture
def cache_on():
    fdlora.set_merge_cache(1 << 30)
    yield
    fdlora.set_merge_cache("auto")


def test_first_stale_layer_refreshes_every_layer(cache_on):
    model, h, _ = model_and_adapters()
    x = torch.randn(3, SIZES[0][0])
    with torch.inference_mode():
        model(x)
        h.set_adapters(["a", "b"], [0.3, 0.6])
        model[0](x)  # only the first layer runs
        assert all(layer.merged.key == blend_key(layer, layer.base.weight) for layer in model)


def test_a_slider_moved_many_times_equals_a_fresh_merge_bit_for_bit(cache_on):
    model, h, ads = model_and_adapters()
    x = torch.randn(5, SIZES[0][0])
    with torch.inference_mode():
        for i in range(MOVES):
            w = (i % 37) / 19.0 - 0.5
            h.set_adapters(["a", "b"], [w, 1 - w])
            y = model(x)
        moved = [layer.merged.buf.clone() for layer in model]
        fdlora.set_merge_cache(1 << 30)  # drops every copy: the next call merges afresh
        fresh = model(x)
        assert all(torch.equal(m, layer.merged.buf) for m, layer in zip(moved, model))
        assert torch.equal(y, fresh)
        want = oracle(model, ads, [w, 1 - w], x)
        assert torch.allclose(fresh.double(), want, rtol=1e-4, atol=1e-5)


def test_a_weight_replaced_or_swapped_between_slider_moves_is_merged_from_the_new_weight(cache_on):
    """The slider's replay launches its merges before it checks the layers (the GPU merges while the host checks):
    a weight replaced under a layer, or its data swapped, must still end in W' merged from the new weight."""
    model, h, ads = model_and_adapters()
    x = torch.randn(5, SIZES[0][0])
    with torch.inference_mode():
        for w in (0.2, 0.4):  # a kept pass to replay
            h.set_adapters(["a", "b"], [w, 0.5])
            model(x)
        model[1].base.weight = nn.Parameter(torch.randn_like(model[1].base.weight))
        h.set_adapters(["a", "b"], [0.6, 0.5])
        assert torch.allclose(model(x).double(), oracle(model, ads, [0.6, 0.5], x), rtol=1e-4, atol=1e-5)
        model[2].base.weight.data = torch.randn_like(model[2].base.weight)
        h.set_adapters(["a", "b"], [0.8, 0.5])
        assert torch.allclose(model(x).double(), oracle(model, ads, [0.8, 0.5], x), rtol=1e-4, atol=1e-5)


def test_a_load_or_delete_in_a_slot_the_blend_does_not_weigh_keeps_every_copy(cache_on, monkeypatch):
    """Publishing a prefetched adapter (a load into a slot with weight 0) must not re-merge the serving blend's
    copies (an SDXL step after each publication re-merged all 722 layers); a load into a weighed slot must."""
    model, h, ads = model_and_adapters()
    x = torch.randn(5, SIZES[0][0])
    merges = []
    full = remerge._full
    monkeypatch.setattr(remerge, "_full", lambda *a: merges.append(1) or full(*a))
    with torch.inference_mode():
        h.set_adapters(["a"], [0.7])
        model(x)
        assert merges == [1]
        third = LoraAdapter({k: ModuleLora(m.A.flip(0), m.B.flip(1), alpha=8.0) for k, m in ads[1].modules.items()})
        h.add_adapter(third, "c", activate=False)  # a slot of its own, weight 0
        h.delete_adapter("b")
        y = model(x)
        assert merges == [1], "a load outside the blend re-merged its copies"
        assert torch.allclose(y.double(), oracle(model, ads, [0.7, 0.0], x), rtol=1e-4, atol=1e-5)
        slot = h.state.slots.by_name["a"]
        new = ModuleLora(ads[1].modules["2"].A, ads[1].modules["2"].B, alpha=8.0)
        model[2].bank.write(slot, new)  # the weighed slot rewritten in place: that copy is stale
        y = model(x)
        assert len(merges) == 2, "a write into the weighed slot kept a stale copy"
        mixed = LoraAdapter({**ads[0].modules, "2": new})
        assert torch.allclose(y.double(), oracle(model, [mixed], [0.7], x), rtol=1e-4, atol=1e-5)


def test_a_small_budget_goes_to_the_smallest_weights_first(cache_on):
    model, h, _ = model_and_adapters()
    nbytes = sorted(k * n * 4 for k, n in SIZES)
    fdlora.set_merge_cache(nbytes[0] + nbytes[1])  # room for the two smallest weights only
    with torch.inference_mode():
        model(torch.randn(2, SIZES[0][0]))
    cached = sorted(layer.base.weight.numel() * 4 for layer in model if layer.merged.buf is not None)
    assert cached == nbytes[:2]
    assert fdlora.merge_cache_bytes() == nbytes[0] + nbytes[1]


def test_with_no_room_a_layer_skips_the_refresh_after_its_first_try(cache_on, monkeypatch):
    from fdlora.layers.fastpath import remerge

    model, h, _ = model_and_adapters()
    fdlora.set_merge_cache(0)
    calls = []
    real = remerge.refresh
    monkeypatch.setattr(remerge, "refresh", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        for _ in range(3):
            model(torch.randn(2, SIZES[0][0]))
    assert len(calls) == 1  # one pass found no room for any layer; later calls go straight to the per-call path


def test_the_blend_takes_room_from_every_layers_per_prompt_copies(cache_on):
    """Per-prompt copies fill the budget (smallest layers first, the largest finds none); the next blend call still
    gets a copy for every layer, the largest included: per-prompt copies are regenerable, and the blend's serve every
    call (Llama-3-8B, session 16: otherwise its MLP layers merged into scratch on every prefill call)."""
    model, h, ads = model_and_adapters()
    fdlora.set_merge_cache(sum(k * n * 4 for k, n in SIZES))  # one copy of every weight
    x = torch.randn(2, 64, SIZES[0][0])  # 64 rows per sample: the per-prompt path takes per-blend copies
    with torch.inference_mode():
        with h.per_sample(["a", "b"]):
            y = model(x)
        held = [sum(c.buf is not None for c in layer.merged.groups.values()) for layer in model]
        assert held == [2, 0, 2, 2], held  # the largest weight (32 x 48) found no room
        h.set_adapters(["a"], [1.0])
        y1 = model(x)
        assert all(layer.merged.buf is not None for layer in model)
        assert fdlora.merge_cache_bytes() == sum(k * n * 4 for k, n in SIZES)  # the blend's copies, nothing else
    for i, w in enumerate(([1.0, 0.0], [0.0, 1.0])):
        torch.testing.assert_close(y[i].double(), oracle(model, ads, w, x[i]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y1.double(), oracle(model, ads, [1.0, 0.0], x), rtol=1e-4, atol=1e-5)


def test_per_prompt_copies_take_room_from_every_layers_idle_blend_copy(cache_on):
    """The mirror of the test above: the blend's copies fill the budget, then a per-sample batch still gets copies
    (smallest layers first, as if the budget were empty): blend copies are idle while per-sample batches run, and
    regenerable (Flux-dev, session 23: a per-prompt step after a blend step ran at 1.12x base with 4 of the 20 GiB
    left to it, 1.06x with the room). The next blend call merges its copies again."""
    model, h, ads = model_and_adapters()
    fdlora.set_merge_cache(sum(k * n * 4 for k, n in SIZES))  # one copy of every weight
    x = torch.randn(2, 64, SIZES[0][0])  # 64 rows per sample: the per-prompt path takes per-blend copies
    with torch.inference_mode():
        h.set_adapters(["a"], [1.0])
        model(x)
        assert all(layer.merged.buf is not None for layer in model)  # the blend holds the whole budget
        with h.per_sample(["a", "b"]):
            y = model(x)
        held = [sum(c.buf is not None for c in layer.merged.groups.values()) for layer in model]
        assert held == [2, 0, 2, 2], held
        y1 = model(x)
        assert all(layer.merged.buf is not None for layer in model)
    for i, w in enumerate(([1.0, 0.0], [0.0, 1.0])):
        torch.testing.assert_close(y[i].double(), oracle(model, ads, w, x[i]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y1.double(), oracle(model, ads, [1.0, 0.0], x), rtol=1e-4, atol=1e-5)


class TwoStreams(nn.Module):
    """Two equal layers, the first of the pair seeing 4 rows per sample, the second 64 (Flux-dev's text and image
    streams: 512 and 4096 tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.txt, self.img = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.img(x).sum(1) + self.txt(c).sum(1)


@pytest.mark.parametrize("per_sample", [False, True], ids=["blend", "per-prompt"])
def test_a_tight_budget_goes_to_the_layer_that_runs_more_rows(cache_on, per_sample):
    """Two layers of one size, room for one copy (per blend): it goes to the layer whose per-call path would move
    more bytes per call (64 rows a sample, not 4), whichever comes first in the model."""
    torch.manual_seed(0)
    model = TwoStreams()
    g = torch.Generator().manual_seed(1)
    h = fdlora.inject(model, ["txt", "img"])
    for name in ("a", "b"):
        h.add_adapter(LoraAdapter({k: ModuleLora(torch.randn(4, 16, generator=g), torch.randn(16, 4, generator=g),
                                                 alpha=8.0) for k in ("txt", "img")}), name)
    x, c = torch.randn(2, 64, 16), torch.randn(2, 4, 16)
    with torch.inference_mode():
        fdlora.set_merge_cache(0)
        model(x, c)  # the per-call path: each layer notes its rows
        fdlora.set_merge_cache(16 * 16 * 4 * (2 if per_sample else 1))
        if per_sample:
            with h.per_sample(["a", "b"]):
                y = model(x, c)
            copies = {n: sum(m.buf is not None for m in getattr(model, n).merged.groups.values())
                      for n in ("txt", "img")}
            assert copies == {"txt": 0, "img": 2}, copies
        else:
            y = model(x, c)
            assert model.img.merged.buf is not None and model.txt.merged.buf is None
        fdlora.set_merge_cache(0)
        with h.per_sample(["a", "b"]) if per_sample else torch.inference_mode():
            ref = model(x, c)  # the per-call kernels throughout
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
