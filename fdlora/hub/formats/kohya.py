"""kohya-ss / A1111 LoRA for SD1.x and SDXL: ``lora_unet_<path with _>.lora_down.weight / .lora_up.weight / .alpha``.

Text encoders are ``lora_te_`` (SD1.x) or ``lora_te1_`` / ``lora_te2_`` (SDXL). SDXL files often
use the original (SGM) UNet block names (``input_blocks_4_1_...``), which need the UNet's
``layers_per_block`` (2 for SD1.5 and SDXL; `Options.layers_per_block` for others). LoCon conv
LoRAs (``..._resnets_0_conv1``, A [r, C, kh, kw], B [N, r, 1, 1]) load as conv2d modules.

Renaming is diffusers' own (`_maybe_map_sgm_blocks_to_diffusers`,
`_convert_non_diffusers_lora_to_diffusers`, then its PEFT key converters). Alphas are kohya's:
each module's own ``.alpha`` (scale alpha/rank), or rank when a module has none. diffusers instead
folds the alphas into one LoraConfig by name, which attributes them to the wrong modules when a
file's alphas differ between attention and other layers; fd-lora follows each module's ``.alpha``
by tensor identity through diffusers' renaming (the renaming moves tensors, never copies them).

LyCORIS modules in kohya naming (LoHa ``hada_*``, LoKr ``lokr_*``, full ``diff``/``diff_b``, LoCon
``lora_mid``, DoRA ``dora_scale``) become exact factors (fdlora.hub.formats.lycoris) that travel through
the same renaming as a lora_down/lora_up pair and are swapped back in by identity, so a file mixing them
with plain LoRA modules loads whole.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch

from ...errors import FormatError
from . import lycoris
from .base import Converted, Options, Raw
from .diffusers import convert_component

PREFIXES = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_")
FLUX_NAMES = re.compile(r"lora_unet_(double_blocks|single_blocks|final_layer)_")
SGM = ("input_blocks", "middle_block", "output_blocks")
SUFFIX = re.compile(r"\.(lora_down\.weight|lora_up\.weight|alpha)$")


def detect(raw: Raw) -> str | None:
    keys = list(raw.tensors)
    n = sum(k.startswith(PREFIXES) for k in keys)
    if not n and any(k.startswith(lycoris.UNET_NAMES) for k in keys):
        return f"{len(keys)} keys are a LyCORIS network on a diffusers UNet (lycoris_ read as kohya's lora_unet_)"
    if not n or any(FLUX_NAMES.match(k) for k in keys):
        return None
    sgm = " with SGM block names" if any(s in k for k in keys for s in SGM) else ""
    return f"{n} of {len(keys)} keys start with kohya prefixes lora_unet_/lora_te*_{sgm} (kohya-ss / A1111 SD/SDXL)"


def convert(raw: Raw, opts: Options) -> Converted:
    if not any(k.startswith(PREFIXES) for k in raw.tensors):  # a LyCORIS network on a UNet: kohya's names
        tensors = {("lora_unet_" + k[len(lycoris.PREFIX):] if k.startswith(lycoris.PREFIX) else k): v
                   for k, v in raw.tensors.items()}
        raw = Raw(tensors, raw.metadata, raw.config, raw.name)
    out = Converted()
    sd: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in raw.tensors.items():
        if not k.startswith(PREFIXES):
            out.unused[k] = "not a kohya key (no lora_unet_/lora_te*_ prefix)"
        elif (part := lycoris.split(k)) is not None:
            groups.setdefault(part[0], {})[part[1]] = v
        elif why := lycoris.why_other(k):
            out.dropped[k] = why
        else:
            out.unused[k] = "a kohya key that is neither lora_down, lora_up nor alpha"
    lyco = lycoris.build({n: p for n, p in groups.items() if lycoris.is_lycoris(p)}, out, where=raw.name)
    for name, p in groups.items():
        if name in lyco:  # exact factors, renamed as if they were this module's lora_down / lora_up
            sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"] = lyco[name].A, lyco[name].B
        elif not lycoris.is_lycoris(p):
            sd.update({f"{name}.{part}": t for part, t in p.items()})
    lyco_of = {id(m.A): name for name, m in lyco.items()}  # (SGM renaming changes names, not tensors)
    sd = _sgm_to_diffusers(sd, opts.layers_per_block, out)
    alpha_by_module = _pop_alphas(sd)
    module_of = {id(v): k.split(".")[0] for k, v in sd.items() if k.endswith(".lora_down.weight")}
    converted = _to_diffusers(sd, out)
    for comp in ("unet", "text_encoder", "text_encoder_2"):
        part = {k[len(comp) + 1:]: v for k, v in converted.items() if k.startswith(comp + ".")}
        if not part:
            continue
        comp_out = convert_component(comp, part)  # alpha = rank for now; kohya alphas follow by identity below
        mods = comp_out.components[comp]
        _apply_alphas(mods, module_of, alpha_by_module, comp)
        for path, m in mods.items():  # LyCORIS modules: their own ModuleLora back (scale, magnitude, origin)
            name = lyco_of.get(id(m.A))
            if name in lyco:
                mods[path] = lyco.pop(name)
                comp_out.matched -= 2  # (the stand-in lora_down / lora_up keys; build counted the real ones)
        out.merge(comp_out)
    stand_in = {f"{module_of[i]}.{part}" for i in lyco_of if i in module_of
                for part in ("lora_down.weight", "lora_up.weight")}
    whys = {k: out.dropped.pop(k) for k in list(out.dropped) if k in stand_in}
    for name in lyco:  # stand-ins diffusers could not place: report the file's own keys
        why = next(iter(whys.values()), "diffusers' kohya renaming did not place this module")
        out.matched -= len(groups[name])
        out.dropped.update({f"{name}.{k}": why for k in groups[name]})
    modules = set(module_of.values())
    for m in alpha_by_module:
        if m in modules:
            out.matched += 1
        else:
            out.unused[f"{m}.alpha"] = "an alpha for a module that has no lora_down/lora_up weights"
    return out


def _sgm_to_diffusers(sd: dict, layers_per_block: int, out: Converted) -> dict:
    if not any(s in k for k in sd for s in SGM):
        return sd
    from diffusers.loaders.lora_conversion_utils import _maybe_map_sgm_blocks_to_diffusers

    cfg = SimpleNamespace(layers_per_block=layers_per_block)
    try:
        return _maybe_map_sgm_blocks_to_diffusers(dict(sd), cfg)
    except (ValueError, IndexError, KeyError):
        pass  # find the modules it cannot map, one at a time
    mapped = {}
    for group in _groups(sd).values():
        try:
            mapped.update(_maybe_map_sgm_blocks_to_diffusers(dict(group), cfg))
        except (ValueError, IndexError, KeyError) as e:
            out.dropped.update(dict.fromkeys(group, f"SGM block name diffusers cannot map ({e})"))
    return mapped


def _pop_alphas(sd: dict) -> dict[str, float]:
    alphas = {}
    for k in [k for k in sd if k.endswith(".alpha")]:
        t = sd.pop(k)
        if not isinstance(t, torch.Tensor) or t.numel() != 1:
            raise FormatError(f"{k} must be a scalar, got shape {tuple(getattr(t, 'shape', ()))}.")
        alphas[k.split(".")[0]] = float(t)
    return alphas


def _to_diffusers(sd: dict, out: Converted) -> dict:
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_lora_to_diffusers

    try:
        return _convert_non_diffusers_lora_to_diffusers(dict(sd))[0]
    except (ValueError, KeyError, IndexError):
        pass  # find the modules it rejects, one at a time
    converted = {}
    for name, group in _groups(sd).items():
        try:
            converted.update(_convert_non_diffusers_lora_to_diffusers(dict(group))[0])
        except (ValueError, KeyError, IndexError) as e:
            why = "lora_down without lora_up" if isinstance(e, KeyError) else f"diffusers cannot rename it ({e})"
            out.dropped.update(dict.fromkeys(group, f"{name}: {why}"))
    return converted


def _groups(sd: dict) -> dict[str, dict]:
    groups: dict[str, dict] = {}
    for k, v in sd.items():
        groups.setdefault(k.split(".")[0], {})[k] = v
    return groups


def _apply_alphas(mods: dict, module_of: dict, alphas: dict[str, float], comp: str) -> None:
    """Give each module its kohya alpha, found through its lora_down tensor's identity."""
    for path, m in mods.items():
        name = module_of.get(id(m.A))
        if name is None:
            raise FormatError(f"{comp}: cannot trace {path} back to its kohya module, so its alpha is unknown; this "
                              "diffusers version copies tensors while renaming. Please report it to fd-lora.")
        m.alpha = alphas.get(name, float(m.rank))
