"""LoRA on to_q / to_k / to_v loads onto attention fused by fuse_qkv_projections() (to_qkv, to_kv) and gives the
unfused model's outputs; diffusers' own load leaves such a LoRA without effect."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")

import fdlora  # noqa: E402,F401
from fdlora.fixtures import tiny_pipeline as tiny  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pipe = tiny.sd15()
    pipe.set_progress_bar_config(disable=True)
    dirs = []
    for seed in (1, 2):
        d = tmp_path_factory.mktemp(f"lora{seed}")
        for name, data in tiny.random_lora_files(pipe, seed=seed).items():
            (d / name).write_bytes(data)
        dirs.append(str(d))
    g = torch.Generator().manual_seed(0)
    inputs = dict(sample=torch.randn(3, 4, 32, 32, generator=g), timestep=torch.tensor(500),
                  encoder_hidden_states=torch.randn(3, 77, 32, generator=g))
    return pipe, dirs, inputs


def _unet(pipe, inputs):
    with torch.no_grad():
        return pipe.unet(**inputs).sample


def test_lora_on_fused_projections_equals_unfused(setup):
    pipe, dirs, inputs = setup
    plain, fused = copy.deepcopy(pipe), copy.deepcopy(pipe)
    fused.fuse_qkv_projections()
    assert any(hasattr(m, "to_qkv") for m in fused.unet.modules()) and any(hasattr(m, "to_kv")
                                                                         for m in fused.unet.modules())
    base = _unet(fused, inputs)
    for p in (plain, fused):
        for i, d in enumerate(dirs):
            p.load_fd_lora(d, adapter_name=f"a{i}")
    wrapped = {path.rsplit(".", 1)[-1] for path in fdlora.handle(fused.unet).layers}
    assert {"to_qkv", "to_kv"} <= wrapped  # the adapters went onto the fused projections
    for names, weights in ((["a0"], [1.0]), (["a0", "a1"], [0.7, -0.4])):
        plain.set_adapters(names, weights)
        fused.set_adapters(names, weights)
        want, got = _unet(plain, inputs), _unet(fused, inputs)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert (got - base).abs().max() > 1e-3  # the LoRA has an effect
    specs = ["a0", None, {"a0": 0.5, "a1": 0.5}]
    lat = torch.randn(3, 4, 32, 32, generator=torch.Generator().manual_seed(3))
    kw = tiny.generate_kwargs(pipe, prompt=["a", "b", "c"], output_type="latent", latents=lat)
    with torch.no_grad():
        want = plain(**kw, fd_lora_adapters=specs).images
        got = fused(**kw, fd_lora_adapters=specs).images
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
