"""PEFT: ``adapter_config.json`` + ``adapter_model.safetensors`` with ``base_model.model.<path>.lora_A.weight``.

The config is applied with PEFT's own semantics (`base.from_config`): r and rank_pattern are
checked against the tensors, lora_alpha / alpha_pattern give each module's alpha through PEFT's
`get_pattern_key`, use_rslora scales by alpha/sqrt(r), target_modules / exclude_modules /
layers_to_transform decide (with PEFT's `check_target_module_exists`) which keys PEFT itself would
load, and lora_bias admits lora_B biases. fan_in_fan_out only changes how PEFT *merges* a
transformers Conv1D weight; the unmerged math (A [r, in], B [out, r]) is the same, so it is
recorded, not converted. use_dora adapters carry their ``lora_magnitude_vector`` (fdlora.layers.modules.dora);
the other LoRA variants raise UnsupportedFeatureError. LoHa and LoKr adapters (peft_type LOHA / LOKR)
load as exact factors through fdlora.hub.formats.lycoris with PEFT's scale alpha / r.

A model-level state dict in PEFT key form without any prefix ("peft-bare", e.g. from
`get_peft_model_state_dict`) loads the same way without a config: alpha = rank (scale 1).
"""

from __future__ import annotations

import re

from . import lycoris
from .base import COMPONENTS, MODEL, Converted, Options, Raw, build_modules, from_config, peft_key, strip_prefix

PREFIX = "base_model.model."
UNET = re.compile(r"(down_blocks|up_blocks|mid_block|conv_in|conv_out|time_embedding|add_embedding)\.")
TRANSFORMER = re.compile(r"(transformer_blocks|single_transformer_blocks|x_embedder|context_embedder|pos_embed)\.")
CLIP = re.compile(r"(text_model\.|encoder\.layers\.\d+\.(self_attn|mlp)\.)")


def detect(raw: Raw) -> str | None:
    if raw.config is not None:
        return "an adapter_config.json comes with the weights (PEFT save_pretrained)"
    n = sum(k.startswith(PREFIX) for k in raw.tensors)
    return f"{n} of {len(raw.tensors)} keys start with {PREFIX!r} (PEFT save_pretrained)" if n else None


def detect_bare(raw: Raw) -> str | None:
    if any(k.partition(".")[0] in COMPONENTS for k in raw.tensors):  # (cheap test first: a prefixed file)
        return None
    n = sum(peft_key(k) is not None and not k.startswith(PREFIX) for k in raw.tensors)
    if n:
        return f"{n} keys are <module>.lora_A/lora_B without a component prefix (a model-level PEFT state dict)"
    return None


def guess_component(paths: list[str]) -> tuple[str, str]:
    """Which pipeline component module paths belong to, from their names (override with component=)."""
    for comp, pat in (("unet", UNET), ("transformer", TRANSFORMER), ("text_encoder", CLIP)):
        hits = [p for p in paths if pat.match(p)]
        if hits:
            return comp, f"module paths like {hits[0]!r} are {comp} paths"
    return MODEL, "module paths match no diffusers component; loaded as a single model"


def convert(raw: Raw, opts: Options) -> Converted:
    prefixed = any(k.startswith(PREFIX) for k in raw.tensors)
    sd = strip_prefix(raw.tensors, PREFIX) if prefixed else dict(raw.tensors)
    outside = {k: f"outside {PREFIX!r}, where PEFT keeps every adapter weight" for k in raw.tensors
               if prefixed and not k.startswith(PREFIX)}
    out = _convert(sd, raw.config, opts)
    if prefixed:  # report the keys as the file spells them
        out.unused = {PREFIX + k: why for k, why in out.unused.items()}
        out.dropped = {PREFIX + k: why for k, why in out.dropped.items()}
        out.saved = {PREFIX + k: why for k, why in out.saved.items()}
    out.unused.update(outside)
    return out


def convert_bare(raw: Raw, opts: Options) -> Converted:
    return _convert(dict(raw.tensors), raw.config, opts)


def _convert(sd, config, opts: Options) -> Converted:
    paths = [m[0] for k in sd if (m := peft_key(k))]
    comp, why = (opts.component, "component= given") if opts.component else guess_component(paths)
    if config is not None and lycoris.peft_type(config) in ("LOHA", "LOKR"):
        if not opts.component:
            comp, why = guess_component([k.rpartition(".")[0] for k in sd])
        out = lycoris.from_peft(sd, config, comp)
    elif config is not None:
        out = from_config(sd, config, comp)
    else:
        out = build_modules(sd, lambda path, rank: rank, where=comp)
        out.notes.append("no adapter_config.json: every module gets alpha = rank (scale 1)")
    out.notes.append(f"component {comp}: {why}")
    return out
