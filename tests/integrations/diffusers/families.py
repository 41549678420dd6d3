"""Tiny denoisers of every diffusers LoRA family, inside their pipeline classes, with denoiser inputs.

Configs and inputs follow diffusers' own model tests (tests/models/transformers/test_models_transformer_*.py,
tests/lora/test_lora_layers_*.py) at toy widths. Pipelines are built with only the denoiser(s); every
other component is None (diffusers allows it), because what is compared is the denoiser's output with
a LoRA loaded through the pipeline class's mixin by diffusers (`load_lora_weights`) and by fd-lora.
"""

from __future__ import annotations

import copy
import inspect
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _r(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed))


# --- per family: transformer kwargs and inputs(batch) -------------------------------------------------
def flux_inputs(B: int, joint: int = 32, pooled: int | None = 32, C: int = 16, guidance: bool = False):
    hw, S = 16, 8
    kw = {"hidden_states": _r(B, hw, C, seed=1), "encoder_hidden_states": _r(B, S, joint, seed=2),
          "timestep": torch.full((B,), 0.5),
          "img_ids": torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                                indexing="ij"), -1).reshape(-1, 3),
          "txt_ids": torch.zeros(S, 3)}
    if pooled:
        kw["pooled_projections"] = _r(B, pooled, seed=3)
    if guidance:
        kw["guidance"] = torch.full((B,), 3.5)
    return kw


def flux2_inputs(B: int):
    S, h, w = 8, 4, 4
    img = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    txt = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(S))
    return {"hidden_states": _r(B, h * w, 4, seed=1), "encoder_hidden_states": _r(B, S, 16, seed=2),
            "img_ids": img.unsqueeze(0).expand(B, -1, -1), "txt_ids": txt.unsqueeze(0).expand(B, -1, -1),
            "timestep": torch.full((B,), 1.0), "guidance": torch.full((B,), 1.0)}


def qwen_inputs(B: int):
    return {"hidden_states": _r(B, 16, 16, seed=1), "encoder_hidden_states": _r(B, 8, 16, seed=2),
            "encoder_hidden_states_mask": torch.ones(B, 8, dtype=torch.long), "timestep": torch.full((B,), 1.0),
            "img_shapes": [(1, 4, 4)] * B}


def wan_inputs(B: int):
    return {"hidden_states": _r(B, 4, 2, 8, 8, seed=1), "encoder_hidden_states": _r(B, 12, 16, seed=2),
            "timestep": torch.full((B,), 500, dtype=torch.long)}


def hunyuan_inputs(B: int):
    return {"hidden_states": _r(B, 4, 1, 8, 8, seed=1), "timestep": torch.full((B,), 500.0),
            "encoder_hidden_states": _r(B, 12, 16, seed=2), "pooled_projections": _r(B, 8, seed=3),
            "encoder_attention_mask": torch.ones(B, 12), "guidance": torch.full((B,), 1000.0)}


def ltx_inputs(B: int):
    return {"hidden_states": _r(B, 2 * 8 * 8, 4, seed=1), "encoder_hidden_states": _r(B, 16, 16, seed=2),
            "timestep": torch.full((B,), 500, dtype=torch.long), "encoder_attention_mask": torch.ones(B, 16).bool(),
            "num_frames": 2, "height": 8, "width": 8}


def cogvideox_inputs(B: int):
    return {"hidden_states": _r(B, 1, 4, 8, 8, seed=1), "encoder_hidden_states": _r(B, 8, 32, seed=2),
            "timestep": torch.full((B,), 500, dtype=torch.long)}


def sana_inputs(B: int):
    return {"hidden_states": _r(B, 4, 16, 16, seed=1), "encoder_hidden_states": _r(B, 8, 8, seed=2),
            "timestep": torch.full((B,), 500, dtype=torch.long)}


def lumina2_inputs(B: int):
    return {"hidden_states": _r(B, 4, 16, 16, seed=1), "encoder_hidden_states": _r(B, 16, 32, seed=2),
            "timestep": torch.full((B,), 0.5), "encoder_attention_mask": torch.ones(B, 16, dtype=torch.bool)}


