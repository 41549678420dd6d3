"""Config files: a pipeline or model, its adapters and settings in YAML, validated on load.

    pipeline: tiny-sd15            # or a diffusers Hub id; or `model: tiny-llama | <transformers Hub id>`
    dtype: float32                 # float32 | float16 | bfloat16
    device: cpu                    # auto | cpu | cuda | cuda:N
    backend: auto                  # auto | triton | cuda | triton+cuda | torch
    hub: {cache_dir: ./cache}      # optional Hub keywords for the base model
    quantization: {bits: 4}        # optional; transformers Hub models only (bitsandbytes)
    adapters:
      - {name: pixel, source: user/pixel-lora, weight: 0.8, hub: {revision: main, local_files_only: true}}
    prompt: a cat                  # pipelines only: generate one image ...
    steps: 2
    output: out.png                # ... and save it here
    serve:                         # optional; `fdlora serve` only (fdlora.serve): every key has a default
      replicas: 1                  #   pipelines (or models) on Ray Serve, one per replica
      adapters_per_replica: 4      #   GPU slots per replica (LRU); also Ray's multiplexed models per replica
      max_batch: 8                 #   requests (any adapters) gathered into one batch
      max_call: null               #   images per pipeline call (default max_batch): a batch naming more
                                   #   adapters than the slots becomes calls packed up to this many each
      batch_wait_s: 0.05           #   how long a batch waits to fill
      host: 127.0.0.1              #   HTTP interface (loopback unless told otherwise)
      port: 8000
      address: null                #   an existing Ray cluster (ray://host:10001 or auto); default: start a local one
      max_steps: 50                #   request limits: num_inference_steps (models: max_new_tokens),
                                   #   height / width (multiples of 8)
      max_size: 1024

`load_config(path)` returns a validated `Config`; `from_config(path)` builds the pipeline or model
with its adapters loaded and weighted. Every error is a ConfigError naming the key path, the bad
value and the allowed values; unknown keys are errors.
"""

from __future__ import annotations

import math
import os
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

DTYPES = ("float32", "float16", "bfloat16")
BACKENDS = ("auto", "triton", "cuda", "triton+cuda", "torch")
BITS = (4, 8)
TINY_PIPELINES = ("tiny-sd15", "tiny-sdxl", "tiny-sd3", "tiny-flux")
TINY_MODELS = ("tiny-llama",)
HUB_KEYS = ("revision", "subfolder", "token", "cache_dir", "local_files_only", "force_download", "allow_pickle",
            "weight_name")
TOP_KEYS = ("pipeline", "model", "dtype", "device", "backend", "hub", "quantization", "adapters", "prompt",
            "negative_prompt", "steps", "size", "seed", "output", "serve")
ADAPTER_KEYS = ("name", "source", "weight", "hub")
HUB_TYPES = {"revision": str, "subfolder": str, "weight_name": str, "cache_dir": str, "token": (str, bool),
             "local_files_only": bool, "force_download": bool, "allow_pickle": bool}
LIMITS = {"steps": (1, 10_000), "size": (8, 16_384), "seed": (0, 2**64 - 1)}  # key: (min, max)
# serve: key -> (type, default, (min, max) or None)
SERVE_KEYS = {"replicas": (int, 1, (1, 64)), "adapters_per_replica": (int, 4, (1, 64)), "max_batch": (int, 8, (1, 256)),
              "max_call": (int, None, (1, 256)), "batch_wait_s": (float, 0.05, (0.0, 10.0)),
              "host": (str, "127.0.0.1", None), "port": (int, 8000, (0, 65535)), "address": (str, None, None),
              "max_steps": (int, 50, (1, 1000)), "max_size": (int, 1024, (8, 4096))}
MAX_CONFIG_BYTES = 1 << 20  # a run config is a few hundred bytes; a bigger file is not one
_REPR = reprlib.Repr()  # bounded: YAML aliases can nest deep
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 60, 60, 4, 4


