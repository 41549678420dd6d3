"""What every format shares: the detector's input, the converter's output, and the PEFT-key builder.

Every converter ends in `build_modules`: a state dict already in PEFT key form
(``<module path>.lora_A.weight`` / ``.lora_B.weight`` / ``.lora_B.bias``) plus a rule giving each
module's alpha becomes `ModuleLora`s, and every key that did not become one is accounted for, as
*unused* (nothing would read it) or *dropped* (it means something fd-lora does not apply), with why.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import AdapterShapeError, FormatError, UnsupportedFeatureError
from ...extras import detached_import
from ..adapter import ModuleLora

COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
MODEL = "model"  # the component of a single-model adapter whose target cannot be told from its keys
_PEFT_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_B.bias")
MAGNITUDE = (".lora_magnitude_vector", ".lora_magnitude_vector.weight")  # PEFT DoRA m, as saved


def peft_key(key: str) -> tuple[str, str] | None:
    """(module path, part) of a PEFT-form key ``<path>.lora_A.weight | .lora_B.weight | .lora_B.bias`` with a
    non-empty path, or None. String operations, not a regex: a load splits every key of the file a few times."""
    if not key.endswith(_PEFT_SUFFIXES):
        return None
    head, _, tail = key.rpartition(".")
    path, _, lora = head.rpartition(".")
    return (path, f"{lora}.{tail}") if path else None
AlphaRule = Callable[[str, int], float]  # (module path, rank) -> alpha

# LoraConfig fields that change what a loaded adapter computes and that fd-lora does not implement
UNSUPPORTED_FIELDS = {  # (use_dora is served: fdlora.layers.modules.dora)
    "use_qalora": "QA-LoRA", "use_bdlora": "BD-LoRA",
    "alora_invocation_tokens": "aLoRA (activated LoRA)", "arrow_config": "Arrow routing",
    "kasa_config": "KaSA", "velora_config": "VeLoRA", "monteclora_config": "MonteCLoRA",
    "target_parameters": "LoRA on parameters such as MoE experts, which only the model's own load can place: "
                         "fdlora.load_fd_lora(model, source)", "layer_replication": "layer replication",
    "trainable_token_indices": "trainable tokens",
}


@dataclass
class Raw:
    """What a detector sees: the tensors, the safetensors header metadata, the PEFT config if any."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    name: str = "<memory>"


@dataclass
class Options:
    component: str | None = None  # force the component of single-model formats (PEFT)
    layers_per_block: int = 2  # SGM (original SD) block numbering of kohya SDXL files; 2 for SD1.5 and SDXL


@dataclass
class Converted:
    """A converter's result: per component, module path -> weights; and the fate of every other key."""

    components: dict[str, dict[str, ModuleLora]] = field(default_factory=dict)
    rslora: dict[str, bool] = field(default_factory=dict)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)  # effective config per component
    matched: int = 0
    unused: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    saved: dict[str, str] = field(default_factory=dict)  # full module copies of the config's modules_to_save
    notes: list[str] = field(default_factory=list)

    def merge(self, other: Converted) -> Converted:
        for comp, mods in other.components.items():
            self.components.setdefault(comp, {}).update(mods)
        self.rslora.update(other.rslora)
        self.configs.update(other.configs)
        self.matched += other.matched
        self.unused.update(other.unused)
        self.dropped.update(other.dropped)
        self.saved.update(other.saved)
        self.notes += other.notes
        return self


@dataclass(frozen=True)
class Format:
    """A detector (a reason string when it recognises the input, else None) and its converter."""

    name: str
    expects: str  # what the detector looks for; listed when no format matches
    detect: Callable[[Raw], str | None]
    convert: Callable[[Raw, Options], Converted]