def hidream_inputs(B: int):
    return {"hidden_states": _r(B, 4, 16, 16, seed=1), "encoder_hidden_states_t5": _r(B, 8, 8, seed=2),
            "encoder_hidden_states_llama3": _r(2, B, 8, 4, seed=3), "pooled_embeds": _r(B, 8, seed=4),
            "timesteps": torch.full((B,), 500, dtype=torch.long)}


def sd3_inputs(B: int):
    return {"hidden_states": _r(B, 4, 8, 8, seed=1), "encoder_hidden_states": _r(B, 8, 32, seed=2),
            "pooled_projections": _r(B, 64, seed=3), "timestep": torch.full((B,), 500, dtype=torch.long)}


def zimage_inputs(B: int):
    return {"x": [_r(16, 1, 8, 8, seed=1 + i) for i in range(B)],
            "cap_feats": [_r(8, 16, seed=9 + i) for i in range(B)],
            "t": torch.full((B,), 0.5)}


def auraflow_inputs(B: int):
    return {"hidden_states": _r(B, 4, 8, 8, seed=1), "encoder_hidden_states": _r(B, 8, 32, seed=2),
            "timestep": torch.full((B,), 500, dtype=torch.long)}


def cogview4_inputs(B: int):
    return {"hidden_states": _r(B, 4, 8, 8, seed=1), "encoder_hidden_states": _r(B, 8, 32, seed=2),
            "timestep": torch.full((B,), 500, dtype=torch.long), "original_size": torch.tensor([[64, 64]] * B),
            "target_size": torch.tensor([[64, 64]] * B), "crop_coords": torch.tensor([[0, 0]] * B)}


def mochi_inputs(B: int):
    return {"hidden_states": _r(B, 4, 2, 8, 8, seed=1), "encoder_hidden_states": _r(B, 8, 16, seed=2),
            "timestep": torch.full((B,), 500, dtype=torch.long), "encoder_attention_mask": torch.ones(B, 8).bool()}


def helios_inputs(B: int):
    T, H, W = 2, 8, 8
    return {"hidden_states": _r(B, 4, T, H, W, seed=1), "timestep": torch.full((B,), 500, dtype=torch.long),
            "encoder_hidden_states": _r(B, 12, 16, seed=2), "indices_hidden_states": torch.ones(B, T),
            "indices_latents_history_short": torch.ones(B, T - 1), "indices_latents_history_mid": torch.ones(B, T - 1),
            "indices_latents_history_long": torch.ones(B, (T - 1) * 4),
            "latents_history_short": _r(B, 4, T - 1, H, W, seed=3),
            "latents_history_mid": _r(B, 4, T - 1, H, W, seed=4),
            "latents_history_long": _r(B, 4, (T - 1) * 4, H, W, seed=5)}


def ernie_inputs(B: int):
    return {"hidden_states": _r(B, 16, 8, 8, seed=1), "timestep": torch.full((B,), 1.0),
            "text_bth": _r(B, 8, 16, seed=2), "text_lens": torch.full((B,), 8)}


def krea2_inputs(B: int):
    S, h, w = 4, 2, 2
    pos = torch.zeros(S + h * w, 3)
    pos[S:, 1], pos[S:, 2] = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[:, -1] = False  # a padded text token: the key-padding mask path
    return {"hidden_states": _r(B, h * w, 16, seed=1), "encoder_hidden_states": _r(B, S, 3, 16, seed=2),
            "timestep": torch.full((B,), 0.5), "position_ids": pos, "encoder_attention_mask": mask}


