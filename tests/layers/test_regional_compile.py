"""torch.compile as users run it on a diffusers transformer with fd-lora layers and the merged-weight cache on:
diffusers' regional compilation (`compile_repeated_blocks(fullgraph=True)`) and whole-model fullgraph compile
make no more graphs than the same model without LoRA, never recompile on switches or slider moves, and match
eager outputs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import fdlora
from fdlora.hub.adapter import LoraAdapter, ModuleLora

pytest.importorskip("diffusers")

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_mlp", "proj_out", "ff.net.2"]


def tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]).eval()
    g = torch.Generator().manual_seed(0)
    img, txt = 64, 16
    inputs = dict(hidden_states=torch.randn(1, img, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, txt, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(img, 3), txt_ids=torch.zeros(txt, 3), return_dict=False)
    return model, inputs


def random_adapter(model, seed):
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and any(name.endswith(t) for t in TARGETS):
            mods[name] = ModuleLora(torch.randn(4, mod.in_features, generator=g) * 0.2,
                                    torch.randn(mod.out_features, 4, generator=g) * 0.2)
    return LoraAdapter(mods)


def compiled_graphs(model, inputs, regional: bool):
    """(model to call, unique graphs after the first call)."""
    torch._dynamo.reset()
    counters.clear()
    if regional:
        model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    else:
        model = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        model(**inputs)
    return model, counters["stats"]["unique_graphs"]


@pytest.fixture
def cache_on():
    fdlora.set_merge_cache(1 << 30)
    yield
    fdlora.set_merge_cache("auto")


@pytest.mark.parametrize("regional", [True, False], ids=["compile_repeated_blocks", "whole-model"])
def test_compile_makes_no_more_graphs_and_never_recompiles_on_switches(cache_on, regional):
    base, inputs = tiny_flux()
    _, n_base = compiled_graphs(copy.deepcopy(base), inputs, regional)
    fd = copy.deepcopy(base)
    h = fdlora.inject(fd, TARGETS)
    h.add_adapter(random_adapter(base, 0), "a")
    h.add_adapter(random_adapter(base, 1), "b")
    eager = copy.deepcopy(fd)  # the oracle: the same layers and adapters, never compiled
    he = fdlora.handle(eager)
    compiled, n_fd = compiled_graphs(fd, inputs, regional)
    assert n_fd <= n_base
    moves = [(["a"], [1.0]), (["a", "b"], [0.3, 0.9]), (["b"], [0.5])] + [(["a"], [w / 10]) for w in range(1, 8)]
    old = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    try:
        with torch.no_grad():
            for names, weights in moves:
                h.set_adapters(names, weights)
                he.set_adapters(names, weights)
                got, want = compiled(**inputs)[0], eager(**inputs)[0]
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (names, weights)
    finally:
        torch._dynamo.config.error_on_recompile = old
    assert counters["stats"]["unique_graphs"] == n_fd
