"""diffusers: what `save_lora_weights` writes (``pytorch_lora_weights.safetensors``).

Keys carry the pipeline component first (``unet.``, ``transformer.``, ``text_encoder.``,
``text_encoder_2.``), then the module path, in the PEFT names (``lora_A`` / ``lora_B``) or one of
diffusers' older namings (``to_q_lora.down``, ``lora_linear_layer.up``, ``.processor.``), which
diffusers' own converters rename. Alphas come, in diffusers' order of precedence, from the
``lora_adapter_metadata`` header (a LoraConfig per component, applied like a PEFT config), else
from per-module ``<path>.alpha`` keys (network alphas, e.g. ai-toolkit / TheLastBen Flux files),
else alpha = rank (scale 1). Unlike diffusers, a network alpha applies to exactly its own module.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import torch

from ...errors import FormatError
from .base import COMPONENTS, Converted, Options, Raw, build_modules, from_config, peft_key

METADATA_KEY = "lora_adapter_metadata"
DENOISERS = ("unet", "transformer")
OLD_ATTN = re.compile(r"\.(to_q|to_k|to_v|to_out)_lora\.")


def detect(raw: Raw) -> str | None:
    comps = Counter(k.split(".")[0] for k in raw.tensors if k.split(".")[0] in COMPONENTS)
    if comps:
        return f"keys start with component prefixes {dict(comps)} (the diffusers save_lora_weights layout)"
    return None


def convert(raw: Raw, opts: Options) -> Converted:
    meta = metadata_of(raw)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    out = Converted()
    for k, v in raw.tensors.items():
        comp, _, rest = k.partition(".")
        if comp in COMPONENTS and rest:
            groups.setdefault(comp, {})[rest] = v
        else:
            out.unused[k] = f"no component prefix ({', '.join(COMPONENTS)}) in a diffusers-layout file"
    for comp, sd in groups.items():
        cfg = None if meta is None else {k[len(comp) + 1:]: v for k, v in meta.items() if k.startswith(comp + ".")}
        part = convert_component(comp, sd, config=cfg or None)
        part.unused = {f"{comp}.{k}": why for k, why in part.unused.items()}  # as the file spells them
        part.dropped = {f"{comp}.{k}": why for k, why in part.dropped.items()}
        out.merge(part)
    if meta is not None:
        out.notes.append(f"alphas from the {METADATA_KEY!r} header")
    return out


def metadata_of(raw: Raw) -> dict[str, Any] | None:
    text = raw.metadata.get(METADATA_KEY)
    if not text:
        return None
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError):
        raise FormatError(f"{raw.name}: the {METADATA_KEY!r} header is not valid JSON; the file is corrupt.") from None
    if not isinstance(meta, dict):
        raise FormatError(f"{raw.name}: the {METADATA_KEY!r} header is not a JSON object.")
    return meta


def convert_component(comp: str, sd: dict[str, torch.Tensor], *, config: dict[str, Any] | None = None,
                      alphas: dict[str, float] | None = None) -> Converted:
    """One component's keys (prefix removed), in any diffusers naming, to modules."""
    sd = to_peft_keys(sd, comp)
    network = {k[: -len(".alpha")]: sd.pop(k) for k in [k for k in sd if k.endswith(".alpha")]}
    if config is not None:
        out = from_config(sd, config, comp)
        out.unused.update({f"{p}.alpha": "the metadata header gives the alphas" for p in network})
        return out
    alpha = dict(alphas or {})
    for path, t in network.items():
        if not isinstance(t, torch.Tensor) or t.numel() != 1 or not t.is_floating_point():
            raise FormatError(f"{comp}: {path}.alpha must be a float scalar, got {getattr(t, 'shape', t)}.")
        alpha[path] = float(t)
    out = build_modules(sd, lambda path, rank: alpha.get(path, rank), where=comp)
    out.matched += sum(p in out.components[comp] for p in network)
    out.unused.update({f"{p}.alpha": "an alpha for a module that has no LoRA weights" for p in network
                       if p not in out.components[comp]})
    return out


def to_peft_keys(sd: dict[str, torch.Tensor], comp: str) -> dict[str, torch.Tensor]:
    """Rename diffusers' older key spellings to PEFT's with diffusers' own converters (as its loaders do)."""
    odd = [k for k in sd if not peft_key(k) and not k.endswith(".alpha")]
    if not odd:
        return sd
    from diffusers.utils.state_dict_utils import (
        StateDictType,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    if comp in DENOISERS:
        return convert_unet_state_dict_to_peft(sd)
    if any(OLD_ATTN.search(k) for k in odd):
        return convert_state_dict_to_peft(sd, original_type=StateDictType.DIFFUSERS_OLD)
    if any("lora_linear_layer" in k or ".lora.down." in k or ".lora.up." in k for k in odd):
        return convert_state_dict_to_peft(sd, original_type=StateDictType.DIFFUSERS)
    return sd