def ideogram4_inputs(B: int):
    from diffusers.models.transformers.transformer_ideogram4 import (
        IMAGE_POSITION_OFFSET,
        LLM_TOKEN_INDICATOR,
        OUTPUT_IMAGE_INDICATOR,
    )

    T, I = 4, 4  # text tokens, image tokens (a 2x2 grid)
    x = torch.zeros(B, T + I, 16)
    x[:, T:] = _r(B, I, 16, seed=1)
    ctx = torch.zeros(B, T + I, 24)
    ctx[:, :T] = _r(B, T, 24, seed=2)
    pos = torch.zeros(B, T + I, 3, dtype=torch.long)
    pos[:, :T] = torch.arange(T)[:, None]
    pos[:, T:, 0] = IMAGE_POSITION_OFFSET
    pos[:, T:, 1] = torch.tensor([0, 0, 1, 1]) + IMAGE_POSITION_OFFSET
    pos[:, T:, 2] = torch.tensor([0, 1, 0, 1]) + IMAGE_POSITION_OFFSET
    ind = torch.full((B, T + I), OUTPUT_IMAGE_INDICATOR, dtype=torch.long)
    ind[:, :T] = LLM_TOKEN_INDICATOR
    return {"hidden_states": x, "encoder_hidden_states": ctx, "timestep": torch.full((B,), 0.5), "position_ids": pos,
            "segment_ids": torch.ones(B, T + I, dtype=torch.long), "indicator": ind}


def acestep_inputs(B: int):
    S, E = 8, 10  # audio frames, encoder tokens
    return {"hidden_states": _r(B, S, 8, seed=1), "timestep": torch.full((B,), 0.5),
            "timestep_r": torch.full((B,), 0.3), "encoder_hidden_states": _r(B, E, 32, seed=2),
            "context_latents": _r(B, S, 16, seed=3)}


def cosmos_inputs(B: int):
    return {"hidden_states": _r(B, 4, 1, 16, 16, seed=1), "timestep": torch.full((B,), 500, dtype=torch.long),
            "encoder_hidden_states": _r(B, 12, 16, seed=2), "attention_mask": torch.ones(B, 12), "fps": 30}


def ltx2_inputs(B: int):
    T, H, W, S = 2, 8, 8, 16
    return {"hidden_states": _r(B, T * H * W, 4, seed=1), "audio_hidden_states": _r(B, 9, 4, seed=2),
            "encoder_hidden_states": _r(B, S, 16, seed=3), "audio_encoder_hidden_states": _r(B, S, 16, seed=4),
            "timestep": torch.full((B,), 500.0), "encoder_attention_mask": torch.ones(B, S, dtype=torch.bool),
            "num_frames": T, "height": H, "width": W, "audio_num_frames": 9, "fps": 25.0}


def fibo2_inputs(B: int):
    return {"hidden_states": _r(B, 16, 8, 8, seed=1), "timestep": torch.full((B,), 0.5),
            "encoder_hidden_states": _r(B, 2, 8, 16, seed=2)}  # [B, 1 + len(injection_layer_ids), text, cap_feat_dim]


