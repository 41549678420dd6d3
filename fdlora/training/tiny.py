"""The tiny models `fdlora train` knows by name (random weights built from configs, nothing downloaded), each with
a synthetic batch maker and a loss: what the trainer, the tests and the smoke benchmark share.

    tiny-vit    ViTForImageClassification 16x16, hidden 64, 3 classes  image-classification   cross-entropy
                (widths multiples of 64: bitsandbytes' CPU 4-bit blocks)
    tiny-llama  LlamaForCausalLM, vocab 96, hidden 32               causal-lm              next-token loss
    tiny-sd15   the tiny SD1.5 UNet (fdlora.pipelines.diffusers)    text-to-image          noise-prediction MSE
"""

from __future__ import annotations

import torch
from torch import nn

TASKS = {"tiny-vit": "image-classification", "tiny-llama": "causal-lm", "tiny-sd15": "text-to-image"}
VOCAB = 96


def vit_config(image_size: int = 16):
    import transformers

    return transformers.ViTConfig(image_size=image_size, patch_size=8, num_channels=3, hidden_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=3)


def build(name: str, seed: int = 0) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if name == "tiny-vit":
        return transformers.ViTForImageClassification(vit_config())
    if name == "tiny-llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(cfg)
    if name == "tiny-sd15":
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel(
            block_out_channels=(32, 64), layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
            norm_num_groups=32)
    raise ValueError(f"unknown tiny model {name!r}; known: {sorted(TASKS)}")


def synthetic_batch(task: str, model: nn.Module, batch: int, step: int, seed: int = 0) -> dict:
    """Deterministic batch `step` of a learnable synthetic task (the same batch for the same (seed, step))."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if task == "image-classification":
        c = model.config
        labels = torch.randint(0, c.num_labels, (batch,), generator=g)
        x = torch.randn(batch, c.num_channels, c.image_size, c.image_size, generator=g) * 0.5
        x[:, 0] += labels[:, None, None].float() - 1  # the class is in the red channel's mean: learnable
        return {"pixel_values": x, "labels": labels}
    if task == "causal-lm":
        start = torch.randint(2, VOCAB, (batch, 1), generator=g)
        ids = (start + torch.arange(12)) % VOCAB  # counting sequences: learnable
        return {"input_ids": ids, "labels": ids}
    if task == "text-to-image":
        c = model.config
        s = c.sample_size
        return {"sample": torch.randn(batch, c.in_channels, s, s, generator=g),
                "timestep": torch.randint(0, 1000, (batch,), generator=g),
                "encoder_hidden_states": torch.randn(batch, 7, c.cross_attention_dim, generator=g),
                "target": torch.randn(batch, c.out_channels, s, s, generator=g) * 0.1}
    raise ValueError(f"unknown task {task!r}")


def loss_of(task: str, model: nn.Module, batch: dict) -> torch.Tensor:
    """The task's training loss on one batch (batches live on the model's device)."""
    if task == "text-to-image":
        b = dict(batch)
        target = b.pop("target")
        out = model(**b).sample
        return torch.nn.functional.mse_loss(out.float(), target.float())
    return model(**batch).loss
