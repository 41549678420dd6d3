"""Two small LoRAs for the tiny SD1.5 pipeline that pull its images toward a colour each, trained in seconds on CPU
through fd-lora's trainable layers, so the quickstart's blend sweep and per-prompt pictures mean something (the
tiny pipeline's weights are random, and so is any random adapter's effect).

The tiny VAE is random too: its GroupNorms remove the latents' mean, so every decode has nearly the same mean colour.
The pictures are therefore latent previews, RGB = PREVIEW @ latent (the linear latent-to-RGB approximation
SD front-ends use for live previews). Training runs the pipeline's own sampler (its scheduler, classifier-free
guidance) differentiably for a few steps and pulls the preview's mean colour toward the target; the adapter is
written as the diffusers file `save_lora_weights` makes, so fd-lora and diffusers+PEFT load the same bytes.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

# SD 1.x latent -> RGB in [-1, 1] (the usual live-preview factors)
PREVIEW = torch.tensor([[0.298, 0.187, -0.158, -0.184], [0.207, 0.286, 0.189, -0.271],
                        [0.208, 0.173, 0.264, -0.473]])
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_out", "conv_out")
PROMPTS = ("a cat", "a dog", "a cow")


def latent_preview(latents: torch.Tensor) -> torch.Tensor:
    """[B, 4, h, w] SD latents -> [B, 3, h, w] RGB in [0, 1] (unclamped: the training target)."""
    P = PREVIEW.to(latents.device, latents.dtype)
    return (P @ latents.flatten(2)).view(latents.shape[0], 3, *latents.shape[2:]) * 0.5 + 0.5


def _embeddings(pipe, texts) -> torch.Tensor:
    tok = pipe.tokenizer
    ids = tok(list(texts), padding="max_length", max_length=tok.model_max_length, truncation=True,
              return_tensors="pt").input_ids.to(pipe.text_encoder.device)
    with torch.no_grad():
        return pipe.text_encoder(ids)[0]


def train(pipe, rgb: tuple[float, float, float], *, steps: int = 40, num_inference_steps: int = 2,
          guidance_scale: float = 7.5, rank: int = 4, lr: float = 2e-2, seed: int = 0) -> dict[str, bytes]:
    """A UNet LoRA whose images' mean preview colour is `rgb`, as the diffusers LoRA file {name: bytes}."""
    from peft import LoraConfig

    from fdlora.integrations.transformers.trainable.adapters import (
        add_trainable_adapter,
        lora_parameters,
        trainable_parameters,
    )

    unet = copy.deepcopy(pipe.unet).float()
    add_trainable_adapter(unet, "palette", LoraConfig(r=rank, lora_alpha=rank, target_modules=list(TARGETS),
                                                              init_lora_weights="gaussian"))
    opt = torch.optim.Adam(trainable_parameters(unet), lr=lr)
    scheduler = copy.deepcopy(pipe.scheduler)
    scheduler.set_timesteps(num_inference_steps)
    device = unet.device
    cond, uncond = _embeddings(pipe, PROMPTS), _embeddings(pipe, [""])
    target = torch.tensor(rgb, device=device)
    size = pipe.unet.config.sample_size
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        lat = (torch.randn(1, 4, size, size, generator=g) * scheduler.init_noise_sigma).to(device)
        emb = torch.cat([uncond, cond[step % len(PROMPTS)][None]])
        for t in scheduler.timesteps:
            noise = unet(torch.cat([lat, lat]), t, encoder_hidden_states=emb).sample
            nu, nc = noise.chunk(2)
            lat = scheduler.step(nu + guidance_scale * (nc - nu), t, lat).prev_sample
        loss = (latent_preview(lat).mean(dim=(2, 3))[0] - target).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    layers = {}
    for path, (A, B) in lora_parameters(unet, "palette").items():
        layers[f"{path}.lora_A.weight"], layers[f"{path}.lora_B.weight"] = A.detach().clone(), B.detach().clone()
    with tempfile.TemporaryDirectory() as d:
        type(pipe).save_lora_weights(d, unet_lora_layers=layers)
        return {f.name: f.read_bytes() for f in Path(d).iterdir()}
