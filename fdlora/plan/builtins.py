"""Built-in model configs for `fdlora plan NAME` with no download: the real configs as data, plus tiny ones.

The full-size configs are those of the published checkpoints (stabilityai/stable-diffusion-xl-base-1.0
unet/config.json, black-forest-labs/FLUX.1-dev transformer/config.json, meta-llama/Meta-Llama-3-8B
config.json); fdlora/pipelines/fullsize.py carries the same numbers for the benchmarks, and one of the
two should import the other once both have landed. The tiny ones are the shapes of fdlora's tests.
Each entry: family (unet | flux | llm), the class to build, its config, the default LoRA targets, dtype
and workload (batch, tokens or resolution) that a user of that model most often runs.
"""

from __future__ import annotations

SDXL_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out")
FLUX_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out")
LLM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

SDXL_UNET = dict(
    act_fn="silu", addition_embed_type="text_time", addition_time_embed_dim=256, attention_head_dim=[5, 10, 20],
    block_out_channels=[320, 640, 1280], center_input_sample=False, cross_attention_dim=2048,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], in_channels=4,
    layers_per_block=2, norm_num_groups=32, out_channels=4, projection_class_embeddings_input_dim=2816,
    sample_size=128, transformer_layers_per_block=[1, 2, 10],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], use_linear_projection=True,
)
FLUX_DEV = dict(
    attention_head_dim=128, guidance_embeds=True, in_channels=64, joint_attention_dim=4096, num_attention_heads=24,
    num_layers=19, num_single_layers=38, patch_size=1, pooled_projection_dim=768, axes_dims_rope=[16, 56, 56],
)
LLAMA_3_8B = dict(
    model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    num_hidden_layers=32, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
)
TINY_UNET = dict(
    block_out_channels=[32, 64], layers_per_block=2, sample_size=16, down_block_types=["DownBlock2D",
    "CrossAttnDownBlock2D"], up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], attention_head_dim=[2, 4],
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    transformer_layers_per_block=[1, 2], projection_class_embeddings_input_dim=80, cross_attention_dim=64,
    norm_num_groups=32,
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
    "tiny-flux": ("flux", "FluxTransformer2DModel", TINY_FLUX, FLUX_TARGETS, "bfloat16",
                  dict(batch=1, resolution=128, text_tokens=16, steps=4)),
    "tiny-llama": ("llm", "LlamaForCausalLM", TINY_LLAMA, LLM_TARGETS, "bfloat16",
                   dict(batch=4, tokens=1, context=16, steps=8)),
}
DEFAULTS = {"unet": BUILTINS["sdxl"], "flux": BUILTINS["flux-dev"], "llm": BUILTINS["llama-3-8b"]}
