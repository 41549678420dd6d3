"""Flux LoRAs in the layouts diffusers converts, with diffusers' own converters.

- kohya / sd-scripts: ``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`` (+ ``lora_te1_``),
  with ComfyUI's ``diffusion_model.`` / ``text_encoders.clip_l.transformer.`` prefixes and the
  ``lora_transformer_`` "mixture" layout: `_convert_kohya_flux_lora_to_diffusers`. Alphas are
  folded into the weights there (scale 1). Fused qkv / linear1 LoRAs become to_q/to_k/to_v(/proj_mlp).
- XLabs: ``double_blocks.0.processor.qkv_lora1.down.weight``: `_convert_xlabs_flux_lora_to_diffusers`.
- fal Kontext: ``base_model.model.double_blocks.0.img_attn.qkv.lora_A.weight`` (full Flux only):
  `_convert_fal_kontext_lora_to_diffusers`.
- ai-toolkit and other diffusers-layout files (``transformer.<path>.lora_A.weight``) are the
  diffusers format. BFL Control LoRAs (which widen ``x_embedder``) raise UnsupportedFeatureError.

diffusers' kohya converter drops unknown ``lora_unet_`` modules silently, so fd-lora feeds it one
module at a time and reports every module it returns nothing for, and drops (with the reason) modules
it maps onto the same target (``lora_transformer_`` files: a block's ff / proj_mlp / proj_out all
land on the bare block name there, and one would silently overwrite the other); T5, ``position_embedding``,
``diff``/``diff_b`` and ``text_projection`` keys are dropped (as diffusers does) with that reason.

DoRA (LyCORIS ``dora_wd`` through sd-scripts: ``<module>.dora_scale`` [N, 1] next to lora_down / lora_up / alpha):
diffusers' FluxLoraLoaderMixin drops the magnitudes with a warning and loads the plain LoRA, which is not the
adapter that was trained. fd-lora keeps them (`_magnitudes`): the output is PEFT's DoRA on W + ΔW plus LyCORIS's
eps in the norm (fdlora.layers.modules.dora), split row-exactly onto to_q / to_k / to_v where the file fuses them. The
per-input-channel DoRA of old LyCORIS versions (dora_scale [1, K]) cannot be split and is refused.
"""

from __future__ import annotations

import math
import re

import torch

from ...errors import AdapterShapeError, FormatError, UnsupportedFeatureError
from . import lycoris
from .base import Converted, Options, Raw
from .diffusers import convert_component

KOHYA = re.compile(r"(lora_unet_(double_blocks|single_blocks|final_layer)_|lora_transformer_|diffusion_model\.|"
                   r"text_encoders\.clip_l\.)")
XLABS = re.compile(r"(diffusion_model\.)?(double|single)_blocks\.\d+\.processor\.(qkv|proj)_lora\d?\.(down|up)\.weight")
MODULE_SUFFIX = re.compile(r"\.(lora_down\.weight|lora_up\.weight|alpha|dora_scale|diff_b|diff)$")
DROPS = (
    (re.compile(r"text_encoders\.t5xxl\."), "a T5 text-encoder LoRA: diffusers does not load these for Flux"),
    (re.compile(r"position_embedding"), "a position_embedding LoRA: not a Linear layer"),
    (re.compile(r"\.diff(_b)?$"), "a full weight/bias difference (diff/diff_b): fd-lora applies low-rank deltas"),
    (re.compile(r"text_projection"), "a text_projection LoRA: diffusers does not load it for Flux"),
)


def detect_kohya(raw: Raw) -> str | None:
    keys = list(raw.tensors)
    if not any(k.endswith(".lora_down.weight") for k in keys):
        return None
    hit = next((k for k in keys if KOHYA.match(k)), None)
    return f"kohya lora_down/lora_up keys with Flux names (e.g. {hit!r})" if hit else None


