"""A pipeline's LoRA family: what diffusers' own `*LoraLoaderMixin` of that pipeline says, used as data.

    fam = family_of(pipe)          # FluxPipeline -> Flux, WanPipeline -> Wan, a UNet -> StableDiffusion ...
    fam.loadable                   # ("transformer", "transformer_2")    (_lora_loadable_modules)
    fam.denoiser                   # "transformer"                       (transformer_name / unet_name)
    fam.format                     # a format-table entry asked before the generic ones

Nothing here is a per-family list: the family is the mixin in the pipeline's MRO, and its community
layouts (ComfyUI ``diffusion_model.``, musubi / kohya ``lora_unet_``, unprefixed ``lora_down + alpha``
...) are converted by that mixin's own `lora_state_dict` (diffusers' converters), after which the
result is the diffusers layout (fdlora.hub.formats.diffusers). A new diffusers family therefore
loads without fd-lora code. The exceptions, where diffusers itself special-cases, are `EXCEPTIONS`:

- StableDiffusion / StableDiffusionXL / Flux: fd-lora's own format table (kohya, flux-*) already
  runs diffusers' converters module by module, reporting every module they skip; it is kept for
  them (`TABLE_FAMILIES`), and its Flux- and SD-specific detectors are asked for no other family
  (a Wan ``diffusion_model.`` file is no longer "detected as flux-kohya").
- Wan 2.2: `load_into_transformer_2=True` loads the ``transformer.`` weights into `transformer_2`
  (pipeline.load_fd_lora), as `WanLoraLoaderMixin.load_lora_weights` does.
- Flux Control LoRAs widen `x_embedder` and replace `norm_out` weights (diffusers swaps modules);
  fd-lora only adds low-rank deltas and refuses them (hub.formats.flux.convert_bfl_control).
- Wan I2V: diffusers pads a T2V LoRA with zero ``add_k_proj`` / ``add_v_proj`` LoRAs
  (`_maybe_expand_t2v_lora_for_i2v`); zeros change nothing, so fd-lora does not add them.
- Qwen-Image / Z-Image key fix-ups (``diffusion_model.``, ``default.`` and alpha handling) run
  inside their `lora_state_dict`, so they need nothing here.

Accounting: diffusers' converters mostly raise on keys they do not map (that becomes a FormatError
naming diffusers' message); where one skips keys instead (Wan's ``.diff``), or returns fewer modules
than the file holds, the keys or the count are reported as dropped, and diffusers' own log lines
during the conversion are kept as notes.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fdlora.errors import FdLoraError, FormatError, UnsupportedFeatureError
from fdlora.hub.formats import diffusers as diffusers_format
from fdlora.hub.formats.base import Converted, Format, Options, Raw

# families whose community layouts fd-lora's own table converts (module by module, with diffusers' converters)
TABLE_FAMILIES = {"StableDiffusion": ("kohya",), "StableDiffusionXL": ("kohya",), "Flux": (
    "flux-bfl-control", "flux-kohya", "flux-xlabs", "flux-fal-kontext")}
FAMILY_FORMATS = frozenset(f for fs in TABLE_FAMILIES.values() for f in fs)  # asked only for their families
# where diffusers' own loader special-cases a family (see the module docstring)
EXCEPTIONS = {
    "Wan": "load_into_transformer_2=True loads the transformer. weights into transformer_2",
    "Flux": "Control LoRAs (x_embedder widening, norm_out weights) are refused: fd-lora adds low-rank deltas only",
    "QwenImage": "key fix-ups run inside diffusers' lora_state_dict",
    "ZImage": "key fix-ups run inside diffusers' lora_state_dict",
}
# where diffusers reads fewer components than the mixin's _lora_loadable_modules names
LOADED_BY_DIFFUSERS = {"Wan": ("transformer",), "SkyReelsV2": ("transformer",)}
MODULE_SUFFIX = re.compile(r"\.(lora_down\.weight|lora_up\.weight|lora_A\.weight|lora_B\.weight|lora_A|lora_B|"
                           r"lora_B\.bias|alpha|diff|diff_b|dora_scale)$")
LORA_PART = re.compile(r"\.(lora_down|lora_A)(\.weight)?$")


@dataclass(frozen=True)
class Family:
    """One diffusers LoRA loader mixin, read as data."""

    mixin: type

    @property
    def name(self) -> str:
        return self.mixin.__name__.removesuffix("LoraLoaderMixin")

    @property
    def loadable(self) -> tuple[str, ...]:
        return tuple(self.mixin._lora_loadable_modules)

    @property
    def denoiser(self) -> str:
        return getattr(self.mixin, "transformer_name", None) if "transformer" in self.loadable \
            else getattr(self.mixin, "unet_name", None) or self.loadable[0]

    @property
    def loaded_by_diffusers(self) -> tuple[str, ...]:
        """The components diffusers' load_lora_weights actually reads from a file."""
        return LOADED_BY_DIFFUSERS.get(self.name, self.loadable)

    def allows(self, format_name: str) -> bool:
        """Whether a table format applies to this family (Flux / SD-only detectors are asked for theirs only)."""
        return format_name not in FAMILY_FORMATS or format_name in TABLE_FAMILIES.get(self.name, ())

    @property
    def format(self) -> Format:
        return Format(f"{self.name.lower()}-diffusers-converter",
                      f"a layout {self.mixin.__name__}.lora_state_dict converts", self.detect, self.convert)

    # --- the format entry ----------------------------------------------------------------------
    def detect(self, raw: Raw) -> str | None:
        if self.name in TABLE_FAMILIES or raw.config is not None or _already_diffusers(raw):
            return None
        got = self._converted(raw)
        if isinstance(got, Exception) or got is None:
            return None
        sample = next(iter(raw.tensors))
        return (f"a {self.name} layout (e.g. {sample!r}) that diffusers' {self.mixin.__name__}.lora_state_dict "
                "converts")

    def why_not(self, raw: Raw) -> str | None:
        """diffusers' own error for this file, when its converter rejected it (for the no-format error)."""
        got = raw.__dict__.get("_fd_family", {}).get(self.name)
        return f"{self.mixin.__name__}.lora_state_dict: {got}" if isinstance(got, Exception) else None

    def convert(self, raw: Raw, opts: Options) -> Converted:
        got = self._converted(raw)
        if isinstance(got, Exception):
            raise FormatError(f"{raw.name}: diffusers' {self.mixin.__name__}.lora_state_dict rejects it "
                              f"({type(got).__name__}: {got}).")
        sd, logs = got
        out = diffusers_format.convert(Raw(sd, raw.metadata, None, raw.name), opts)
        out.notes.append(f"converted by diffusers' {self.mixin.__name__}.lora_state_dict (alphas as it folds them)")
        out.notes += [f"diffusers: {line}" for line in logs]
        # keys diffusers skips without an error, and modules that went missing
        for k in raw.tensors:
            if k.endswith(".diff") or (k.endswith(".diff_b") and "norm" in k):
                out.dropped[k] = ("a full weight / bias difference (diff, diff_b of a norm): diffusers' converter skips"
                                  " "
                                  "it (fd-lora applies low-rank deltas)")
        n_in = len({MODULE_SUFFIX.sub("", k) for k in raw.tensors if LORA_PART.search(k)})
        n_out = sum(len(m) for m in out.components.values())
        if n_out < n_in:
            out.dropped[f"<{n_in - n_out} modules>"] = (f"diffusers' converter returned {n_out} modules for the "
                                                        f"file's {n_in}")
        # converted keys map back to the file's only by count: keys of the converted dict that nothing reads are
        # reported under their converted names, and counted against the file's matched keys
        lost = [k for k in (*out.unused, *out.dropped) if k not in raw.tensors and not k.startswith("<")]
        out.dropped.update({f"{k} (after diffusers' conversion)": why for k, why in out.unused.items()
                            if k not in raw.tensors})
        out.unused = {k: why for k, why in out.unused.items() if k in raw.tensors}
        real = sum(k in raw.tensors for k in (*out.dropped, *out.unused))
        out.matched = max(0, len(raw.tensors) - real - len(lost))
        return out

    def _converted(self, raw: Raw) -> tuple[dict, list[str]] | Exception | None:
        memo = raw.__dict__.setdefault("_fd_family", {})
        if self.name not in memo:
            memo[self.name] = self._run(raw)
        return memo[self.name]

    def _run(self, raw: Raw):
        if any(k.endswith(".dora_scale") for k in raw.tensors):
            return UnsupportedFeatureError("a DoRA (dora_scale) file: diffusers drops the magnitudes, which changes "
                                           "the output; fd-lora does not load it as plain LoRA.")
        kw = {"return_lora_metadata": True}
        if "return_alphas" in inspect.signature(self.mixin.lora_state_dict).parameters:
            kw["return_alphas"] = True
        try:
            with _diffusers_log() as logs:
                got = self.mixin.lora_state_dict(dict(raw.tensors), **kw)
        except Exception as e:  # diffusers' converters raise assorted types on keys they do not expect
            return e
        sd = got[0] if isinstance(got, tuple) else got
        alphas = got[1] if isinstance(got, tuple) and len(got) == 3 else None
        if set(sd) == set(raw.tensors):
            return None  # the family has nothing to convert here: the generic table decides
        for k, a in (alphas or {}).items():  # network alphas (SD-style mixins): as `<path>.alpha` keys
            sd[f"{k}.alpha"] = a if hasattr(a, "numel") else _scalar(a)
        return sd, logs