@dataclass
class AdapterSpec:
    name: str
    source: str
    weight: float = 1.0
    hub: dict[str, Any] = field(default_factory=dict)


@dataclass
class Config:
    kind: str  # "pipeline" | "model"
    base: str  # tiny-* name or Hub id / local path
    dtype: str = "float32"
    device: str = "auto"
    backend: str = "auto"
    hub: dict[str, Any] = field(default_factory=dict)
    quantization_bits: int | None = None
    adapters: list[AdapterSpec] = field(default_factory=list)
    prompt: str | None = None
    negative_prompt: str | None = None
    steps: int = 20
    size: int | None = None
    seed: int = 0
    output: str | None = None
    serve: dict[str, Any] | None = None  # the `serve:` section with defaults filled in (None: absent)
    source: str = "<dict>"


def _short(v: Any) -> str:
    """A bounded repr: a YAML alias bomb or a huge value must not blow up an error message."""
    return _REPR.repr(v)


def _name(v: Any) -> str:
    return f"{_short(v)} ({type(v).__name__})"


class _Checker:
    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.where}: {path}: {msg}")

    def mapping(self, path: str, v: Any, allowed: tuple[str, ...]) -> dict:
        if not isinstance(v, dict):
            raise self.fail(path, f"got {_name(v)}; expected a mapping with keys {', '.join(allowed)}")
        for k in v:
            if not isinstance(k, str) or k not in allowed:
                key = k if isinstance(k, str) and len(k) <= 60 else _short(k)
                raise self.fail(f"{path}.{key}" if path != "<top>" else key,
                                f"unknown key {_short(k)}; allowed keys: {', '.join(allowed)}")
        return v

    def typed(self, path: str, v: Any, types: type | tuple[type, ...], what: str) -> Any:
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in (types if isinstance(types, tuple)
                                                                             else (types,))):
            raise self.fail(path, f"got {_name(v)}; expected {what}")
        return v

    def enum(self, path: str, v: Any, allowed: tuple) -> Any:
        if isinstance(v, bool) or not isinstance(v, (str, int)) or v not in allowed:
            raise self.fail(path, f"got {_short(v)}; allowed values: {', '.join(map(str, allowed))}")
        return v


