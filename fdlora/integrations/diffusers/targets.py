"""Which modules fd-lora wraps per architecture, as data.

On the first load into a component, fd-lora wraps the table's targets plus whatever the adapter
touches, so later adapters that stay within the table load into free slots without wrapping
anything new (and so without recompiling a compiled denoiser). Names follow PEFT target semantics
(module-name suffixes). Architectures not listed get only the adapter's own modules.
"""

from __future__ import annotations

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
FEED_FORWARD = ["ff.net.0.proj", "ff.net.2"]
CLIP_TEXT = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]

TARGETS: dict[str, list[str]] = {
    "UNet2DConditionModel": ATTENTION + FEED_FORWARD + ["proj_in", "proj_out"],
    "SD3Transformer2DModel": ATTENTION + FEED_FORWARD
    + ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context.net.0.proj", "ff_context.net.2"],
    "FluxTransformer2DModel": ATTENTION + FEED_FORWARD
    + ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context.net.0.proj", "ff_context.net.2",
       "proj_mlp", "proj_out"],
    "CLIPTextModel": CLIP_TEXT,
    "CLIPTextModelWithProjection": CLIP_TEXT,
    "T5EncoderModel": ["q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo"],
}

# the keyword of each denoiser's per-call attention kwargs that carries diffusers' LoRA `scale`
SCALE_KWARGS = ("cross_attention_kwargs", "joint_attention_kwargs", "attention_kwargs")


def targets_for(module) -> list[str]:
    return list(TARGETS.get(type(module).__name__, []))