def _scalar(a: Any):
    import torch

    return torch.tensor(float(a))


def _already_diffusers(raw: Raw) -> bool:
    from fdlora.hub.formats.base import COMPONENTS, peft_key

    return all(k.partition(".")[0] in COMPONENTS and (peft_key(k) or k.endswith(".alpha")) for k in raw.tensors)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(" ".join(record.getMessage().split())[:300])


@contextmanager
def _diffusers_log() -> Iterator[list[str]]:
    """Collect what diffusers' loaders log (INFO and up) during a conversion: dropped keys are said there."""
    log = logging.getLogger("diffusers.loaders")
    h, level = _Lines(), log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        yield h.lines
    finally:
        log.removeHandler(h)
        log.setLevel(level)


def family_of(obj: Any) -> Family | None:
    """The LoRA family of a pipeline (instance or class), from its diffusers `*LoraLoaderMixin`; None if it has none."""
    given = getattr(obj, "_fd_family", None)  # a model-level holder (fdlora.integrations.diffusers.model)
    if isinstance(given, Family):
        return given
    cls = obj if isinstance(obj, type) else type(obj)
    for base in cls.__mro__:
        if base.__name__.endswith("LoraLoaderMixin") and "_lora_loadable_modules" in base.__dict__ \
                and base.__module__.startswith("diffusers."):
            return Family(base)
    return None


