"""Tiny random-weight models built from configs (nothing is downloaded): the shapes hub tests load into.

Same architectures as the real pipelines at toy widths: SD1.5 and SDXL UNets (layers_per_block=2,
like the real ones, so kohya SGM block numbers map the same way), CLIP text encoders, a Flux
transformer with one double and one single block.
"""

from __future__ import annotations

import torch


def sd15_unet(seed: int = 0):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
    ).eval()


def sdxl_unet(seed: int = 0):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
        cross_attention_dim=64, norm_num_groups=32,
    ).eval()


def clip_te(with_proj: bool = False, hidden: int = 32, seed: int = 0):
    from fdlora.fixtures.tiny_pipeline import clip_te as build

    return build(with_proj, hidden, seed)


def flux_transformer(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]).eval()


def unet_inputs(unet, batch: int = 2, seed: int = 0) -> dict:
    """Deterministic forward inputs for a tiny UNet (SDXL ones get the added time/text conditioning)."""
    g = torch.Generator().manual_seed(seed)
    c = unet.config
    kw = {
        "sample": torch.randn(batch, c.in_channels, c.sample_size, c.sample_size, generator=g),
        "timestep": torch.tensor(10),
        "encoder_hidden_states": torch.randn(batch, 7, c.cross_attention_dim, generator=g),
    }
    if c.addition_embed_type == "text_time":
        text = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
        kw["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, text, generator=g),
                                   "time_ids": torch.randn(batch, 6, generator=g)}
    return kw


ATTN = ("to_q", "to_k", "to_v", "to_out.0")
TE = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1")


def shapes(model, suffixes: tuple[str, ...], convs: tuple[str, ...] = ()) -> dict[str, tuple]:
    """{path: (K, N)} of matching Linear modules and {path: (C, N, kh, kw)} of matching Conv2d modules."""
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and n.endswith(suffixes):
            out[n] = (m.in_features, m.out_features)
        elif isinstance(m, torch.nn.Conv2d) and convs and n.endswith(convs):
            out[n] = (m.in_channels, m.out_channels, *m.kernel_size)
    return out


def snapshot(model) -> dict:
    """Everything that defines a model's output: parameters, buffers and the module type at every path."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["__types__"] = tuple(type(m).__name__ for _, m in model.named_modules())
    return sd


def same_snapshot(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and a["__types__"] == b["__types__"] and all(
        torch.equal(a[k], b[k]) for k in a if k != "__types__")


def flux_inputs(transformer, batch: int = 1, seq: int = 16, txt: int = 5, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    c = transformer.config
    return {
        "hidden_states": torch.randn(batch, seq, c.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(batch, txt, c.joint_attention_dim, generator=g),
        "pooled_projections": torch.randn(batch, c.pooled_projection_dim, generator=g),
        "timestep": torch.full((batch,), 0.5),
        "img_ids": torch.randn(seq, 3, generator=g),
        "txt_ids": torch.zeros(txt, 3),
    }
