"""`load_adapters`: any source to canonical adapters, one per pipeline component, plus a load report.

    adapters, report = fdlora.hub.load_adapters("user/pixel-style", revision="v1")
    print(report)                                   # format and why, modules, ranks/alphas, keys
    adapters["unet"]                                # LoraAdapter, paths relative to the UNet

Steps: `resolve` (pin the revision to a commit, choose the weight file; no download), the RAM
cache (a hit skips everything below), `fetch` (download on a cache miss), read (safetensors
checked first; pickle only with allow_pickle=True), detect the format, convert, cast, cache.

Requests: a 40-hex `revision` whose files are cached makes none (the commit's listing, needed
without `weight_name`, is remembered per process); a branch or tag costs one (resolving it), then
the RAM cache or the local HF cache answers. Offline (`HF_HUB_OFFLINE=1`) uses the cache only.
Nothing here touches a model: loading into one goes through `FdLoraHandle.add_adapter` (or an
`AdapterPool`), which validates every shape before writing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import env
from ..errors import CapacityError, FormatError, PartialLoadWarning
from ..steps import Steps, drain
from . import formats
from .adapter import LoraAdapter, Provenance, check_adapter_name
from .cache import AdapterCache, CacheKey, default_cache
from .formats import lycoris
from .formats.base import import_peft
from .report import LoadReport
from .resolve import Resolved, fetch, resolve
from .safefile import read_weights

DEFAULT = "default"  # sentinel: use the process-wide RAM cache
logger = logging.getLogger("fdlora")
BENIGN = ("the metadata header gives the alphas",)  # unused keys that lose nothing: no warning for them


def load_adapters(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    weight_name: str | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
    allow_pickle: bool = False,
    dtype: torch.dtype | None = None,
    strict: bool = False,
    check_finite: bool = False,
    component: str | None = None,
    layers_per_block: int = 2,
    config: Mapping[str, Any] | Any | None = None,
    metadata: Mapping[str, str] | None = None,
    name: str | None = None,
    cache: AdapterCache | str | None = DEFAULT,
    lora_conversion: str | None = None,
    family: Any = None,
    in_process: bool = True,
    deferred: bool = False,
) -> tuple[dict[str, LoraAdapter], LoadReport]:
    """Load a LoRA from a Hub repo id, a directory, a file or a state dict; returns ({component: adapter}, report).

    Hub / file keywords are diffusers' (`weight_name`, `subfolder`, `revision`, `token`, `cache_dir`,
    `local_files_only`, `force_download`); without `weight_name` the file is chosen by
    `fdlora.hub.resolve.WEIGHT_RULE` and the report says which and why. `dtype` casts the weights;
    `strict` raises `UnusedKeysError` if any key is unused or dropped; `check_finite` rejects NaN/Inf.
    `component` forces the component of single-model formats (PEFT); `layers_per_block` maps kohya
    SDXL block numbers. `config` (a LoraConfig or its dict) and `metadata` (safetensors header
    entries) go with an in-memory state dict. `cache` is the RAM cache to use (None: no caching).
    LyCORIS LoHa / LoKr / full-diff modules load exactly; `lora_conversion="svd:RANK"` turns them into plain
    LoRA of that rank instead (smaller banks) and the report's notes give the approximation error.
    `family` (fdlora.integrations.diffusers.family.Family, given by pipeline loads) is asked first for the
    format, with diffusers' converters of that pipeline family. `in_process=False` runs a cache miss's read and
    conversion in fd-lora's reader process (fdlora.hub.worker: background loads, which would otherwise take the
    GIL from the serving thread); the result is the same. With it, `deferred=True` returns that read before any
    per-tensor work here: ({component: PendingPart}, PendingLoad), turned into adapters and the report by
    `materialize` when the caller chooses (a prefetch: at publication, between two steps); a RAM-cache hit or an
    in-memory source returns as usual.
    """
    t0 = time.perf_counter()
    svd_rank = lycoris.parse_conversion(lora_conversion)
    if name is not None:
        check_adapter_name(name)
    hub_kw = dict(token=token, cache_dir=cache_dir, local_files_only=local_files_only)
    r = resolve(source, weight_name=weight_name, subfolder=subfolder, revision=revision,
                allow_pickle=allow_pickle, **hub_kw)
    ram = default_cache() if cache == DEFAULT else cache
    key = None
    if isinstance(ram, AdapterCache) and r.kind != "memory" and config is None and metadata is None:
        key = CacheKey(r.source, r.fingerprint or "", r.file, str(dtype) if dtype else None,
                       (component, layers_per_block, getattr(family, "name", None))
                       + ((svd_rank,) if svd_rank else ()))
        hit = None if force_download else ram.get(key)
        if hit is not None:
            adapters, report = hit
            report.seconds = {"resolve": time.perf_counter() - t0}
            return _finish(adapters, report, name, strict, check_finite)
    t1 = time.perf_counter()
    pin = ram.pin if isinstance(ram, AdapterCache) and key is not None else False
    build = dict(force_download=force_download, hub_kw=hub_kw, allow_pickle=allow_pickle, config=config,
                 metadata=metadata, pin=pin, family=family, component=component, layers_per_block=layers_per_block,
                 svd_rank=svd_rank, dtype=dtype, name=name)
    if in_process or r.kind == "memory":
        adapters, report = build_adapters(r, **build)
        return _cached(adapters, report, ram if key is not None else None, key, t1 - t0, name, strict, check_finite)
    from . import worker

    packed = worker.read(build_adapters, r, page_locked=pin or torch.cuda.is_available(),
                         **{**build, "pin": True})  # (pin there, without CUDA: the one-buffer reader)
    pending = PendingLoad(packed, ram if key is not None else None, key, t1 - t0, name, strict, check_finite,
                          deferred)
    return pending.parts() if deferred else pending.result()


class PendingPart:
    """One component of a `PendingLoad` (what `load_adapters(..., deferred=True)` maps each component to)."""

    def __init__(self, load: PendingLoad, component: str) -> None:
        self.load, self.component = load, component

    def __repr__(self) -> str:
        return f"PendingPart({self.component!r})"


class PendingLoad:
    """A cache miss read in the reader process and not yet turned into objects: `packed` holds its tensors in one
    host block (fdlora.hub.worker.Packed: a device copy and a finite check over it need no objects). `result`
    builds the adapters and the report, puts them in the RAM cache and finishes as load_adapters does."""

    def __init__(self, packed: Any, ram: AdapterCache | None, key: CacheKey | None, resolve_s: float,
                 name: str | None, strict: bool, check_finite: bool, deferred: bool) -> None:
        self.packed, self.ram, self.key, self.resolve_s = packed, ram, key, resolve_s
        self.name, self.strict, self.check_finite, self.deferred = name, strict, check_finite, deferred
        self._done: tuple | None = None

    def parts(self) -> tuple[dict[str, PendingPart], PendingLoad]:
        """({component: PendingPart}, self): the components from the result's layout (build_adapters returns
        ({component: adapter}, report))."""
        return {w[1]: PendingPart(self, w[1]) for w in self.packed.adapters if len(w) == 2 and w[0] == 0}, self

    def result(self, finite: bool = False) -> tuple[dict[str, LoraAdapter], LoadReport]:
        """(adapters, report), built once. `finite`: a check over the whole block passed, so every module is
        marked checked (load_adapters' `check_finite` then checks the scales only)."""
        return drain(self.result_steps(finite))

    def result_steps(self, finite: bool = False, every: int = 0) -> Steps[tuple[dict[str, LoraAdapter], LoadReport]]:
        """`result`, stopping every `every` modules (fdlora.steps)."""
        if self._done is None:
            adapters, report = yield from self.packed.tree_steps(finite, every)
            block = self.packed.block
            # a deferred put runs between two steps: never one that would repack into fresh page-locked memory
            repack = self.ram is not None and self.ram.pin and block is not None and not block.pinned
            ram = None if self.deferred and repack else self.ram
            self._done = _cached(adapters, report, ram, self.key, self.resolve_s, self.name, self.strict,
                                 self.check_finite)
        return self._done


def materialize(adapters: dict[str, Any], report: Any, *,
                finite: bool = False) -> tuple[dict[str, LoraAdapter], LoadReport]:
    """What `load_adapters(..., deferred=True)` returned (with its components possibly renamed), as adapters and a
    report; anything else as it is. `finite`: see PendingLoad.result."""
    return drain(materialize_steps(adapters, report, finite=finite))


def materialize_steps(adapters: dict[str, Any], report: Any, *, finite: bool = False,
                      every: int = 0) -> Steps[tuple[dict[str, LoraAdapter], LoadReport]]:
    """`materialize`, stopping every `every` modules (fdlora.steps)."""
    if not isinstance(report, PendingLoad):
        return adapters, report
    built, report = yield from report.result_steps(finite, every)
    return {c: built[p.component] if isinstance(p, PendingPart) else p for c, p in adapters.items()}, report


def _cached(adapters, report, ram, key, resolve_s, name, strict, check_finite):
    if ram is not None:
        adapters = ram.put(key, adapters, report)
    report.modules_of = {c: a.modules for c, a in adapters.items()}  # (the cached tensors once put)
    report.seconds = {"resolve": resolve_s, **report.seconds}
    return _finish(adapters, report, name, strict, check_finite)


def build_adapters(r: Resolved, *, force_download: bool, hub_kw: dict[str, Any], allow_pickle: bool, config,
                   metadata, pin: bool, family: Any, component: str | None, layers_per_block: int,
                   svd_rank: int | None, dtype: torch.dtype | None,
                   name: str | None) -> tuple[dict[str, LoraAdapter], LoadReport]:
    """What a RAM-cache miss of `load_adapters` does: fetch, read, detect, convert, cast; (adapters, report with
    `seconds` for fetch / read / convert). Runs in the caller's process or in the reader process
    (fdlora.hub.worker), so everything it takes pickles."""
    t1 = time.perf_counter()
    r = fetch(r, force_download=force_download, **hub_kw)
    t2 = time.perf_counter()
    reader = env.file_reader()
    pin = reader == "pinned" or (reader == "auto" and pin)
    raw = _read(r, allow_pickle, config, metadata, pin=pin)
    t3 = time.perf_counter()
    if raw.config is not None:  # PEFT's LoraConfig semantics apply: its import is timed apart from the conversion
        with contextlib.suppress(ImportError):  # (without PEFT, the converter says what is missing)
            import_peft()
    t4 = time.perf_counter()
    fmt, why, others = formats.detect(raw, family)
    conv = formats.convert(fmt, raw, formats.Options(component=component, layers_per_block=layers_per_block))
    if svd_rank:
        lycoris.convert_svd(conv, svd_rank)
    kinds = lycoris.summary(conv.components)
    check_ranks(conv.components, raw.name)
    adapters = {}
    for comp, mods in conv.components.items():
        if mods:
            prov = Provenance(source=r.source, revision=r.sha, file=r.file, format=fmt.name, component=comp)
            adapter = LoraAdapter(mods, use_rslora=conv.rslora.get(comp, False), name=name, provenance=prov)
            adapters[comp] = adapter.to(dtype=dtype) if dtype else adapter
    report = LoadReport(
        source=r.source, kind=r.kind, revision=r.revision, sha=r.sha, file=r.file, file_choice=r.choice,
        format=fmt.name + (f" ({kinds})" if kinds else ""), format_reason=why, also_matched=others,
        components={c: len(a.modules) for c, a in adapters.items()},
        rslora={c: a.use_rslora for c, a in adapters.items()}, configs=conv.configs,
        keys_total=len(raw.tensors), keys_matched=conv.matched, keys_unused=conv.unused,
        keys_dropped=conv.dropped, keys_saved=conv.saved, notes=conv.notes,
        dtype=str(dtype).removeprefix("torch.") if dtype else None, nbytes=sum(a.nbytes() for a in adapters.values()),
        seconds={"fetch": t2 - t1, "read": t3 - t2, **({"import peft": t4 - t3} if t4 - t3 > 1e-3 else {}),
                 "convert": time.perf_counter() - t4},
    )
    if not adapters:
        reasons = {**conv.unused, **conv.dropped}
        raise FormatError(f"{raw.name}: detected as {fmt.name} ({why}) but no LoRA module could be built from its "
                          f"{len(raw.tensors)} keys: {dict(list(reasons.items())[:8])}.")
    return adapters, report


def load_many(sources: Mapping[str, Any] | Sequence[Any], *, progress: bool = True,
              **kwargs) -> dict[str, tuple[dict[str, LoraAdapter], LoadReport]]:
    """`load_adapters` over many sources with a progress bar; returns {name: (adapters, report)}.

    `sources` is {adapter name: source} or a list of sources (named by their repo id / path).
    Each value may also be a dict of per-source keywords with the source under "source".
    """
    from huggingface_hub.utils import tqdm

    items = list(sources.items()) if isinstance(sources, Mapping) else [(str(s), s) for s in sources]
    out = {}
    with tqdm(total=len(items), desc="fd-lora adapters", unit="adapter", disable=not progress) as bar:
        for adapter_name, src in items:
            kw = dict(kwargs)
            if isinstance(src, Mapping) and "source" in src:
                kw.update({k: v for k, v in src.items() if k != "source"})
                src = src["source"]
            out[adapter_name] = load_adapters(src, name=adapter_name, **kw)
            bar.update(1)
    return out


def _read(r: Resolved, allow_pickle: bool, config, metadata, pin: bool = False) -> formats.Raw:
    if r.kind == "memory":
        sd = r.state_dict or {}
        bad = [k for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise FormatError(f"a state dict source must map str keys to tensors; these entries do not: {bad[:5]}.")
        return formats.Raw(dict(sd), dict(metadata or {}), _config_dict(config), "<memory>")
    tensors, meta = read_weights(r.path, allow_pickle=allow_pickle, pin=pin)
    cfg = _config_dict(config) if config is not None else _read_config(r.config_path)
    return formats.Raw(tensors, meta, cfg, r.file or r.source)


def _config_dict(config) -> dict[str, Any] | None:
    if config is None:
        return None
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if isinstance(config, Mapping):
        return dict(config)
    raise FormatError(f"config must be a peft LoraConfig or a dict, got {type(config).__name__}.")


def _read_config(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except RecursionError:
        raise FormatError(f"{path}: the adapter config nests too deeply to be a LoraConfig.") from None
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: not a readable JSON adapter config ({e}).") from None
    if not isinstance(cfg, dict):
        raise FormatError(f"{path}: an adapter config must be a JSON object.")
    return cfg


def check_ranks(components: Mapping[str, Mapping[str, Any]], where: str) -> None:
    """Raise CapacityError, before anything is allocated for it, if a module's rank is above `FDLORA_MAX_RANK`."""
    cap = env.max_rank_limit()
    for comp, mods in components.items():
        for path, m in mods.items():
            if m.rank > cap:
                exact = (f" (a {m.origin} module held exactly; lora_conversion='svd:RANK' loads it as a plain LoRA "
                         "of that rank instead)") if m.origin != "lora" else ""
                raise CapacityError(f"{where}: {comp}.{path} has rank {m.rank}{exact}, above the rank limit {cap}; "
                                    f"every bank of {comp} would grow to fit it. If the adapter is genuine, raise the "
                                    f"limit ({env.MAX_RANK_VAR}={m.rank}).")


def _finish(adapters, report, name, strict, check_finite):
    if name is not None:
        for a in adapters.values():
            a.name = name
    if check_finite:
        for a in adapters.values():
            a.check_finite()
    if strict:
        report.check_strict()
    else:
        warn_partial(report)
    return adapters, report


def warn_partial(report: LoadReport) -> None:
    """Log and `warnings.warn` (PartialLoadWarning) when a load left LoRA keys behind: every time, cached or not,
    naming how many modules were dropped and why (fdlora.hub.report.lost_modules)."""
    from .report import lost_modules

    lost = {**report.keys_dropped, **{k: why for k, why in report.keys_unused.items() if why not in BENIGN}}
    if not lost:
        return
    modules = lost_modules(lost)
    by_why: dict[str, int] = {}
    for why in modules.values():
        by_why[why] = by_why.get(why, 0) + 1
    whys = "; ".join(f"{n} x {why}" for why, n in list(by_why.items())[:4])
    more = f"; and {len(by_why) - 4} other reasons" if len(by_why) > 4 else ""
    msg = (f"fd-lora: {report.source}: {len(lost)} of {report.keys_total} keys were not loaded "
           f"(e.g. {list(lost)[:3]}), dropping {len(modules)} modules: {whys}{more}. {report.modules} modules "
           "loaded. Print the load report for every key, or pass strict=True to make this an error.")
    if logger.hasHandlers():  # logging is set up (a handler on "fdlora" or above): the log gets it too
        logger.warning(msg)  # (without one, logging's last-resort handler would print the warning a second time)
    warnings.warn(msg, PartialLoadWarning, stacklevel=3)