def kandinsky5_inputs(B: int):
    S, h, w = 8, 8, 8
    return {"hidden_states": _r(B, 1, h, w, 4, seed=1), "encoder_hidden_states": _r(B, S, 16, seed=2),
            "timestep": torch.full((B,), 500.0), "pooled_projections": _r(B, 8, seed=3),
            "visual_rope_pos": [torch.arange(1), torch.arange(h // 2), torch.arange(w // 2)],
            "text_rope_pos": torch.arange(S)}


def proteina_inputs(B: int):
    L = 6  # residues (tokens)
    return {"bb_ca": _r(B, L, 3, seed=1), "local_latents": _r(B, L, 4, seed=2), "bb_ca_time": torch.full((B,), 0.5),
            "local_latents_time": torch.full((B,), 0.5), "padding_mask": torch.ones(B, L, dtype=torch.bool),
            "token_type": torch.zeros(B, L, dtype=torch.long), "atom37_mask": torch.ones(B, L, 37, dtype=torch.bool),
            "conditioning": {"is_in_context_conditioning": torch.zeros(B, L, dtype=torch.bool),
                             "supports_local_latent": torch.ones(B, L, dtype=torch.bool)}}


def flux3_inputs(B: int):
    return {k: v[0] if k.endswith("_ids") else v for k, v in flux2_inputs(B).items() if k != "guidance"}


def minimax_h3_inputs(B: int):
    T, A, V = 4, 6, 8  # text, audio, video tokens of one packed sequence
    S = T + A + V
    text, audio, video = torch.arange(T), torch.arange(T, T + A), torch.arange(T + A, S)
    tags = torch.zeros(S, dtype=torch.long)  # 0 video, 1 text, 2 audio
    tags[text], tags[audio] = 1, 2
    t_idx = torch.zeros(S, dtype=torch.long)
    t_idx[audio] = 1  # the audio rows on their own timestep
    pos = torch.zeros(S, 3)
    pos[:, 0] = torch.arange(S, dtype=torch.float32)
    pos[video, 1], pos[video, 2] = torch.arange(V, dtype=torch.float32) % 4, torch.arange(V, dtype=torch.float32) % 2
    return {"hidden_states": _r(B, V, 16, seed=1), "audio_hidden_states": _r(B, A, 6, seed=2),
            "encoder_hidden_states": _r(B, T, 8, seed=3), "timestep": torch.tensor([0.7, 0.3]),
            "timestep_indices": t_idx, "token_tags": tags, "position_ids": pos, "video_indices": video,
            "audio_indices": audio, "text_indices": text}


@dataclass
class Spec:
    """One pipeline class of a family: its transformer(s) and the denoiser's inputs."""

    pipeline: str
    model: str
    kwargs: dict
    inputs: Callable[[int], dict]
    extra: dict = field(default_factory=dict)  # pipeline kwargs beyond the components (Wan 2.2's boundary_ratio);
    # a callable is called (Cosmos 2.5's __init__ reads its VAE's config and would build a guardrail model for None)
    second: bool = False  # a transformer_2 too (Wan 2.2)
    per_prompt: bool = True  # False: per-prompt adapters are refused (HiDream's routed MoE experts, ERNIE-Image's
                             # sequence-first MLP)
    blocks: str | None = None  # a modular pipeline: its blocks class in diffusers.modular_pipelines
    saver: str | None = None  # the pipeline class whose save_lora_weights writes the file, when the family's mixin
    # has none (Anima: its files are ComfyUI's or diffusers' layout, which Cosmos' save_lora_weights writes)
    unzero: bool = False  # randomise the zero-initialised parameters (a zero output layer hides every LoRA)


FLUX = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
           text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
           rope_max_seq_len=32)

SPECS: dict[str, Spec] = {
    "flux": Spec("FluxPipeline", "FluxTransformer2DModel", FLUX, flux_inputs),
    "kontext": Spec("FluxKontextPipeline", "FluxTransformer2DModel", dict(FLUX, guidance_embeds=True),
                    lambda B: flux_inputs(B, guidance=True)),
    "chroma": Spec("ChromaPipeline", "ChromaTransformer2DModel",
                   dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8],
                        approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1),
                   lambda B: flux_inputs(B, pooled=None)),
    "flux2": Spec("Flux2Pipeline", "Flux2Transformer2DModel",
                  dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                       num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=256,
                       axes_dims_rope=[4, 4, 4, 4]), flux2_inputs),
    "qwenimage": Spec("QwenImagePipeline", "QwenImageTransformer2DModel",
                      dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                           num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False,
                           axes_dims_rope=(8, 4, 4)), qwen_inputs),
    "wan21": Spec("WanPipeline", "WanTransformer3DModel", WAN, wan_inputs),
    "wan22": Spec("WanPipeline", "WanTransformer3DModel", WAN, wan_inputs, extra={"boundary_ratio": 0.875},
                  second=True),
    "hunyuanvideo": Spec("HunyuanVideoPipeline", "HunyuanVideoTransformer3DModel",
                         dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
                              num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1,
                              guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8,
                              rope_axes_dim=(2, 4, 4)), hunyuan_inputs),
    "ltxvideo": Spec("LTXPipeline", "LTXVideoTransformer3DModel",
                     dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                          cross_attention_dim=16, num_layers=1, qk_norm="rms_norm_across_heads", caption_channels=16),
                     ltx_inputs),
    "cogvideox": Spec("CogVideoXPipeline", "CogVideoXTransformer3DModel",
                      dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
                           text_embed_dim=32, num_layers=1, sample_width=8, sample_height=8, sample_frames=1,
                           patch_size=2, temporal_compression_ratio=4, max_text_seq_length=8), cogvideox_inputs),
    "sana": Spec("SanaPipeline", "SanaTransformer2DModel",
                 dict(patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=4,
                      num_attention_heads=2, num_cross_attention_heads=2, cross_attention_head_dim=4,
                      cross_attention_dim=8, caption_channels=8, sample_size=16), sana_inputs),
    "lumina2": Spec("Lumina2Pipeline", "Lumina2Transformer2DModel",
                    dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
                         num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=2,
                         ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(4, 2, 2),
                         axes_lens=(128, 128, 128), cap_feat_dim=32), lumina2_inputs),
    "hidream": Spec("HiDreamImagePipeline", "HiDreamImageTransformer2DModel",
                    dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
                         attention_head_dim=8, num_attention_heads=4, caption_channels=[8, 4], text_emb_dim=8,
                         num_routed_experts=2, num_activated_experts=2, axes_dims_rope=(4, 2, 2),
                         max_resolution=(32, 32), llama_layers=(0, 1), force_inference_output=True),
                    hidream_inputs, per_prompt=False),
    "sd35": Spec("StableDiffusion3Pipeline", "SD3Transformer2DModel",
                 dict(sample_size=8, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
                      num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                      pooled_projection_dim=64, out_channels=4, qk_norm="rms_norm", dual_attention_layers=(0,)),
                 sd3_inputs),
    "zimage": Spec("ZImagePipeline", "ZImageTransformer2DModel",
                   dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
                        n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16,
                        rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32]),
                   zimage_inputs),
    "auraflow": Spec("AuraFlowPipeline", "AuraFlowTransformer2DModel",
                     dict(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                          caption_projection_dim=16, out_channels=4, pos_embed_max_size=64), auraflow_inputs),
    "cogview4": Spec("CogView4Pipeline", "CogView4Transformer2DModel",
                     dict(patch_size=2, in_channels=4, num_layers=1, attention_head_dim=4, num_attention_heads=4,
                          out_channels=4, text_embed_dim=32, time_embed_dim=8, condition_dim=4), cogview4_inputs),
    "mochi": Spec("MochiPipeline", "MochiTransformer3DModel",
                  dict(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=1,
                       pooled_projection_dim=16, in_channels=4, out_channels=None, qk_norm="rms_norm",
                       text_embed_dim=16, time_embed_dim=4, activation_fn="swiglu", max_sequence_length=16),
                  mochi_inputs),
    "skyreelsv2": Spec("SkyReelsV2Pipeline", "SkyReelsV2Transformer3DModel", WAN, wan_inputs),
    "helios": Spec("HeliosPipeline", "HeliosTransformer3DModel",
                   dict({k: v for k, v in WAN.items() if k != "rope_max_seq_len"}, rope_dim=(4, 4, 4),
                        has_multi_term_memory_patch=True, guidance_cross_attn=True, zero_history_timestep=True,
                        is_amplify_history=False), helios_inputs),
    "ernieimage": Spec("ErnieImagePipeline", "ErnieImageTransformer2DModel",
                       dict(hidden_size=16, num_attention_heads=1, num_layers=1, ffn_hidden_size=16, in_channels=16,
                            out_channels=16, patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=(8, 4, 4),
                            eps=1e-6, qk_layernorm=True), ernie_inputs, per_prompt=False, unzero=True),
    "krea2": Spec("Krea2Pipeline", "Krea2Transformer2DModel",
                  dict(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=32, timestep_embed_dim=8, text_hidden_dim=16, num_text_layers=3,
                       text_num_attention_heads=2, text_num_key_value_heads=1, text_intermediate_size=16,
                       num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2),
                       rope_theta=1000.0, norm_eps=1e-5), krea2_inputs),
    "ideogram4": Spec("Ideogram4Pipeline", "Ideogram4Transformer2DModel",
                      dict(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                           intermediate_size=32, adaln_dim=16, llm_features_dim=24, rope_theta=10_000,
                           mrope_section=(2, 1, 1), norm_eps=1e-5), ideogram4_inputs),
    "acestep": Spec("AceStepPipeline", "AceStepTransformer1DModel",
                    dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, in_channels=24, audio_acoustic_hidden_dim=8, patch_size=2,
                         rope_theta=10000.0, sliding_window=16), acestep_inputs),
    "anima": Spec("AnimaModularPipeline", "CosmosTransformer3DModel",
                  dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
                       mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
                       rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=False, extra_pos_embed_type="learnable"),
                  cosmos_inputs, blocks="AnimaAutoBlocks", saver="Cosmos2_5_PredictBasePipeline"),
    "cosmos": Spec("Cosmos2_5_PredictBasePipeline", "CosmosTransformer3DModel",
                   dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2,
                        mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
                        rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=False, extra_pos_embed_type="learnable"),
                   cosmos_inputs, extra={"safety_checker": nn.Identity, "vae": lambda: _wan_vae(16)}),
    "ltx2": Spec("LTX2ConditionPipeline", "LTX2VideoTransformer3DModel",
                 dict(in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
                      attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
                      audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
                      num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=16, rope_double_precision=False),
                 ltx2_inputs),
    "briafibo2": Spec("BriaFibo2Pipeline", "BriaFibo2Transformer2DModel",
                      dict(in_channels=16, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
                           cap_feat_dim=16, injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=4,
                           max_num_gist_tokens=8, gist_step=4, gist_min_text_len=4, gist_max_text_len=16,
                           axes_dims=(8, 4, 4), axes_lens=(64, 32, 32)), fibo2_inputs),
    "kandinsky5": Spec("Kandinsky5T2IPipeline", "Kandinsky5Transformer3DModel",
                       dict(in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, out_visual_dim=4,
                            patch_size=(1, 2, 2), model_dim=16, ff_dim=32, num_text_blocks=1, num_visual_blocks=2,
                            axes_dims=(1, 1, 2), visual_cond=False, attention_type="regular"), kandinsky5_inputs),
    "rfd4proteina": Spec("RFD4ProteinaPipeline", "RFD4ProteinaTransformer",  # (the features a tiny input can give)
                         dict(nlayers=2, token_dim=16, nheads=2, dim_cond=8, pair_repr_dim=8, latent_dim=4,
                              token_type_emb_dim=4, cath_emb_dim=4, t_emb_dim=8, seq_sep_dim=4, xt_pair_dist_dim=4,
                              tri_mult_c=8, update_pair_repr_every_n=1,
                              feats_seq=("xt_bb_ca", "xt_local_latents", "token_type"),
                              feats_cond_seq=("time_emb_bb_ca", "time_emb_local_latents"),
                              feats_pair_repr=("xt_bb_ca_pair_dists",),
                              feats_pair_cond=("time_emb_bb_ca", "time_emb_local_latents")), proteina_inputs,
                         extra={"vae": lambda: _with_config(latent_dim=4)}),  # (its __init__ compares latent_dim)
    "flux3": Spec("Flux3ModularPipeline", "Flux3Transformer2DModel",
                  dict(in_channels=4, cond_in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                       num_attention_heads=2, joint_attention_dim=16, timestep_channels=16,
                       axes_dims_rope=(4, 4, 4, 4)), flux3_inputs, blocks="Flux3AutoBlocks"),
    # MiniMax-H3: per_prompt False. Its adaln_proj layers take one row per *timestep* ([2, D]: video and audio), shared
    # by every sample, not one per sample: per-sample adapters there mix silently when the batch is 2 (batch 1 is right,
    # other sizes raise). Not fixed here: fd-lora cannot tell such rows from samples.
    "minimaxh3": Spec("MiniMaxH3ModularPipeline", "MiniMaxH3Transformer3DModel",
                      dict(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2,
                           num_refiner_layers=2, ffn_dim=32, in_channels=4, audio_in_channels=6, patch_size=(1, 2, 2),
                           text_dim=8, freq_dim=8, time_embed_hidden_dim=24, time_embed_dim=16, rope_freq_dim=2),
                      minimax_h3_inputs, blocks="MiniMaxH3Blocks", per_prompt=False),
}