def validate(data: Any, where: str = "<config>") -> Config:
    """A Config from parsed YAML (a dict); raises ConfigError on the first problem."""
    c = _Checker(where)
    d = c.mapping("<top>", data, TOP_KEYS)
    kinds = [k for k in ("pipeline", "model") if k in d]
    if len(kinds) != 1:
        raise c.fail("<top>", "missing required key 'pipeline' or 'model'" if not kinds
                     else "give either 'pipeline' or 'model', not both")
    kind = kinds[0]
    base = c.typed(kind, d[kind], str, f"a Hub id, a local path or one of {', '.join(TINY_PIPELINES + TINY_MODELS)}")
    if base.startswith("tiny-"):
        c.enum(kind, base, TINY_PIPELINES if kind == "pipeline" else TINY_MODELS)
    cfg = Config(kind=kind, base=base, source=where)
    cfg.dtype = c.enum("dtype", d.get("dtype", "float32"), DTYPES)
    dev = c.typed("device", d.get("device", "auto"), str, "auto, cpu, cuda or cuda:N")
    if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
        raise c.fail("device", f"got {_short(dev)}; allowed values: auto, cpu, cuda, cuda:N")
    cfg.device = dev
    cfg.backend = c.enum("backend", d.get("backend", "auto"), BACKENDS)
    cfg.hub = _hub(c, "hub", d.get("hub", {}))
    if "quantization" in d:
        q = c.mapping("quantization", d["quantization"], ("bits",))
        if "bits" not in q:
            raise c.fail("quantization", "missing required key 'bits' (4 or 8)")
        cfg.quantization_bits = c.enum("quantization.bits", q["bits"], BITS)
    adapters = c.typed("adapters", d.get("adapters", []), list, "a list of adapters ({name, source, weight, hub})")
    seen = set()
    for i, a in enumerate(adapters):
        p = f"adapters[{i}]"
        c.mapping(p, a, ADAPTER_KEYS)
        for req in ("name", "source"):
            if req not in a:
                raise c.fail(p, f"missing required key {req!r}")
        name = c.typed(f"{p}.name", a["name"], str, "a string")
        from .errors import AdapterNameError
        from .hub.adapter import check_adapter_name

        try:
            check_adapter_name(name)
        except AdapterNameError as e:
            raise c.fail(f"{p}.name", str(e)) from None
        if name in seen:
            raise c.fail(f"{p}.name", f"got {_short(name)} twice; adapter names must be unique")
        seen.add(name)
        source = c.typed(f"{p}.source", a["source"], str, "a Hub repo id, a directory or a file path")
        weight = c.typed(f"{p}.weight", a.get("weight", 1.0), (int, float), "a number (the blend weight, e.g. 0.8)")
        try:
            weight = float(weight)
        except OverflowError:  # a YAML integer too large for a float
            weight = math.inf
        if not math.isfinite(weight):
            raise c.fail(f"{p}.weight", f"got {_short(a.get('weight'))}; expected a finite number")
        hub = _hub(c, f"{p}.hub", a.get("hub", {}))
        cfg.adapters.append(AdapterSpec(name, source, weight, hub))
    gen_keys = [k for k in ("prompt", "negative_prompt", "steps", "size", "output") if k in d]
    if kind == "model" and gen_keys:
        raise c.fail(gen_keys[0], "only pipelines generate images; remove it or use 'pipeline:'")
    if "prompt" in d:
        cfg.prompt = c.typed("prompt", d["prompt"], str, "a string")
    if "negative_prompt" in d:
        cfg.negative_prompt = c.typed("negative_prompt", d["negative_prompt"], str, "a string")
    for key in ("steps", "size", "seed"):
        if key in d:
            v = c.typed(key, d[key], int, "an integer")
            lo, hi = LIMITS[key]
            if not lo <= v <= hi:
                raise c.fail(key, f"got {_short(v)}; expected an integer " + (f">= {lo}" if v < lo else f"<= {hi}"))
            setattr(cfg, key, v)
    if "output" in d:
        cfg.output = c.typed("output", d["output"], str, "a file path")
    if cfg.output and not cfg.prompt:
        raise c.fail("output", "an output needs a 'prompt' to generate")
    if "serve" in d:
        cfg.serve = _serve(c, d["serve"])
    return cfg


def _serve(c: _Checker, v: Any) -> dict[str, Any]:
    """The `serve:` section (fdlora.serve), every key optional; None means {}."""
    d = c.mapping("serve", {} if v is None else v, tuple(SERVE_KEYS))
    out = {}
    for key, (typ, default, limits) in SERVE_KEYS.items():
        val = d.get(key, default)
        if val is None and default is None:
            out[key] = None
            continue
        path = f"serve.{key}"
        val = c.typed(path, val, (int, float) if typ is float else typ,
                      {int: "an integer", float: "a number", str: "a string"}[typ])
        if typ is float:
            val = float(val) if math.isfinite(float(val)) else math.inf
        if limits and not limits[0] <= val <= limits[1]:
            raise c.fail(path, f"got {_short(val)}; expected a value from {limits[0]} to {limits[1]}")
        if typ is str and not (0 < len(val) <= 256 and val.isprintable()):
            raise c.fail(path, f"got {_short(val)}; expected a non-empty printable string")
        out[key] = val
    return out


def _hub(c: _Checker, path: str, v: Any) -> dict[str, Any]:
    """Hub keywords with their types checked; paths inside a repo (weight_name, subfolder) must stay inside."""
    from .errors import ResolveError
    from .hub.resolve import check_relative

    hub = dict(c.mapping(path, v, HUB_KEYS))
    for k, val in hub.items():
        types = HUB_TYPES[k]
        c.typed(f"{path}.{k}", val, types, "true or false" if types is bool else "a string")
        if k in ("weight_name", "subfolder", "revision"):
            try:
                check_relative(k, val)
            except ResolveError as e:
                raise c.fail(f"{path}.{k}", str(e)) from None
    return hub


