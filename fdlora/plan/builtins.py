"""Built-in model configs for `fdlora plan NAME` with no download: the real configs as data, plus tiny ones.

The full-size configs are those of the published checkpoints (stabilityai/stable-diffusion-xl-base-1.0
unet/config.json, black-forest-labs/FLUX.1-dev transformer/config.json, meta-llama/Meta-Llama-3-8B
config.json), kept once in fdlora/fixtures/fullsize.py (which builds them for the benchmarks; importing it
imports neither diffusers nor transformers). The tiny ones are the shapes of fdlora's planner tests.
Each entry: family (unet | flux | llm), the class to build, its config, the default LoRA targets, dtype
and workload (batch, tokens or resolution) that a user of that model most often runs.
"""

from __future__ import annotations

from fdlora.fixtures import fullsize as F

SDXL_TARGETS, FLUX_TARGETS, LLM_TARGETS = (tuple(t) for t in (F.SDXL_TARGETS, F.FLUX_TARGETS, F.LLAMA_TARGETS))
SDXL_UNET, FLUX_DEV = F.SDXL_UNET, F.FLUX_DEV
LLAMA_3_8B = dict(model_type="llama", **F.LLAMA3_8B)  # the planner picks the transformers class by model_type
TINY_UNET = dict(
    block_out_channels=[32, 64], layers_per_block=2, sample_size=16, down_block_types=["DownBlock2D",
    "CrossAttnDownBlock2D"], up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], attention_head_dim=[2, 4],
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    transformer_layers_per_block=[1, 2], projection_class_embeddings_input_dim=80, cross_attention_dim=64,
    norm_num_groups=32,
)
# the UNet of `tiny-sd15`, the tiny pipeline of `fdlora run / train / demo` (fdlora.fixtures.tiny_pipeline.sd15)
TINY_SD15 = dict(
    block_out_channels=[32, 64], layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"], up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"],
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
)
TINY_FLUX = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=256, max_position_embeddings=256)

# name: (family, class, config, targets, dtype, workload defaults)
BUILTINS: dict[str, tuple[str, str, dict, tuple[str, ...], str, dict]] = {
    "sdxl": ("unet", "UNet2DConditionModel", SDXL_UNET, SDXL_TARGETS, "float16",
             dict(batch=2, resolution=1024, text_tokens=77, steps=30)),
    "flux-dev": ("flux", "FluxTransformer2DModel", FLUX_DEV, FLUX_TARGETS, "bfloat16",
                 dict(batch=1, resolution=1024, text_tokens=512, steps=28)),
    "llama-3-8b": ("llm", "LlamaForCausalLM", LLAMA_3_8B, LLM_TARGETS, "bfloat16",
                   dict(batch=32, tokens=1, context=512, steps=256)),
    "tiny-sdxl": ("unet", "UNet2DConditionModel", TINY_UNET, SDXL_TARGETS, "float16",
                  dict(batch=2, resolution=128, text_tokens=8, steps=4)),
    "tiny-sd15": ("unet", "UNet2DConditionModel", TINY_SD15, SDXL_TARGETS, "float32",
                  dict(batch=2, resolution=64, text_tokens=8, steps=4)),
    "tiny-flux": ("flux", "FluxTransformer2DModel", TINY_FLUX, FLUX_TARGETS, "bfloat16",
                  dict(batch=1, resolution=128, text_tokens=16, steps=4)),
    "tiny-llama": ("llm", "LlamaForCausalLM", TINY_LLAMA, LLM_TARGETS, "bfloat16",
                   dict(batch=4, tokens=1, context=16, steps=8)),
}
DEFAULTS = {"unet": BUILTINS["sdxl"], "flux": BUILTINS["flux-dev"], "llm": BUILTINS["llama-3-8b"]}
