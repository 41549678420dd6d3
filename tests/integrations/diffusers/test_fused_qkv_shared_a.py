"""A kohya Flux file's one lora_down for q, k, v (img_attn qkv) onto attention fused by fuse_qkv_projections():
to_qkv gets that A once with the three B stacked (rank r, not the block form's 3r), and the outputs are the unfused
model's (which match diffusers+PEFT: tests/hub/test_formats.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("diffusers")

from fdlora.hub import AdapterPool, load_adapters  # noqa: E402
from fdlora.integrations.diffusers import fused_qkv  # noqa: E402
from fdlora.layers import FdLoraHandle  # noqa: E402


def test_kohya_fused_qkv_loads_with_one_A_on_fused_projections(tmp_path):
    from support.tiny import flux_inputs, flux_transformer

    flux = flux_transformer()
    D, g = 32, torch.Generator().manual_seed(7)
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    save_file({f"{name}.lora_down.weight": torch.randn(6, D, generator=g) / D ** 0.5,
               f"{name}.lora_up.weight": torch.randn(3 * D, 6, generator=g), f"{name}.alpha": torch.tensor(3.0)},
              tmp_path / "flux_lora.safetensors")
    adapter = load_adapters(tmp_path / "flux_lora.safetensors", cache=None)[0]["transformer"]
    q, k, v = (adapter.modules[f"transformer_blocks.0.attn.{p}"] for p in ("to_q", "to_k", "to_v"))
    assert torch.equal(q.A, k.A) and torch.equal(q.A, v.A)  # diffusers' converter: the one A, three times
    fused = copy.deepcopy(flux)
    fused.fuse_qkv_projections()
    moved = fused_qkv.retarget(fused, adapter)
    m = moved.modules["transformer_blocks.0.attn.to_qkv"]
    assert m.A.shape == (6, D) and m.B.shape == (3 * D, 6)  # rank r, not 3r
    plain = copy.deepcopy(flux)
    AdapterPool(FdLoraHandle(plain)).add("x", adapter, activate=True)
    AdapterPool(FdLoraHandle(fused)).add("x", moved, activate=True)
    inputs = flux_inputs(flux)
    with torch.no_grad():
        want, got, base = plain(**inputs).sample, fused(**inputs).sample, flux(**inputs).sample
    assert (want - base).abs().max() > 1e-3 * base.abs().max()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_different_A_keep_the_block_form():
    g = torch.Generator().manual_seed(0)
    from fdlora.hub.adapter import ModuleLora

    parts = [(ModuleLora(torch.randn(2, 8, generator=g), torch.randn(4, 2, generator=g), 2.0), 4),
             (None, 4), (ModuleLora(torch.randn(2, 8, generator=g), torch.randn(4, 2, generator=g), 4.0), 4)]
    m = fused_qkv._block(parts, False, torch.float32)
    assert m.A.shape == (4, 8) and m.B.shape == (12, 4)
    x = torch.randn(3, 8, generator=g)
    want = torch.cat([x @ parts[0][0].A.t() @ parts[0][0].B.t() * 1.0, torch.zeros(3, 4),
                      x @ parts[2][0].A.t() @ parts[2][0].B.t() * 2.0], 1)
    assert torch.allclose(x @ m.A.t() @ m.B.t() * m.scaling(False), want, atol=1e-5)
