"""Full-size models as data: SDXL base 1.0's UNet, Flux-dev's transformer, Llama-3-8B; each also at toy widths.

Random weights built directly on the device in the serving dtype (a full-size fp32 copy would not fit: Flux is
47 GB in fp32), plus inputs of the shapes these models serve. Used by benchmarks/bench_fullsize.py and meant
for the quickstart; nothing is downloaded.

    unet = sdxl_unet("cuda", torch.float16)
    inputs = sdxl_inputs(unet, batch=2)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .diffusers.targets import TARGETS

SDXL_UNET = dict(
    block_out_channels=(320, 640, 1280), layers_per_block=2, sample_size=128, in_channels=4, out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816)
SDXL_UNET_TINY = dict(
    block_out_channels=(32, 64), layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2), attention_head_dim=(2, 4), cross_attention_dim=64, norm_num_groups=32,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=80)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=[16, 56, 56])
FLUX_TINY = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                 axes_dims_rope=[4, 6, 6])
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)

SDXL_TARGETS = TARGETS["UNet2DConditionModel"]
FLUX_TARGETS = TARGETS["FluxTransformer2DModel"]
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# tokens served: SDXL's text tokens; Flux's (image, text) tokens at 1024^2 (image tokens: a square grid)
SDXL_TOKENS, SDXL_TOKENS_TINY = 77, 8
FLUX_TOKENS, FLUX_TOKENS_TINY = (4096, 512), (64, 16)


@contextlib.contextmanager
def built_on(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside are allocated on `device` in `dtype` from the start (no fp32 CPU copy)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def sdxl_unet(device="cuda", dtype=torch.float16, tiny: bool = False, seed: int = 0):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    with built_on(device, dtype):
        return UNet2DConditionModel(**(SDXL_UNET_TINY if tiny else SDXL_UNET)).eval()


def sdxl_inputs(unet, batch: int = 2, tokens: int = SDXL_TOKENS, seed: int = 0) -> dict:
    """One denoiser step's kwargs: latents of the config's sample size (128 = 1024^2 images), 77 text tokens."""
    c, p = unet.config, next(unet.parameters())
    pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
    g = torch.Generator(p.device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=p.device, dtype=p.dtype)

    return dict(sample=rand(batch, c.in_channels, c.sample_size, c.sample_size), timestep=torch.tensor(
        500, device=p.device), encoder_hidden_states=rand(batch, tokens, c.cross_attention_dim),
                added_cond_kwargs={"text_embeds": rand(batch, pooled), "time_ids": rand(batch, 6)})


def flux_transformer(device="cuda", dtype=torch.bfloat16, tiny: bool = False, seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    with built_on(device, dtype):
        return FluxTransformer2DModel(**(FLUX_TINY if tiny else FLUX_DEV)).eval()


def flux_inputs(transformer, batch: int = 1, tokens: tuple[int, int] = FLUX_TOKENS, seed: int = 0) -> dict:
    """One step's kwargs: 4096 packed image tokens (1024^2) + 512 T5 tokens, image ids on their 64x64 grid."""
    c, p = transformer.config, next(transformer.parameters())
    img, txt = tokens
    side = int(img**0.5)
    g = torch.Generator(p.device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=p.device, dtype=p.dtype)

    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(p.device, p.dtype)
    inputs = dict(hidden_states=rand(batch, img, c.in_channels), encoder_hidden_states=rand(
        batch, txt, c.joint_attention_dim), pooled_projections=rand(batch, c.pooled_projection_dim),
                  timestep=torch.full((batch,), 0.5, device=p.device, dtype=p.dtype), img_ids=img_ids,
                  txt_ids=torch.zeros(txt, 3, device=p.device, dtype=p.dtype), return_dict=False)
    if c.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3.5, device=p.device, dtype=p.dtype)
    return inputs


def llama(device="cuda", dtype=torch.bfloat16, tiny: bool = False, seed: int = 0):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**(LLAMA_TINY if tiny else LLAMA3_8B))
    with built_on(device, dtype):
        return transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()