def build_modules(sd: dict[str, torch.Tensor], alpha_of: AlphaRule, *, where: str, lora_bias: bool = True,
                  rank_of: Callable[[str], int | None] | None = None) -> Converted:
    """PEFT-form keys -> `ModuleLora`s; `where` prefixes messages (e.g. 'unet'). Raises only fd-lora errors."""
    out = Converted()
    parts: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    magnitudes: dict[str, tuple[str, torch.Tensor]] = {}
    for key, t in sd.items():
        m = peft_key(key)
        if m is None and key.endswith(MAGNITUDE):  # DoRA: attached to its module below
            magnitudes[key.rpartition(".lora_magnitude_vector")[0]] = (key, t)
            continue
        if m is None:
            _classify_other(key, out, where)
            continue
        if m[1] == "lora_B.bias" and not lora_bias:
            out.unused[key] = "a lora_B bias, but the config has lora_bias=False (PEFT would not load it)"
            continue
        parts.setdefault(m[0], {})[m[1]] = (key, t)
    mods: dict[str, ModuleLora] = {}
    for path, p in parts.items():
        if "lora_A.weight" not in p or "lora_B.weight" not in p:
            have, missing = next(iter(p)), "lora_B" if "lora_A.weight" in p else "lora_A"
            for key, _ in p.values():
                out.dropped[key] = f"{path} has {have.split('.')[0]} but no {missing}"
            continue
        A, B = p["lora_A.weight"][1], p["lora_B.weight"][1]
        bias = p.get("lora_B.bias", (None, None))[1]
        for key, t in p.values():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise FormatError(f"{where}: {key} is {getattr(t, 'dtype', type(t).__name__)}; LoRA weights must "
                                  "be floating point. The file is not a LoRA adapter (or is corrupt).")
        try:
            ml = ModuleLora(A, B, bias=bias)
        except AdapterShapeError as e:
            raise AdapterShapeError(f"{where}: {path}: {e}") from None
        expected = rank_of(path) if rank_of else None
        if expected is not None and expected != ml.rank:
            raise FormatError(f"{where}: the config gives {path} rank {expected} but its tensors have rank {ml.rank}; "
                              "the config does not belong to these weights.")
        if bias is not None and tuple(bias.shape) != (ml.out_features,):
            raise AdapterShapeError(f"{where}: {path}: lora_B bias {tuple(bias.shape)} does not match B's "
                                    f"{ml.out_features} outputs.")
        try:
            ml.alpha = float(alpha_of(path, ml.rank))
        except (FormatError, OverflowError, TypeError, ValueError) as e:
            raise FormatError(f"{where}: {path}: {e}") from None
        if path in magnitudes:
            key, t = magnitudes.pop(path)
            if bias is not None:
                raise UnsupportedFeatureError(f"{where}: {path} has both a DoRA magnitude and a lora_B bias; fd-lora "
                                              "does not combine the two. Merge the adapter with PEFT.")
            ml.magnitude = magnitude_of(f"{where}: {path}", t, ml.out_features)
            out.matched += 1
        mods[path] = ml
        out.matched += len(p)
    for key, _ in magnitudes.values():
        out.dropped[key] = "a DoRA magnitude for a module that has no lora_A / lora_B"
    out.components[where] = mods
    return out


def magnitude_of(name: str, t: torch.Tensor, N: int) -> torch.Tensor:
    """PEFT's DoRA ``lora_magnitude_vector`` ([N], or [1, N, 1, 1] for convs) -> [N] fp32."""
    if t.numel() != N:
        raise AdapterShapeError(f"{name}: DoRA magnitude {tuple(t.shape)} does not match the module's {N} outputs.")
    return t.detach().reshape(N).float()


def _classify_other(key: str, out: Converted, where: str) -> None:
    if key.endswith("dora_scale"):
        out.dropped[key] = "a kohya/LyCORIS dora_scale among PEFT keys: it belongs to a lora_down/lora_up module"
    elif "lora_embedding_" in key:
        out.dropped[key] = "embedding LoRA (lora_embedding_A/B): fd-lora wraps Linear and Conv2d layers only"
    elif key.endswith((".weight", ".bias")) and key.count(".") >= 2 and "lora" not in key.split(".")[-2]:
        out.dropped[key] = ("a full base-layer tensor (PEFT modules_to_save or bias='all'): fd-lora applies LoRA "
                            "deltas and never replaces base weights")
    else:
        out.unused[key] = "not a LoRA weight key (expected <module>.lora_A.weight / .lora_B.weight / .lora_B.bias)"


# --- LoraConfig semantics --------------------------------------------------------------------
def config_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The LoraConfig fields of `config` this peft knows (others are ignored); raises on unsupported variants."""
    import_peft()
    from peft import LoraConfig

    peft_type = str(getattr(config.get("peft_type"), "value", config.get("peft_type")) or "LORA").upper()
    if peft_type != "LORA":
        raise UnsupportedFeatureError(f"{where}: peft_type {peft_type} is not LoRA; fd-lora loads LoRA adapters only.")
    for name, what in UNSUPPORTED_FIELDS.items():
        if config.get(name):
            raise UnsupportedFeatureError(f"{where}: the config sets {name}={config[name]!r} ({what}), which fd-lora "
                                          "does not implement yet. Merge the adapter with PEFT or use a plain LoRA.")
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    return {k: v for k, v in config.items() if k in known}


def config_rules(config: dict[str, Any], where: str) -> tuple[AlphaRule, Callable[[str], int | None],
                                                             Callable[[str], str | None]]:
    """(alpha of a module, rank the config expects, why a module is not targeted) under PEFT's own matching."""
    import_peft()
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    fields = config_fields(config, where)
    r = int(fields.get("r", 8))
    lora_alpha = float(fields.get("lora_alpha", 8))
    rank_pattern = dict(fields.get("rank_pattern") or {})
    alpha_pattern = dict(fields.get("alpha_pattern") or {})
    targets = fields.get("target_modules")
    cfg, verdicts = None, {}
    if targets is not None and targets != "all-linear":
        kw = {k: fields.get(k) for k in ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")}
        try:
            cfg = LoraConfig(**{k: v for k, v in kw.items() if v is not None})
        except (TypeError, ValueError) as e:
            raise FormatError(f"{where}: the LoraConfig targeting fields are invalid: {e}") from None
        verdicts = _verdicts(json.dumps(kw, sort_keys=True, default=repr))

    def alpha_of(path: str, rank: int) -> float:
        return float(alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), path), lora_alpha))

    def rank_of(path: str) -> int:
        return int(rank_pattern.get(get_pattern_key(rank_pattern.keys(), path), r))

    def untargeted(path: str) -> str | None:
        if cfg is None:
            return None
        if path in verdicts:
            return verdicts[path]
        hit = check_target_module_exists(cfg, path)
        why = None
        if type(hit).__name__ == "_ExcludedModule":  # falsy, so test it first
            why = "its module is excluded by the config's exclude_modules (PEFT would not load it)"
        elif not hit:
            why = "its module is not matched by the config's target_modules (PEFT would not load it)"
        verdicts[path] = why
        return why

    return alpha_of, rank_of, untargeted