def build(key: str, seed: int = 0) -> Any:
    """The family's pipeline with tiny random denoiser(s) and every other component None."""
    import diffusers

    spec = SPECS[key]
    cls = getattr(diffusers, spec.pipeline)
    torch.manual_seed(seed)
    model = getattr(diffusers, spec.model)(**spec.kwargs).eval()
    if spec.unzero:
        _unzero(model)
    if spec.blocks:  # built from its blocks with no repository (every component None), then given the denoiser
        pipe = getattr(diffusers.modular_pipelines, spec.blocks)().init_pipeline()
        pipe.update_components(transformer=model)
        return pipe
    comps = {p: None for p in list(inspect.signature(cls.__init__).parameters)[1:]
             if inspect.signature(cls.__init__).parameters[p].default is inspect.Parameter.empty}
    comps["transformer"] = model
    if spec.second:
        torch.manual_seed(seed + 1)
        comps["transformer_2"] = getattr(diffusers, spec.model)(**spec.kwargs).eval()
    pipe = cls(**{**comps, **{k: v() if callable(v) else v for k, v in spec.extra.items()}})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _wan_vae(z: int) -> nn.Module:
    import diffusers

    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(base_dim=3, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                      temperal_downsample=[False, True, True]).eval()


def _with_config(**config) -> nn.Module:
    """A stand-in component whose only use is its config (a pipeline __init__ that reads another component's)."""
    from types import SimpleNamespace

    m = nn.Module()
    m.config = SimpleNamespace(**config)
    return m


