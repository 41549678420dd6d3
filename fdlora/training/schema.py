"""The YAML schema of `fdlora train CONFIG`, validated before anything loads.

    model:        {name: tiny-vit | tiny-llama | tiny-sd15 | <Hub id> | <local dir>,
                   task: image-classification | causal-lm | text-to-image}
    lora:         {r: 8, alpha: 16, dropout: 0.0, target_modules: all-linear | [q_proj, v_proj],
                   exclude_modules: [...], rslora: false, modules_to_save: [...], init: true | false | gaussian}
    quantization: {enabled: false, method: manual | hf, type: nf4 | fp4 | int8,
                   compute_dtype: float32 | float16 | bfloat16, double_quant: true, skip_modules: [classifier]}
    data:         synthetic | <image folder> | <datasets name or dir>   (or {source: ..., split: train,
                   image_column: image, label_column: label, text_column: text, image_size: 16})
    train:        {steps: 100, batch_size: 8, lr: 1e-4, optimizer: adamw | adam | sgd, grad_accumulation: 1,
                   mixed_precision: no | fp16 | bf16, seed: 0, checkpoint_every: 0, resume: false | true | <dir>,
                   weight_decay: 0.0, device: auto | cpu | cuda, distributed: auto | ddp | fsdp}
    output:       <dir> | {dir: <dir>, push_to_hub: <repo id>}

Every error is one line naming the key, the value, what is allowed and the fix; unknown keys get a "did you
mean". Checks that need no model run here (types, ranges, enum values, bitsandbytes installed for
quantization); those that need the model (target_modules matching nothing) run right after it is built, before
any training.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fdlora.fixtures.tiny_tasks import TASKS

from ..errors import ConfigError
from .quant import INSTALL, QuantSpec

SECTIONS = ("model", "lora", "quantization", "data", "train", "output")
KEYS = {
    "model": ("name", "task"),
    "lora": ("r", "alpha", "dropout", "target_modules", "exclude_modules", "rslora", "modules_to_save", "init"),
    "quantization": ("enabled", "method", "type", "compute_dtype", "double_quant", "skip_modules"),
    "data": ("source", "split", "image_column", "label_column", "text_column", "image_size"),
    "train": ("steps", "batch_size", "lr", "optimizer", "grad_accumulation", "mixed_precision", "seed",
              "checkpoint_every", "resume", "weight_decay", "device", "distributed"),
    "output": ("dir", "push_to_hub"),
}
TASK_NAMES = ("image-classification", "causal-lm", "text-to-image")
OPTIMIZERS = ("adamw", "adam", "sgd")
PRECISIONS = ("no", "fp16", "bf16")
QUANT_TYPES = ("nf4", "fp4", "int8")
QUANT_METHODS = ("manual", "hf")
COMPUTE = ("float32", "float16", "bfloat16")
INITS = (True, False, "gaussian")
DEVICES = ("auto", "cpu", "cuda")
REPO_ID = re.compile(r"[\w\-.]{1,96}/[\w\-.]{1,96}", re.ASCII)  # huggingface_hub's validate_repo_id, namespaced
DISTRIBUTED = ("auto", "ddp", "fsdp")  # auto: fsdp under `accelerate launch --use_fsdp`, else ddp


@dataclass
class TrainConfig:
    model: str
    task: str
    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: Any = "all-linear"
    exclude_modules: list[str] | None = None
    rslora: bool = False
    modules_to_save: list[str] | None = None
    init: Any = True
    quant: QuantSpec | None = None
    quant_method: str = "manual"
    data: str = "synthetic"
    data_options: dict = field(default_factory=dict)
    steps: int = 100
    batch_size: int = 8
    lr: float = 1e-4
    optimizer: str = "adamw"
    grad_accumulation: int = 1
    mixed_precision: str = "no"
    seed: int = 0
    checkpoint_every: int = 0
    resume: bool | str = False
    weight_decay: float = 0.0
    device: str = "auto"
    distributed: str = "auto"
    output: str = "fdlora-adapter"
    push_to_hub: str | None = None
    source: str = "<dict>"

    def lora_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_modules, exclude_modules=self.exclude_modules,
                          use_rslora=self.rslora, modules_to_save=self.modules_to_save,
                          init_lora_weights=self.init)


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


class _Check:
    def __init__(self, where: str):
        self.where = where

    def error(self, key: str, value: Any, allowed: str, fix: str) -> ConfigError:
        got = "missing" if value is _MISSING else f"got {_show(value)}"
        return ConfigError(f"{self.where}: {key}: {got}; allowed: {allowed}; fix: {fix}")

    def section(self, name: str, v: Any) -> dict:
        if not isinstance(v, dict):
            raise self.error(name, v, f"a mapping with keys {', '.join(KEYS[name])}",
                             f"write `{name}:` followed by indented `key: value` lines")
        self.known(name, v, KEYS[name])
        return v

    def known(self, prefix: str, d: dict, allowed: tuple[str, ...]) -> None:
        for k in d:
            if not isinstance(k, str) or k not in allowed:
                close = difflib.get_close_matches(str(k), allowed, 1, 0.5)
                hint = f"did you mean '{close[0]}'? " if close else ""
                where = f"{prefix}.{k}" if prefix else str(k)
                raise ConfigError(f"{self.where}: {where}: unknown key {_show(k)}; {hint}allowed keys: "
                                  f"{', '.join(allowed)}; fix: rename or remove it")

    def enum(self, key: str, v: Any, allowed: tuple) -> Any:
        if isinstance(v, bool) and not any(isinstance(a, bool) for a in allowed) or v not in allowed:
            close = difflib.get_close_matches(str(v), [str(a) for a in allowed], 1, 0.5)
            fix = f"did you mean '{close[0]}'?" if close else f"use one of {', '.join(map(str, allowed))}"
            raise self.error(key, v, " | ".join(map(str, allowed)), fix)
        return v

    def integer(self, key: str, v: Any, lo: int, hi: int = 2**31, example: int = 8) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self.error(key, v, f"an integer in [{lo}, {hi}]", f"set `{key.split('.')[-1]}: {example}`")
        return v

    def number(self, key: str, v: Any, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False,
               example: float = 1.0) -> float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        if not ok:
            rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            raise self.error(key, v, f"a number in {rng}", f"set `{key.split('.')[-1]}: {example}`")
        return float(v)

    def boolean(self, key: str, v: Any) -> bool:
        if not isinstance(v, bool):
            raise self.error(key, v, "true | false", f"set `{key.split('.')[-1]}: true` or false")
        return v

    def names(self, key: str, v: Any, allow_str: tuple[str, ...] = ()) -> Any:
        if v is None:
            return None
        if isinstance(v, str) and (not allow_str or v in allow_str):
            return v
        if not isinstance(v, list) or not v or not all(isinstance(s, str) and s for s in v):
            allowed = "a list of module names" + (f" or {' | '.join(allow_str)}" if allow_str else "")
            raise self.error(key, v, allowed, f"e.g. `{key.split('.')[-1]}: [q_proj, v_proj]`")
        return list(v)


_MISSING = object()


def validate(data: Any, where: str = "<config>") -> TrainConfig:
    """A TrainConfig from parsed YAML; raises ConfigError (one line) on the first problem."""
    c = _Check(where)
    if not isinstance(data, dict):
        raise c.error("<top>", data, f"a mapping with sections {', '.join(SECTIONS)}", "see `fdlora train --help`")
    c.known("", data, SECTIONS)
    for s in ("model", "lora"):
        if s not in data:
            raise c.error(s, _MISSING, f"a `{s}:` section", f"add a `{s}:` section (see `fdlora train --help`)")
    m = c.section("model", data["model"])
    name = m.get("name", _MISSING)
    if not isinstance(name, str) or not name:
        raise c.error("model.name", name, "tiny-vit | tiny-llama | tiny-sd15 | a Hub id | a local dir",
                      "set `name: tiny-vit`")
    task = m.get("task", TASKS.get(name, _MISSING))
    c.enum("model.task", task, TASK_NAMES) if task is not _MISSING else None
    if task is _MISSING:
        raise c.error("model.task", task, " | ".join(TASK_NAMES), "set `task:` for a model that is not tiny-*")
    if name in TASKS and TASKS[name] != task:
        raise c.error("model.task", task, TASKS[name], f"{name} is a {TASKS[name]} model; set `task: {TASKS[name]}`")
    if name.startswith("tiny-") and name not in TASKS:
        close = difflib.get_close_matches(name, list(TASKS), 1, 0.5)
        raise c.error("model.name", name, " | ".join(TASKS) + " | a Hub id | a local dir",
                      f"did you mean '{close[0]}'?" if close else "use a tiny-* name listed")

    lo = c.section("lora", data["lora"])
    if "r" not in lo:
        raise c.error("lora.r", _MISSING, "a positive integer (the LoRA rank)", "add `r: 8` under `lora:`")
    r = c.integer("lora.r", lo["r"], 1, 4096)
    alpha = c.number("lora.alpha", lo.get("alpha", r), 0, 1e6, lo_open=True, example=2 * r)
    dropout = c.number("lora.dropout", lo.get("dropout", 0.0), 0, 1, hi_open=True, example=0.05)
    targets = c.names("lora.target_modules", lo.get("target_modules", "all-linear"), ("all-linear",))
    exclude = c.names("lora.exclude_modules", lo.get("exclude_modules"))
    rslora = c.boolean("lora.rslora", lo.get("rslora", False))
    saved = c.names("lora.modules_to_save", lo.get("modules_to_save"))
    init = c.enum("lora.init", lo.get("init", True), INITS)

    quant, method = None, "manual"
    if data.get("quantization") is not None:
        q = c.section("quantization", data["quantization"])
        if c.boolean("quantization.enabled", q.get("enabled", True)):
            method = c.enum("quantization.method", q.get("method", "manual"), QUANT_METHODS)
            quant = QuantSpec(c.enum("quantization.type", q.get("type", "nf4"), QUANT_TYPES),
                              c.enum("quantization.compute_dtype", q.get("compute_dtype", "float32"), COMPUTE),
                              c.boolean("quantization.double_quant", q.get("double_quant", True)),
                              c.names("quantization.skip_modules", q.get("skip_modules")) or [])
            if importlib.util.find_spec("bitsandbytes") is None:
                raise c.error("quantization.enabled", True, "true only with bitsandbytes installed",
                              f"{INSTALL} (or set `enabled: false`)")

    src, opts = "synthetic", {}
    if data.get("data") is not None:
        d = data["data"]
        if isinstance(d, dict):
            c.known("data", d, KEYS["data"])
            src = d.get("source", _MISSING)
            opts = {k: v for k, v in d.items() if k != "source"}
        else:
            src = d
        if not isinstance(src, str) or not src:
            raise c.error("data.source", src, "synthetic | an image folder | a datasets name or dir",
                          "set `data: synthetic`")
        if "image_size" in opts:
            c.integer("data.image_size", opts["image_size"], 8, 4096, example=224)

    t = c.section("train", data.get("train", {}) or {})
    steps = c.integer("train.steps", t.get("steps", 100), 1, 10_000_000, example=100)
    batch = c.integer("train.batch_size", t.get("batch_size", 8), 1, 1_000_000, example=8)
    lr = c.number("train.lr", t.get("lr", 1e-4), 0, 10, lo_open=True, example=1e-4)
    opt = c.enum("train.optimizer", t.get("optimizer", "adamw"), OPTIMIZERS)
    accum = c.integer("train.grad_accumulation", t.get("grad_accumulation", 1), 1, 100_000, example=1)
    mp = t.get("mixed_precision", "no")
    mp = "no" if mp is False or mp is None else mp
    c.enum("train.mixed_precision", mp, PRECISIONS)
    seed = c.integer("train.seed", t.get("seed", 0), 0, 2**32 - 1, example=0)
    every = c.integer("train.checkpoint_every", t.get("checkpoint_every", 0), 0, 10_000_000, example=50)
    resume = t.get("resume", False)
    if not isinstance(resume, (bool, str)) or resume == "":
        raise c.error("train.resume", resume, "false | true (the output dir's latest checkpoint) | a checkpoint dir",
                      "set `resume: true`")
    wd = c.number("train.weight_decay", t.get("weight_decay", 0.0), 0, 10, example=0.0)
    device = t.get("device", "auto")
    if not (isinstance(device, str) and (device in DEVICES or device.startswith("cuda:"))):
        raise c.error("train.device", device, "auto | cpu | cuda | cuda:N", "set `device: auto`")
    dist = c.enum("train.distributed", t.get("distributed", "auto"), DISTRIBUTED)
    if dist == "fsdp" and quant is not None:
        raise c.error("train.distributed", dist, "auto | ddp with quantization (FSDP does not shard quantized "
                      "weights)", "set `distributed: ddp` or turn quantization off")

    out, hub = "fdlora-adapter", None
    if data.get("output") is not None:
        o = data["output"]
        if isinstance(o, dict):
            c.known("output", o, KEYS["output"])
            out, hub = o.get("dir", _MISSING), o.get("push_to_hub")
        else:
            out = o
        if not isinstance(out, str) or not out:
            raise c.error("output.dir", out, "a directory path", "set `output: {dir: my-adapter}`")
        if hub is not None and not (isinstance(hub, str) and REPO_ID.fullmatch(hub) and "--" not in hub
                                    and ".." not in hub):
            raise c.error("output.push_to_hub", hub, "a Hub repo id `user/name` (letters, digits, '-', '_', '.'; "
                          "at most 96 each)", "set `push_to_hub: me/my-adapter`")
    return TrainConfig(name, task, r, alpha, dropout, targets, exclude, rslora, saved, init, quant, method, src,
                       opts, steps, batch, lr, opt, accum, mp, seed, every, resume, wd, device, dist, out, hub, where)


def load(path: str | os.PathLike) -> TrainConfig:
    """Read and validate a YAML training config."""
    from ..config import read_yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file; fix: pass the path of a YAML file (see `fdlora train --help`)")
    return validate(read_yaml(p, " Fix: pass a training config (see `fdlora train --help`)."), str(p))
