"""The format table: each entry a detector (a reason string, or None) and a converter to `LoraAdapter` weights.

Order matters only where layouts overlap: the specific Flux layouts come before the generic ones,
and the first detector that recognises the input wins (the others that also matched are reported).
An input no detector recognises raises FormatError listing what every detector looked for.
"""

from __future__ import annotations

from ...errors import FdLoraError, FormatError
from . import diffusers, flux, kohya, lycoris, peft
from .base import COMPONENTS, MODEL, Converted, Format, Options, Raw

FORMATS: tuple[Format, ...] = (
    Format("flux-bfl-control", "query_norm.scale keys (a BFL Flux Control LoRA)",
           flux.detect_bfl_control, flux.convert_bfl_control),
    Format("flux-kohya", "kohya lora_down/lora_up keys with Flux names (lora_unet_double_blocks_..., "
           "diffusion_model., lora_transformer_, text_encoders.clip_l.)", flux.detect_kohya, flux.convert_kohya),
    Format("flux-xlabs", "XLabs keys <double|single>_blocks.N.processor.<qkv|proj>_loraN.<down|up>.weight",
           flux.detect_xlabs, flux.convert_xlabs),
    Format("flux-fal-kontext", "keys under base_model.model.double_blocks.", flux.detect_fal_kontext,
           flux.convert_fal_kontext),
    Format("peft", "an adapter_config.json, or keys starting with base_model.model.", peft.detect, peft.convert),
    Format("lycoris", "keys starting with lycoris_ (a LyCORIS create_lycoris network's state dict)", lycoris.detect,
           lycoris.convert),
    Format("kohya", "keys starting with lora_unet_ / lora_te_ / lora_te1_ / lora_te2_ (kohya-ss / A1111 SD1.x, "
           "SDXL)", kohya.detect, kohya.convert),
    Format("diffusers", f"keys starting with a component prefix ({', '.join(c + '.' for c in COMPONENTS)})",
           diffusers.detect, diffusers.convert),
    Format("peft-bare", "keys <module>.lora_A.weight / .lora_B.weight without a component prefix",
           peft.detect_bare, peft.convert_bare),
)


def detect(raw: Raw, family=None) -> tuple[Format, str, list[str]]:
    """(the format, why, names of the other formats that also matched).

    `family` (a pipeline's LoRA family, fdlora.integrations.diffusers.family) is asked first, and it
    says which table formats apply to it (Flux / SD detectors only for those families)."""
    table = FORMATS if family is None else (family.format, *(f for f in FORMATS if family.allows(f.name)))
    hits = [(f, why) for f in table if (why := f.detect(raw))]
    if not hits:
        sample = list(raw.tensors)[:6]
        tried = "; ".join(f"{f.name}: needs {f.expects}" for f in table)
        said = family.why_not(raw) if family is not None else None
        raise FormatError(f"{raw.name}: no known LoRA format matches its {len(raw.tensors)} keys (e.g. {sample}). "
                          f"Tried {tried}." + (f" {said}." if said else "")
                          + " If it is a LoRA in another layout, convert it to PEFT or diffusers format.")
    return hits[0][0], hits[0][1], [f.name for f, _ in hits[1:]]


def convert(fmt: Format, raw: Raw, opts: Options) -> Converted:
    """Run a converter; anything but an fd-lora error from the code it calls becomes a FormatError."""
    try:
        return fmt.convert(raw, opts)
    except FdLoraError:
        raise
    except ModuleNotFoundError as e:  # a converter that needs an extra (diffusers'): say which, not "bad file"
        from ...extras import translate

        raise translate(e, f"reading a {fmt.name} LoRA") from None
    except Exception as e:
        raise FormatError(f"{raw.name}: the {fmt.name} converter failed ({type(e).__name__}: {e}); the file does not "
                          "follow that layout.") from None


__all__ = ["COMPONENTS", "FORMATS", "MODEL", "Converted", "Format", "Options", "Raw", "convert", "detect"]