def detect_xlabs(raw: Raw) -> str | None:
    hit = next((k for k in raw.tensors if ".processor." in k and XLABS.fullmatch(k)), None)
    return f"XLabs processor keys (e.g. {hit!r})" if hit else None


def detect_fal_kontext(raw: Raw) -> str | None:
    hit = next((k for k in raw.tensors if k.startswith("base_model.model.double_blocks.")), None)
    return f"Flux (BFL) block names under base_model.model. (e.g. {hit!r}): fal Kontext layout" if hit else None


def detect_bfl_control(raw: Raw) -> str | None:
    return "query_norm.scale keys: a BFL Flux Control LoRA" if any("query_norm.scale" in k for k in raw.tensors) \
        else None


def _check_alpha(t: torch.Tensor | None, name: str) -> None:
    """diffusers' converter splits alpha/rank between down and up in a loop that never ends for a negative or
    infinite alpha (`while scale_down * 2 < scale_up`): refuse those before calling it."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or not t.is_floating_point():
        raise FormatError(f"{name}.alpha must be a float scalar, got {getattr(t, 'dtype', type(t).__name__)} "
                          f"{tuple(getattr(t, 'shape', ()))}; the file is corrupt.")
    a = float(t)
    if not (math.isfinite(a) and a > 0):
        raise FormatError(f"{name}.alpha is {a:g}; a kohya Flux alpha must be a positive finite number. The file is "
                          "corrupt.")


def convert_kohya(raw: Raw, opts: Options) -> Converted:
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    out = Converted()
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in raw.tensors.items():
        why = next((w for pat, w in DROPS if pat.search(k)), None)
        if why:
            out.dropped[k] = why
        elif MODULE_SUFFIX.search(k):
            groups.setdefault(MODULE_SUFFIX.sub("", k), {})[k] = v
        else:
            out.unused[k] = "not a kohya key (lora_down / lora_up / alpha)"
    results: dict[str, dict[str, torch.Tensor]] = {}  # module name -> its converted keys
    owner: dict[str, str] = {}  # converted key -> the module name it came from
    mags: dict[str, dict[tuple[str, str], tuple[torch.Tensor, float]]] = {}  # module name -> its DoRA magnitudes
    for name, group in groups.items():
        _check_alpha(group.get(name + ".alpha"), name)
        lora = {k: v for k, v in group.items() if not k.endswith(".dora_scale")}
        if len(lora) < len(group) and name + ".lora_down.weight" not in group:
            out.unused.update(dict.fromkeys(group, "a dora_scale / alpha for a module that has no lora_down / lora_up"))
            continue
        try:
            got = _convert_kohya_flux_lora_to_diffusers(dict(lora))
        except Exception as e:  # diffusers' converter raises assorted types on keys it does not expect
            out.dropped.update(dict.fromkeys(group, f"{name}: diffusers' Flux converter rejects it ({e})"))
            continue
        if not got:
            out.dropped.update(dict.fromkeys(group, f"{name}: diffusers' Flux converter has no mapping for it"))
            continue
        if len(lora) < len(group):  # a DoRA module (dora_scale): diffusers drops the magnitudes, fd-lora keeps them
            mags[name] = _magnitudes(name, group)
        clash = sorted({owner[k] for k in got if k in owner})
        if clash:  # two modules mapped onto one: neither can be applied faithfully
            for other in [name, *clash]:
                out.dropped.update(dict.fromkeys(groups[other], f"{other}: diffusers' Flux converter maps it onto "
                                                 f"the same module as {[n for n in [name, *clash] if n != other]}"))
                for k in results.pop(other, {}):
                    owner.pop(k, None)
            continue
        results[name] = got
        owner.update(dict.fromkeys(got, name))
    converted = {k: v for got in results.values() for k, v in got.items()}
    out.merge(_components(converted, "alphas folded into the weights by diffusers' converter (scale 1)"))
    for (comp, path), (mag, eps) in ((k, v) for n in results for k, v in mags.get(n, {}).items()):
        m = out.components[comp][path]
        out.components[comp][path] = m.replace(m.A, m.B, m.bias, magnitude=mag, dora_eps=eps)
    out.matched = sum(len(groups[n]) for n in results)  # count input keys, not the (split) converted ones
    return out


def _magnitudes(name: str, group: dict[str, torch.Tensor]) -> dict[tuple[str, str], tuple[torch.Tensor, float]]:
    """A module's ``dora_scale`` [N] -> {(component, path): (its rows of the magnitude, eps)} for the modules diffusers'
    converter makes of it. The magnitude travels through that converter as the lora_up of a rank-1 stand-in (alpha
    1: nothing rescaled), so it is split (fused qkv / linear1 onto to_q / to_k / to_v / proj_mlp) and reordered
    (final_layer's scale / shift swap) exactly as the module's rows are. Exact because DoRA here is per output row:
    each row's norm is of that row of W + ΔW alone, and to_q's rows of W are the fused qkv's."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    down, up, t = group[name + ".lora_down.weight"], group[name + ".lora_up.weight"], group[name + ".dora_scale"]
    N, K = up.shape[0], down.shape[1]
    per_output, per_input = t.numel() == N and t.shape[0] == N, t.numel() == K and t.shape[-1] == K
    if not (per_output or per_input):
        raise AdapterShapeError(f"{name}.dora_scale {tuple(t.shape)} fits neither the module's {N} outputs nor its {K} "
                                "inputs (lora_up / lora_down); the file is corrupt.")
    mag, eps = lycoris.dora_scale(name, t, N)  # (per-input-channel [1, K]: refused, naming it)
    stand_in = {name + ".lora_down.weight": torch.ones(1, down.shape[1]), name + ".lora_up.weight": mag[:, None],
                name + ".alpha": torch.tensor(1.0)}
    rows = _components(_convert_kohya_flux_lora_to_diffusers(stand_in), "").components
    return {(comp, path): (m.B[:, 0].contiguous(), eps) for comp, mods in rows.items() for path, m in mods.items()}


def convert_xlabs(raw: Raw, opts: Options) -> Converted:
    from diffusers.loaders.lora_conversion_utils import _convert_xlabs_flux_lora_to_diffusers

    return _whole(_convert_xlabs_flux_lora_to_diffusers, raw, "XLabs LoRAs carry no alpha (scale 1, as diffusers)")


def convert_fal_kontext(raw: Raw, opts: Options) -> Converted:
    from diffusers.loaders.lora_conversion_utils import _convert_fal_kontext_lora_to_diffusers

    return _whole(_convert_fal_kontext_lora_to_diffusers, raw, "fal Kontext LoRAs carry no alpha (scale 1)")


def convert_bfl_control(raw: Raw, opts: Options) -> Converted:
    raise UnsupportedFeatureError("BFL Flux Control LoRAs widen the transformer's x_embedder and replace norm "
                                  "weights; fd-lora only adds low-rank deltas. Load it with diffusers instead.")


def _whole(fn, raw: Raw, note: str) -> Converted:
    try:
        converted = fn(dict(raw.tensors))
    except Exception as e:  # diffusers' converters raise assorted types on keys they do not expect
        raise FormatError(f"{raw.name}: diffusers' converter rejects this file ({type(e).__name__}: {e}).") from None
    out = _components(converted, note)
    out.matched = len(raw.tensors) - len(out.unused) - len(out.dropped)
    return out


def _components(converted: dict[str, torch.Tensor], note: str) -> Converted:
    out = Converted(notes=[note])
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in converted.items():
        comp, _, rest = k.partition(".")
        if comp in ("transformer", "text_encoder") and rest:
            parts.setdefault(comp, {})[rest] = v
        else:
            out.unused[k] = "diffusers' converter left it without a transformer/text_encoder prefix"
    for comp, sd in parts.items():
        out.merge(convert_component(comp, sd))
    return out
