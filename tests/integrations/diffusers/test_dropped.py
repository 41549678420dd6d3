"""Nothing dropped silently: a load that leaves tensors unused logs a warning and warns (PartialLoadWarning)
naming how many modules and why, every time (a RAM-cache hit too); a Flux file's T5 LoRA is named in the
report as applied by fd-lora where diffusers ignores it."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch

from fdlora.errors import PartialLoadWarning

from . import families as F


@pytest.fixture(scope="module")
def wan():
    return F.build("wan21")


def _lora(n_in: int, n_out: int, seed: int = 0, rank: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, n_in, generator=g) * 0.1, torch.randn(n_out, rank, generator=g)


def _assert_warns_twice(load, caplog, n_modules: int, why: str):
    for _ in range(2):  # the second load is a RAM-cache hit for file sources: it warns again
        caplog.clear()
        with pytest.warns(PartialLoadWarning) as rec, caplog.at_level(logging.WARNING, logger="fdlora"):
            load()
        msg = str(rec[0].message)
        assert f"{n_modules} modules" in msg and why in msg, msg
        assert any(f"{n_modules} modules" in r.getMessage() for r in caplog.records)


def test_module_without_its_lora_B_warns(wan, caplog, tmp_path):
    from safetensors.torch import save_file

    A, B = _lora(24, 24)
    sd = {"transformer.blocks.0.attn1.to_q.lora_A.weight": A, "transformer.blocks.0.attn1.to_q.lora_B.weight": B,
          "transformer.blocks.0.attn1.to_k.lora_A.weight": A.clone(),  # no lora_B: dropped
          "transformer.blocks.1.attn1.to_v.lora_B.weight": B.clone()}  # no lora_A: dropped
    save_file(sd, tmp_path / "pytorch_lora_weights.safetensors")
    n = [0]

    def load():
        n[0] += 1
        copy.deepcopy(wan).load_fd_lora(str(tmp_path), f"x{n[0]}")

    _assert_warns_twice(load, caplog, 2, "but no lora_B")


def test_wan_diff_keys_are_dropped_and_said(wan, caplog):
    """diffusers' Wan converter skips `.diff` (full weight difference) keys with an info line; fd-lora warns."""
    sd = {}
    for o in ("q", "k", "v", "o"):
        A, B = _lora(24, 24, seed=ord(o))
        sd[f"diffusion_model.blocks.0.self_attn.{o}.lora_down.weight"] = A
        sd[f"diffusion_model.blocks.0.self_attn.{o}.lora_up.weight"] = B
        sd[f"diffusion_model.blocks.0.self_attn.{o}.alpha"] = torch.tensor(4.0)
    sd["diffusion_model.blocks.0.cross_attn.q.diff"] = torch.zeros(24, 24)
    n = [0]

    def load():
        n[0] += 1
        return copy.deepcopy(wan).load_fd_lora(sd, f"d{n[0]}")

    _assert_warns_twice(load, caplog, 1, "diff")
    with pytest.warns(PartialLoadWarning):
        report = load()
    assert report.keys_dropped == {"diffusion_model.blocks.0.cross_attn.q.diff": report.keys_dropped[
        "diffusion_model.blocks.0.cross_attn.q.diff"]}
    assert report.components == {"transformer": 4}


def test_strict_refuses_what_would_be_dropped(wan):
    from fdlora.errors import UnusedKeysError

    A, B = _lora(24, 24)
    sd = {"transformer.blocks.0.attn1.to_q.lora_A.weight": A, "transformer.blocks.0.attn1.to_q.lora_B.weight": B,
          "transformer.blocks.0.attn1.to_k.lora_A.weight": A}
    with pytest.raises(UnusedKeysError):
        copy.deepcopy(wan).load_fd_lora(sd, "s", strict=True)


def test_complete_file_does_not_warn(wan):
    A, B = _lora(24, 24)
    sd = {"transformer.blocks.0.attn1.to_q.lora_A.weight": A, "transformer.blocks.0.attn1.to_q.lora_B.weight": B}
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialLoadWarning)
        copy.deepcopy(wan).load_fd_lora(sd, "ok")


@pytest.fixture(scope="module")
def flux():
    from fdlora.fixtures import tiny_pipeline as tiny

    return tiny.flux()


def test_flux_t5_lora_is_named_in_the_report(flux):
    """A diffusers-layout Flux file with a text_encoder_2 (T5) LoRA: diffusers' FluxLoraLoaderMixin ignores it,
    fd-lora applies it, and the report (and its printout) says so."""
    q = flux.text_encoder_2.encoder.block[0].layer[0].SelfAttention.q
    A, B = _lora(q.in_features, q.out_features)
    A2, B2 = _lora(32, 32, seed=1)
    sd = {"text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": A,
          "text_encoder_2.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight": B,
          "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": A2,
          "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": B2}
    pipe = copy.deepcopy(flux)
    report = pipe.load_fd_lora(sd, "t5")
    assert set(report.diffusers_ignores) == {"text_encoder_2"}
    assert "FluxLoraLoaderMixin loads only ['transformer', 'text_encoder']" in str(report)
    assert set(pipe.fd_lora_handles()) == {"transformer", "text_encoder_2"}


def test_flux_kohya_t5_keys_are_dropped_with_a_warning(flux, caplog):
    """The kohya / ComfyUI spelling (text_encoders.t5xxl.) is dropped, as diffusers does, and said every time."""
    A, B = _lora(32, 32)
    sd = {"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": A,
          "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": B,
          "lora_unet_double_blocks_0_img_attn_proj.alpha": torch.tensor(4.0),
          "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.lora_down.weight": A.clone(),
          "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.lora_up.weight": B.clone()}
    n = [0]

    def load():
        n[0] += 1
        copy.deepcopy(flux).load_fd_lora(sd, f"k{n[0]}")

    _assert_warns_twice(load, caplog, 1, "T5")


def test_kohya_file_mixing_lora_and_an_unsupported_module_warns(caplog):
    """A kohya SD file whose modules are partly plain LoRA, partly a LyCORIS type fd-lora does not apply (OFT):
    the plain modules load, the other is dropped, and the load says how many modules and why, every time."""
    import diffusers

    from tests.support import tiny

    unet = tiny.sd15_unet()
    pipe = diffusers.StableDiffusionPipeline(vae=None, text_encoder=None, tokenizer=None, unet=unet, scheduler=None,
                                             safety_checker=None, feature_extractor=None,
                                             requires_safety_checker=False)
    q = unet.down_blocks[1].attentions[0].transformer_blocks[0].attn1.to_q
    A, B = _lora(q.in_features, q.out_features)
    stem = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1"
    sd = {f"{stem}_to_q.lora_down.weight": A, f"{stem}_to_q.lora_up.weight": B, f"{stem}_to_q.alpha": torch.tensor(4.),
          f"{stem}_to_k.oft_blocks": torch.zeros(4, 16, 16), f"{stem}_to_k.alpha": torch.tensor(1.)}
    n = [0]

    def load():
        n[0] += 1
        p = copy.deepcopy(pipe)
        p.load_fd_lora(sd, f"m{n[0]}")
        assert p.get_list_adapters() == {"unet": [f"m{n[0]}"]}

    _assert_warns_twice(load, caplog, 1, "oft_blocks")