def mixins() -> dict[str, type]:
    """Every LoRA loader mixin of the installed diffusers, by name."""
    from diffusers.loaders import lora_pipeline

    return {n: c for n, c in vars(lora_pipeline).items()
            if n.endswith("LoraLoaderMixin") and isinstance(c, type) and "_lora_loadable_modules" in c.__dict__}


# model classes whose name does not start with their family's
MODEL_FAMILY = {"UNet2DConditionModel": "StableDiffusionXL", "ChromaTransformer2DModel": "Flux",
                "SD3Transformer2DModel": "SD3"}


def family_of_model(model: Any) -> Family | None:
    """The family of a diffusers model: the mixin whose family name is the longest prefix of the model class name
    (WanTransformer3DModel -> Wan, QwenImageTransformer2DModel -> QwenImage, Flux2Transformer2DModel -> Flux2)."""
    name = type(model).__name__
    ms = mixins()
    fam = MODEL_FAMILY.get(name)
    if fam is None:
        fams = [n.removesuffix("LoraLoaderMixin") for n in ms]
        hits = [f for f in fams if f and name.lower().startswith(f.lower())]
        fam = max(hits, key=len, default=None)
    if fam is None:
        return None
    mixin = ms.get(f"{fam}LoraLoaderMixin")
    if mixin is None:
        raise FdLoraError(f"no diffusers LoRA loader mixin {fam}LoraLoaderMixin in this diffusers.")
    return Family(mixin)
