"""Tiny random-weight diffusers pipelines built from configs: the embedded default of the quickstart,
the demo and the notebooks, and the models tests compare against diffusers + PEFT.

Same architectures as SD1.5, SDXL, SD3 and Flux at toy widths; tokenizers are built in code, so
nothing is read from disk or downloaded. A 2-step 64x64 generation takes well under a second on CPU.
"""

from __future__ import annotations

import torch


def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def clip_tokenizer(max_len: int = 77):
    """Byte-level CLIP BPE with every byte char (and its '</w>' form): 516 tokens, no files."""
    from transformers import CLIPTokenizer

    chars = _bytes_to_unicode()
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in chars + [c + "</w>" for c in chars]:
        vocab.setdefault(c, len(vocab))
    merges = [("a", "t</w>"), ("c", "at</w>")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_len)


def t5_tokenizer(max_len: int = 32):
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    pieces += [("▁" + c, -3.5) for c in "abcdefghijklmnopqrstuvwxyz"]
    pieces += [(f"<extra_id_{i}>", 0.0) for i in range(3, -1, -1)]
    return T5Tokenizer(vocab=pieces, extra_ids=4, model_max_length=max_len)


def clip_te(with_proj: bool = False, hidden: int = 32, seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=hidden, intermediate_size=37,
                         layer_norm_eps=1e-5, num_attention_heads=4, num_hidden_layers=2, vocab_size=1000,
                         hidden_act="gelu", projection_dim=hidden, max_position_embeddings=77)
    return (CLIPTextModelWithProjection if with_proj else CLIPTextModel)(cfg).eval()


def t5_te(d_model: int = 32, seed: int = 0):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=128, d_model=d_model, d_ff=37, d_kv=8, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5EncoderModel(cfg).eval()


def vae(latent_channels: int = 4, seed: int = 0, **kw):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(block_out_channels=[32, 64], in_channels=3, out_channels=3,
                         down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                         latent_channels=latent_channels, norm_num_groups=32, sample_size=64, **kw).eval()


def sd15():
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=8, norm_num_groups=32).eval()
    return StableDiffusionPipeline(unet=unet, vae=vae(), text_encoder=clip_te(), tokenizer=clip_tokenizer(),
                                   scheduler=DDIMScheduler(), safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def sdxl():
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
                                use_linear_projection=True, addition_embed_type="text_time",
                                addition_time_embed_dim=8, transformer_layers_per_block=(1, 2),
                                projection_class_embeddings_input_dim=80,  # 6*8 + 32 (pooled te2)
                                cross_attention_dim=64, norm_num_groups=32).eval()
    return StableDiffusionXLPipeline(unet=unet, vae=vae(), text_encoder=clip_te(seed=1),
                                     text_encoder_2=clip_te(with_proj=True, seed=2), tokenizer=clip_tokenizer(),
                                     tokenizer_2=clip_tokenizer(), scheduler=EulerDiscreteScheduler(),
                                     force_zeros_for_empty_prompt=True)


def flux():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    tr = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]).eval()
    v = vae(latent_channels=4, use_quant_conv=False, use_post_quant_conv=False,
            shift_factor=0.0609, scaling_factor=1.5035)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=v, text_encoder=clip_te(seed=1),
                        tokenizer=clip_tokenizer(), text_encoder_2=t5_te(), tokenizer_2=t5_tokenizer(),
                        transformer=tr)


def sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    tr = SD3Transformer2DModel(sample_size=32, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
                               num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                               pooled_projection_dim=64, out_channels=4).eval()
    v = vae(latent_channels=4, use_quant_conv=False, use_post_quant_conv=False,
            shift_factor=0.0609, scaling_factor=1.5035)
    return StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=v,
                                    text_encoder=clip_te(with_proj=True, seed=1), tokenizer=clip_tokenizer(),
                                    text_encoder_2=clip_te(with_proj=True, seed=2), tokenizer_2=clip_tokenizer(),
                                    text_encoder_3=t5_te(), tokenizer_3=t5_tokenizer(), transformer=tr)


BUILDERS = {"sd15": sd15, "sdxl": sdxl, "flux": flux, "sd3": sd3}


def generate_kwargs(pipe, prompt="a cat", *, seed: int = 0, steps: int = 2, size: int = 64, **kw) -> dict:
    """Call arguments that make a tiny pipeline run fast and deterministically on CPU."""
    out = dict(prompt=prompt, num_inference_steps=steps, height=size, width=size, output_type="pt",
               generator=torch.Generator("cpu").manual_seed(seed))
    if type(pipe).__name__.startswith(("Flux", "StableDiffusion3")):
        out["max_sequence_length"] = 32
    out.update(kw)
    return out


def random_lora_files(pipe, *, seed: int, rank: int = 4, strength: float = 3.0) -> dict[str, bytes]:
    """A random diffusers-format LoRA (UNet/transformer attention + CLIP text encoder) as {file: bytes}.

    Made the way trainers make them: PEFT adapters on a copy of the pipe, saved with the pipeline's own
    `save_lora_weights`, so the file is exactly what diffusers writes.
    """
    import copy
    import tempfile
    from pathlib import Path

    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    p = copy.deepcopy(pipe)
    torch.manual_seed(seed)
    den_name = "unet" if "unet" in p.components else "transformer"
    den = getattr(p, den_name)
    den.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                               init_lora_weights=False), adapter_name="src")
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=["q_proj", "v_proj"],
                                       init_lora_weights=False), p.text_encoder, "src")
    layers = {f"{den_name}_lora_layers": get_peft_model_state_dict(den, adapter_name="src"),
              "text_encoder_lora_layers": get_peft_model_state_dict(p.text_encoder, adapter_name="src")}
    for sd in layers.values():
        for k, v in sd.items():
            if "lora_B" in k:
                v.mul_(strength)
    with tempfile.TemporaryDirectory() as d:
        type(pipe).save_lora_weights(d, **layers)
        return {f.name: f.read_bytes() for f in Path(d).iterdir()}