_VERDICTS: OrderedDict[str, dict[str, str | None]] = OrderedDict()  # targeting fields -> {module path: verdict}
_VERDICTS_LOCK = threading.Lock()


def _verdicts(targeting: str) -> dict[str, str | None]:
    """PEFT's targeting verdicts per module path for one set of targeting fields, kept across loads: adapters
    for one base model share their module paths and usually their target lists (a few recent sets kept)."""
    with _VERDICTS_LOCK:
        got = _VERDICTS.pop(targeting, None)
        _VERDICTS[targeting] = got = {} if got is None else got
        while len(_VERDICTS) > 16:
            _VERDICTS.popitem(last=False)
    return got


def import_peft() -> None:
    """Import the PEFT modules `config_fields` / `config_rules` take LoraConfig's semantics from (seconds, once per
    process; on a thread of its own: fdlora.extras.detached_import): a caller timing a conversion imports them first,
    so the conversion's time is the conversion's."""
    detached_import("peft.tuners.tuners_utils")
    detached_import("peft.utils.other")


def saved_module(key: str, names: list[str]) -> str | None:
    """The module of `key` that the config's modules_to_save names (PEFT's rule: the module path is a name, or ends
    with "." + name), or None. PEFT saves such a module's whole state dict under its path."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        path = ".".join(parts[:i])
        if any(path == n or path.endswith("." + n) for n in names):
            return path
    return None


def from_config(sd: dict[str, torch.Tensor], config: dict[str, Any], where: str) -> Converted:
    """PEFT-form keys + a LoraConfig dict -> modules, with every field that changes the math applied. Keys of the
    config's modules_to_save modules are full module copies, not LoRA: reported as `saved`, neither unused nor
    dropped (fdlora.load_fd_lora on a Transformers model loads them; LoRA-only paths leave them out)."""
    alpha_of, rank_of, untargeted = config_rules(config, where)
    names = [n for n in config.get("modules_to_save") or [] if isinstance(n, str) and n]
    saved = {}
    for key in [k for k in sd if names and peft_key(k) is None]:
        module = saved_module(key, names)
        if module is not None:
            saved[key] = (f"modules_to_save: the trained copy of {module} (a full module, not a LoRA delta); "
                          "fdlora.load_fd_lora on a Transformers model loads it")
    keep, skipped = {}, {}
    for key, t in sd.items():
        if key in saved:
            continue
        m = peft_key(key)
        why = untargeted(m[0]) if m else None  # (memoized per module path)
        (skipped if why else keep)[key] = why or t
    out = build_modules(keep, alpha_of, where=where, rank_of=rank_of, lora_bias=bool(config.get("lora_bias", False)))
    if config.get("use_dora"):  # every DoRA module has its magnitude: without it PEFT's output is not a plain LoRA's
        bare = [p for p, m in out.components[where].items() if m.magnitude is None]
        if bare:
            raise FormatError(f"{where}: the config sets use_dora=True but {len(bare)} modules have no "
                              f"lora_magnitude_vector (e.g. {bare[:3]}); the weights do not belong to this config.")
    out.unused.update(skipped)
    out.saved.update(saved)
    out.rslora[where] = bool(config.get("use_rslora", False))
    out.configs[where] = {k: config[k] for k in ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern",
                                                 "fan_in_fan_out", "lora_bias") if config.get(k)}
    return out


def strip_prefix(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    n = len(prefix)
    return {k[n:]: v for k, v in sd.items() if k.startswith(prefix)}