def read_yaml(path: str | os.PathLike, fix: str = "") -> Any:
    """The parsed YAML of a config file (run, serve or train); every way it can fail is one ConfigError line naming the
    file (too large, unreadable, not UTF-8, not YAML, nested too deep, a value PyYAML cannot construct)."""
    import yaml

    p = Path(path)
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{p}: {p.stat().st_size} bytes is too large for a config file (limit "
                              f"{MAX_CONFIG_BYTES}).{fix}")
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the config file: {e.strerror or e}{fix}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}).{fix}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {str(e).splitlines()[0]}{fix}") from None
    except RecursionError:
        raise ConfigError(f"{p}: the YAML nests too deeply to be a config.{fix}") from None
    except (ValueError, TypeError, OverflowError) as e:  # PyYAML's constructors (a timestamp like 2001-13-01)
        raise ConfigError(f"{p}: not valid YAML: a value cannot be read ({type(e).__name__}: "
                          f"{str(e)[:120]}).{fix}") from None


def load_config(path: str | os.PathLike) -> Config:
    """Read and validate a YAML config file."""
    return validate(read_yaml(path), str(path))


def _device(cfg: Config) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device


def _tiny_pipeline(name: str):
    from fdlora.fixtures import tiny_pipeline as tiny

    return {"tiny-sd15": tiny.sd15, "tiny-sdxl": tiny.sdxl, "tiny-sd3": tiny.sd3, "tiny-flux": tiny.flux}[name]()


def _tiny_llama():
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def build(cfg: Config):
    """The pipeline or model a validated Config describes, adapters loaded and weighted."""
    import torch

    from . import api
    from .errors import UnsupportedFeatureError
    from .kernels import set_backend

    dtype, device = getattr(torch, cfg.dtype), _device(cfg)
    if cfg.quantization_bits and (cfg.kind == "pipeline" or cfg.base.startswith("tiny-")):
        raise UnsupportedFeatureError(f"{cfg.source}: quantization: a quantized base is supported for transformers "
                                      "Hub models only (model: <hub id>); remove 'quantization' for this base")
    set_backend(cfg.backend)
    names, weights = [a.name for a in cfg.adapters], [a.weight for a in cfg.adapters]
    if cfg.kind == "pipeline":
        if cfg.base.startswith("tiny-"):
            obj = _tiny_pipeline(cfg.base).to(device=device, dtype=dtype)
        else:
            from diffusers import DiffusionPipeline

            obj = DiffusionPipeline.from_pretrained(cfg.base, torch_dtype=dtype, **cfg.hub).to(device)
        obj.set_progress_bar_config(disable=True)
        for a in cfg.adapters:
            obj.load_fd_lora(a.source, adapter_name=a.name, **a.hub)
        if names:
            obj.set_adapters(names, weights)
        return obj
    if cfg.base.startswith("tiny-"):
        obj = _tiny_llama().to(device=device, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        kw = dict(cfg.hub)
        if cfg.quantization_bits:
            from transformers import BitsAndBytesConfig

            kw["quantization_config"] = BitsAndBytesConfig(**{f"load_in_{cfg.quantization_bits}bit": True})
        obj = AutoModelForCausalLM.from_pretrained(cfg.base, dtype=dtype, **kw)
        if not cfg.quantization_bits:
            obj = obj.to(device)
        obj.eval()
    from fdlora.integrations.transformers import load_fd_lora

    for a in cfg.adapters:
        load_fd_lora(obj, a.source, adapter_name=a.name, activate=False, **a.hub)
    if names:
        api.set_adapters(obj, names, weights)
    return obj


def from_config(path: str | os.PathLike):
    """Build the pipeline or Transformers model a YAML config describes, with its adapters loaded and weighted.

    See fdlora.config for the format. Raises fdlora.errors.ConfigError for an invalid file.
    """
    return build(load_config(path))