def _unzero(model: nn.Module) -> None:
    """Give every all-zero parameter random values, as training would (ERNIE-Image zero-initialises its adaLN and
    output layers: the tiny model's output is 0 whatever the LoRA)."""
    g = _g(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def targets(model: nn.Module) -> list[str]:
    """By rule: every Linear inside an indexed block (attention, feed-forward, MoE experts, norms' linears)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and re.search(r"\.\d+\.", n)]


def peft_lora(model: nn.Module, seed: int, rank: int = 4, alpha: float = 8.0,
              strength: float = 2.0) -> tuple[dict, dict]:
    """(PEFT state dict, its LoraConfig dict) of a random LoRA on `targets(model)`, made on a copy."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    m = copy.deepcopy(model)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets(model), init_lora_weights=False)
    m.add_adapter(cfg, adapter_name="src")
    sd = {k: v.detach().clone() for k, v in get_peft_model_state_dict(m, adapter_name="src").items()}
    with torch.no_grad():
        for k, v in sd.items():
            if "lora_B" in k:
                v.mul_(strength)
    meta = m.peft_config["src"].to_dict()
    meta["target_modules"] = sorted(meta["target_modules"])
    return sd, meta


def save(pipe_cls: type, sd: dict, meta: dict | None = None) -> str:
    """A LoRA folder written by the pipeline class's own `save_lora_weights` (the diffusers layout)."""
    d = tempfile.mkdtemp(prefix="fdlora-family-")
    kw = {"transformer_lora_layers": sd}
    if meta is not None:
        kw["transformer_lora_adapter_metadata"] = meta
    pipe_cls.save_lora_weights(d, **kw)
    return d


def run(model: nn.Module, inputs: dict, **extra) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs, **extra, return_dict=False)
    out = out if isinstance(out, torch.Tensor) else out[0]  # (Kandinsky 5 returns the tensor itself, not a tuple)
    if isinstance(out, (list, tuple)):  # Z-Image returns one tensor per sample
        out = torch.stack([o.float() for o in out])
    return out


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> float:
    """Relative max error of `a` against `b`."""
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
