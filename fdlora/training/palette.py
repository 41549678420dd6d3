"""Small adapters with a visible meaning for the quickstart: a tiny SD1.5 pipeline's UNet trained toward a colour.

`palette_lora_files(pipe, colour)` trains a LoRA on the pipe's UNet attention (the quickstart's targets) through
fd-lora's trainable layers, so that the pipe's own short generation (DDIM steps with classifier-free guidance,
VAE decode) comes out in that colour, and returns it as a diffusers-format file ({file name: bytes}, what
`pipe.load_fd_lora` and diffusers' `load_lora_weights` both read). The loss is taken on the decoded image of
the same sampling loop the pipeline runs (at a small size: a colour shift carries over to larger images), so a
blend sweep between two palettes moves the mean colour monotonically from one to the other.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from .adapters import add_trainable_adapter, trainable_parameters
from .save import PREFIX, adapter_state_dict

PALETTES = {"warm": (0.95, 0.45, 0.1), "cool": (0.1, 0.45, 0.95)}
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "conv_out"]  # conv_out (LoCon): the latents' colour directly
PROMPTS = ["a cat", "a dog", "a cow"]


def _sample(pipe, unet, cond: torch.Tensor, uncond: torch.Tensor, latents: torch.Tensor, steps: int,
            guidance: float) -> torch.Tensor:
    """The pipeline's sampling loop (CFG, scheduler steps) and VAE decode, differentiable: images in [0, 1]."""
    sched = copy.deepcopy(pipe.scheduler)
    sched.set_timesteps(steps)
    latents = latents * sched.init_noise_sigma
    emb = torch.cat([uncond, cond])
    for t in sched.timesteps:
        x = sched.scale_model_input(torch.cat([latents] * 2), t)
        eps_u, eps_c = unet(x, t, encoder_hidden_states=emb).sample.chunk(2)
        latents = sched.step(eps_u + guidance * (eps_c - eps_u), t, latents).prev_sample
    image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
    return (image / 2 + 0.5).clamp(0, 1)


def palette_lora_files(pipe, colour: tuple[float, float, float], *, steps: int = 12, rank: int = 4,
                       lr: float = 5e-2, seed: int = 0, inference_steps: int = 2, size: int = 32,
                       guidance: float = 7.5, prompts: int = 1) -> dict[str, bytes]:
    """A diffusers-format UNet LoRA that turns the pipe's generations toward `colour` (RGB in [0, 1])."""
    from peft import LoraConfig

    unet = copy.deepcopy(pipe.unet).float()
    add_trainable_adapter(unet, "palette", LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS))
    unet.train()
    for p in pipe.vae.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        cond, uncond = pipe.encode_prompt(PROMPTS[:prompts], "cpu", 1, True)[:2]
    target = torch.tensor(colour, dtype=torch.float32).view(1, 3, 1, 1)
    opt = torch.optim.Adam(trainable_parameters(unet), lr=lr)
    g = torch.Generator().manual_seed(seed)
    c = unet.config
    losses = []
    for _ in range(steps):
        latents = torch.randn(prompts, c.in_channels, size // 2 ** (len(pipe.vae.config.block_out_channels) - 1),
                              size // 2 ** (len(pipe.vae.config.block_out_channels) - 1), generator=g)
        image = _sample(pipe, unet, cond, uncond, latents, inference_steps, guidance)
        loss = F.mse_loss(image, target.expand_as(image))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    palette_lora_files.last_losses = losses  # for the curious (and the test's failure message)
    layers = {k[len(PREFIX):]: v for k, v in adapter_state_dict(unet, "palette").items()}
    with tempfile.TemporaryDirectory() as d:
        type(pipe).save_lora_weights(d, unet_lora_layers=layers)
        return {f.name: f.read_bytes() for f in Path(d).iterdir()}


def palette_files(pipe, names: tuple[str, ...] = ("warm", "cool"), **kw) -> dict[str, dict[str, bytes]]:
    """{palette name: diffusers LoRA files} for the named PALETTES (the quickstart's two adapters)."""
    return {n: palette_lora_files(pipe, PALETTES[n], seed=i, **kw) for i, n in enumerate(names)}
