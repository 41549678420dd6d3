"""warmup before the first load wraps the denoiser as that load would (pipe.fd_lora_prepare): the base outputs stay
bit-identical, and a load after it gives exactly the outputs of a load into a pipeline never warmed up."""

from __future__ import annotations

import copy

import torch

import fdlora
from fdlora.fixtures import tiny_pipeline as tiny
from fdlora.integrations.warmup import warmup

from .conftest import lora_dir


def _images(pipe, latents):
    with torch.inference_mode():
        return pipe(**tiny.generate_kwargs(pipe, latents=latents)).images


def test_warmup_wraps_the_denoiser_and_the_first_load_matches_a_cold_one():
    base = tiny.BUILDERS["sd15"]()
    base.set_progress_bar_config(disable=True)
    folder = lora_dir(base, "sd15", "style_a", 1)
    latents = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    plain = _images(base, latents)

    warm, cold = copy.deepcopy(base), copy.deepcopy(base)
    report = warmup(warm)
    handles = warm.fd_lora_handles()
    assert list(handles) == ["unet"] and report.layers == len(handles["unet"].layers) > 0, str(report)
    assert "wrapped" in str(report)  # (the text encoder is not wrapped: the handles above are the unet's alone)
    assert fdlora.handle(warm.unet).list_adapters() == []
    assert torch.equal(_images(warm, latents), plain)  # wrapped, nothing loaded: the base alone
    assert warm.fd_lora_prepare() == handles  # a second call changes nothing

    wrapped = handles["unet"].layers
    warm.load_fd_lora(folder, "style_a")
    cold.load_fd_lora(folder, "style_a")
    assert warm.fd_lora_handles()["unet"].layers is wrapped  # the load wrapped nothing more in the unet
    assert sorted(warm.fd_lora_handles()["unet"].layers) == sorted(cold.fd_lora_handles()["unet"].layers)
    assert torch.equal(_images(warm, latents), _images(cold, latents))
    assert not torch.equal(_images(warm, latents), plain)  # (the adapter does change the images)
