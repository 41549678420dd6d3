"""fd-lora on diffusers pipelines: `pipe.load_fd_lora(...)` and diffusers' own LoRA calls with fd-lora semantics.

`DiffusionPipeline.load_fd_lora` is the one method fd-lora adds to a diffusers class. On first use
it switches that pipeline *instance* to a subclass of its own class with `FdLoraPipelineMixin`
first in the MRO (same class name), so `set_adapters`, `fuse_lora`, `__call__` and friends on that
pipe get fd-lora semantics while every other pipe is untouched; `unload_lora_weights()` switches it
back. Custom pipelines can inherit `FdLoraPipelineMixin` directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...errors import DuplicateAdapterError, FdLoraError, PartialLoadWarning, TargetError, UnknownAdapterError
from ...hub.adapter import LoraAdapter
from ...hub.pool import AdapterPool
from ...layers import FdLoraHandle, match_targets, padded_rank, quantized, registry_of_models
from ...layers.captured import capture_steps, release_steps, steps_of
from .. import background as prefetching
from .. import fuse as fusing
from ..scope import pipe_lock
from . import fused_qkv, schedule, tree
from .family import family_of
from .scale import install_scale_hook, remove_scale_hook
from .targets import SCALE_KWARGS, targets_for

logger = logging.getLogger("fdlora")

DEFAULT_SLOTS = 4
ROUTED = re.compile(r"\.experts\.\d+\.")  # a routed MoE expert's layers (HiDream); shared experts see every token
DEFAULT_RANK = 64


def _unwrap(m: Any) -> Any:
    return getattr(m, "_orig_mod", m)  # torch.compile(...) wrapper -> the module


def _is_compiled(m: Any) -> bool:
    return hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None


def block_weight_fn(model: nn.Module, weight: Mapping[str, Any]):
    """diffusers' block-dict semantics as a function of the layer path.

    UNets expand {"down": .., "mid": .., "up": {"block_0": [..]}} with diffusers' own
    `_maybe_expand_lora_scales`; then, as in `set_weights_and_activate_adapters`, the first key that
    is a substring of the module path wins, else its `<a>.<b>.attentions.<c>` block key, else 1.0.
    """
    from diffusers.loaders.peft import _SET_ADAPTER_SCALE_FN_MAPPING

    expanded = _SET_ADAPTER_SCALE_FN_MAPPING[type(model).__name__](model, [dict(weight)])[0]

    def weight_of(path: str) -> float:
        for key, w in expanded.items():
            if key in path:
                return float(w)
        parts = path.split(".")
        if len(parts) >= 4:
            return float(expanded.get(f"{parts[0]}.{parts[1]}.attentions.{parts[3]}", 1.0))
        return 1.0

    return weight_of


class FdLoraPipelineMixin:
    """LoRA methods of a diffusers pipeline, served by fd-lora's fused layers."""

    # --- components ----------------------------------------------------------------------------
    def _fd_modules(self) -> dict[str, nn.Module]:
        return {n: _unwrap(m) for n, m in self.components.items() if isinstance(_unwrap(m), nn.Module)}

    def fd_lora_handles(self) -> dict[str, FdLoraHandle]:
        """Component name -> fd-lora handle, for components holding fd-lora layers."""
        return self._fd_handles(self._fd_modules())

    @staticmethod
    def _fd_handles(modules: Mapping[str, nn.Module]) -> dict[str, FdLoraHandle]:
        """fd_lora_handles over `modules` (`_fd_modules()`: diffusers' `components` inspects signatures each call)."""
        out = {}
        for name, m in modules.items():
            h = registry_of_models.get(m)
            if h is not None:
                out[name] = h
        return out

    def fd_lora_pools(self) -> dict[str, AdapterPool]:
        """Component name -> its GPU slot pool (fdlora.hub.pool): more adapters than slots, LRU eviction,
        evicted adapters back from RAM on demand."""
        return {c: AdapterPool.of(h) for c, h in self.fd_lora_handles().items()}

    def _fd_denoiser(self) -> str:
        fam = family_of(self)
        if fam is not None and fam.denoiser in self.components:
            return fam.denoiser
        return "unet" if "unet" in self.components else "transformer"

    # --- loading -------------------------------------------------------------------------------
    def load_fd_lora(self, source: Any, adapter_name: str | None = None, *, strict: bool = False,
                     max_slots: int | None = None, max_rank: int | None = None, validate: bool = True,
                     targets: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
                     load_into_transformer_2: bool = False, **hub_kwargs: Any):
        """Load an adapter (Hub repo id, directory, file, state dict, or {component: LoraAdapter}).

        Routes each component's modules to `unet` / `transformer` / `text_encoder*`. Atomic: every
        component is validated before anything is written. The new adapter becomes the only active one,
        as with diffusers' `load_lora_weights`. Returns the load report (None for canonical input).

        The first load into a component sets its capacity (`max_slots`, `max_rank`) and wraps the
        architecture's table of targets (fdlora.pipelines.diffusers.targets), plus `targets` (module-name
        suffixes for the denoiser, or {component: suffixes}): later adapters within them load into
        free slots without touching the module tree, so a compiled denoiser never recompiles.

        The file's layout is read the way this pipeline's diffusers LoRA mixin reads it (its
        `lora_state_dict` converters; fdlora.pipelines.diffusers.family). `load_into_transformer_2=True`
        (Wan 2.2) loads the transformer weights into `transformer_2`, as diffusers does.
        """
        with pipe_lock(self):
            adapters, report = self._fd_read(source, strict=strict, **hub_kwargs)
            return self._fd_attach(adapters, report, adapter_name, strict=strict, max_slots=max_slots,
                                   max_rank=max_rank, validate=validate, targets=targets,
                                   load_into_transformer_2=load_into_transformer_2)

    def prefetch_fd_lora(self, source: Any, adapter_name: str | None = None, **kwargs: Any):
        """Load an adapter in the background while this pipeline keeps serving; returns a `Prefetch` (a future) at
        once. Same keywords as `load_fd_lora`; the adapter is not activated. See fdlora.pipelines.prefetch."""
        return prefetching.pipeline_job(self, source, adapter_name, kwargs)

    def _fd_attach(self, adapters: dict[str, Any], report: Any, adapter_name: str | None, *, strict: bool = False,
                   max_slots: int | None = None, max_rank: int | None = None, validate: bool = True,
                   targets: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
                   load_into_transformer_2: bool = False, activate: bool = True,
                   staged: Mapping[str, Any] | None = None):
        """The attach step of `load_fd_lora` (the caller holds the pipe lock): check every component, make room,
        write. With `activate=False` (a prefetch, fdlora.pipelines.prefetch) the active set stays as it is, so
        room is made by evicting inactive adapters only. `staged`: per component, the adapter's device copy
        made off the lock (fdlora.hub.cache.stage), used when it still covers the adapter's tensors."""
        staged = staged or {}
        modules = self._fd_modules()
        if load_into_transformer_2:
            if "transformer_2" not in modules:
                raise FdLoraError(f"load_into_transformer_2=True, but this {type(self).__name__} has no "
                                  "transformer_2 (Wan 2.1 pipelines have one transformer; Wan 2.2 has two).")
            adapters = {("transformer_2" if c == "transformer" else c): a for c, a in adapters.items()}
        report = self._fd_note_ignored(adapters, report)
        absent = [c for c in adapters if c not in modules]
        if absent:
            msg = (f"the adapter has weights for {absent}, which this {type(self).__name__} does not have "
                   f"(components: {sorted(modules)}).")
            if strict:
                raise FdLoraError(msg + " Load it into a matching pipeline, or pass strict=False to skip them.")
            logger.warning("fd-lora: skipping %s", msg)
            warnings.warn(f"fd-lora: skipping {len(absent)} component(s): {msg}", PartialLoadWarning, stacklevel=2)
            adapters = {c: a for c, a in adapters.items() if c not in absent}
        if not adapters:
            raise FdLoraError("nothing to load: the adapter has no weights for this pipeline's components.")
        trees = {c: tree.scan(modules[c]) for c in adapters}  # PEFT layers, fused q/k/v: one walk per component
        adapters = {c: fused_qkv.retarget(modules[c], a) if trees[c].fused else a  # fuse_qkv_projections
                    for c, a in adapters.items()}
        handles = self._fd_handles(modules)
        names = self._fd_all_names(handles)
        name = adapter_name or f"default_{len(names)}"
        if name in names:
            raise DuplicateAdapterError(f"an adapter named {name!r} is already loaded; delete_adapters() it "
                                        "first or pick another adapter_name.")
        plans = []
        before = {c: dict(h.state.active) for c, h in handles.items()}  # an eviction below may deactivate
        for comp, adapter in adapters.items():
            model = modules[comp]
            if trees[comp].peft:  # (the pool fits CLIP paths with or without `text_model.`)
                self._fd_refuse_peft(comp)
            h = handles.get(comp)
            fresh = h is None
            need = padded_rank(max(m.rank for m in adapter.modules.values()))
            if fresh:
                h = self._fd_new_handle(comp, model, max_slots, max_rank, need)
            elif need > h.max_rank and not h.state.static:
                logger.info("fd-lora: growing %s rank capacity %d -> %d for %r", comp, h.max_rank, need, name)
                h.grow(max_rank=need)
            pool = AdapterPool.of(h)
            plans.append((comp, h, pool, fresh, pool.check(name, adapter, validate=validate,
                                                           staged=staged.get(comp))))
        try:  # every component checked: now full pools make room (evicting their least recently used)
            plans = [(comp, h, pool, fresh, pool.make_room(plan, evict_active=activate))
                     for comp, h, pool, fresh, plan in plans]
        except BaseException:  # Ctrl-C too: no half-made room
            self._fd_reactivate(before)
            raise
        extra = targets if isinstance(targets, Mapping) else {self._fd_denoiser(): targets or []}
        done: list[tuple[FdLoraHandle, AdapterPool, bool]] = []
        wrapped = {comp: len(h.layers) for comp, h in handles.items()}
        try:
            for comp, h, pool, fresh, plan in plans:
                if fresh:
                    self._fd_install(h, extra.get(comp) or [])
                done.append((h, pool, fresh))
                pool.commit(plan, activate=False)
        except BaseException:  # Ctrl-C too: the name is free again, every component as before
            for h, pool, fresh in done:
                if fresh:
                    h.restore()
                elif name in pool.known():
                    pool.delete(name)
            self._fd_reactivate(before)
            raise
        for comp, h, *_ in plans:
            if len(h.layers) != wrapped.get(comp, 0):
                _reapply_group_offloading(h.model)
        if activate:
            self.set_adapters([name])
        return self._fd_note_quantized([comp for comp, *_ in plans], report, self._fd_handles(modules))

    def _fd_reactivate(self, active: Mapping[str, Mapping[str, Any]]) -> None:
        """Put back each component's active set (after a call that changed it: a failed load whose room-making
        evicted some, per-prompt adapters that needed room, a per-step schedule)."""
        for comp, h in self.fd_lora_handles().items():
            want = active.get(comp)
            if want is not None and want != h.state.active:
                pool = AdapterPool.of(h)
                pool.ensure([n for n in want if n in pool.known()], evict_active=True)
                h.set_adapters(list(want), list(want.values()))

    def load_lora_weights(self, pretrained_model_name_or_path_or_dict: Any, adapter_name: str | None = None,
                          hotswap: bool = False, **kwargs: Any):
        """diffusers' entry point on an fd-lora pipe: loads through fd-lora (hotswap replaces in place)."""
        for k in ("proxies", "use_safetensors", "low_cpu_mem_usage"):
            kwargs.pop(k, None)
        if hotswap and adapter_name in self.get_active_adapters() + self._fd_all_names():
            tmp = f"__hotswap_{adapter_name}"
            self.load_fd_lora(pretrained_model_name_or_path_or_dict, tmp, **kwargs)
            with pipe_lock(self):
                active = self.get_active_adapters()
                for pool in self.fd_lora_pools().values():
                    if adapter_name in pool.known():
                        pool.delete(adapter_name)
                    if tmp in pool.known():
                        pool.rename(tmp, adapter_name)
                self.set_adapters([adapter_name if a == tmp else a for a in active])
            return None
        return self.load_fd_lora(pretrained_model_name_or_path_or_dict, adapter_name, **kwargs)

    def enable_lora_hotswap(self, target_rank: int = 128, check_compiled: str = "error") -> None:
        """Nothing to prepare: fd-lora banks are preallocated, so switching never recompiles."""

    def _fd_read(self, source: Any, strict: bool, **hub_kwargs: Any):
        if isinstance(source, LoraAdapter):
            return {self._fd_denoiser(): source}, None
        if isinstance(source, Mapping) and source and all(isinstance(v, LoraAdapter) for v in source.values()):
            return dict(source), None
        from ...hub import load_adapters

        hub_kwargs.setdefault("family", family_of(self))
        adapters, report = load_adapters(source, strict=strict, **hub_kwargs)
        den = self._fd_denoiser()
        if "model" in adapters and den not in adapters:  # a model-level file whose component its paths don't tell
            adapters[den] = adapters.pop("model")
        return adapters, report

    def _fd_note_ignored(self, adapters: Mapping[str, Any], report: Any):
        """Say in the report which components fd-lora applies that diffusers' load_lora_weights ignores for this
        family (a Flux file's T5 `text_encoder_2` LoRA); the report may be the RAM cache's, so a copy."""
        fam = family_of(self)
        if report is None or fam is None:
            return report
        ignored = {c: f"diffusers' {fam.mixin.__name__} loads only {list(fam.loaded_by_diffusers)}; fd-lora applies "
                      f"{c} too" for c in adapters if c not in fam.loaded_by_diffusers}
        if not ignored:
            return report
        report = dataclasses.replace(report, diffusers_ignores=ignored, notes=list(report.notes))
        for c, why in ignored.items():
            logger.info("fd-lora: %s: %s", c, why)
        return report

    def _fd_note_quantized(self, comps: Sequence[str], report: Any, handles: Mapping[str, FdLoraHandle]):
        """Say in the report (and the log) which wrapped layers of `handles` have quantized or float8-stored bases
        (torchao, GGUF, bitsandbytes, layerwise casting): they run base output + delta and keep no merged copy."""
        notes = []
        for comp in comps:
            kinds = Counter([k for lay in handles[comp].layers.values() if (k := quantized.kind(lay.base))])
            if kinds:
                n = len(handles[comp].layers)
                notes.append(f"{comp}: {sum(kinds.values())} of {n} LoRA layers have quantized bases ("
                             + ", ".join(f"{k}: {c}" for k, c in sorted(kinds.items()))
                             + "): base output + LoRA delta, no dequantized copy (the merged-weight cache skips "
                             "them; fuse_lora refuses them)")
        for note in notes:
            logger.info("fd-lora: %s", note)
        if report is None or not notes or all(n in report.notes for n in notes):
            return report
        return dataclasses.replace(report, notes=list(report.notes) + [n for n in notes if n not in report.notes])

    def fd_lora_prepare(self, *, max_slots: int | None = None, max_rank: int | None = None) -> dict[str, FdLoraHandle]:
        """Swap fd-lora layers in for the denoiser's LoRA target table now, as the first `load_fd_lora` would (the same
        table, slots and rank: DEFAULT_SLOTS / DEFAULT_RANK unless given), so that the first load only reads and
        writes. On an H100 host wrapping SDXL's 722 layers (module objects, banks) was most of a first load after
        warmup (0.57 s; benchmarks/probes/probe_prefetch_cold.py). fdlora.pipelines.warmup calls it before the
        first load. A denoiser that already has fd-lora or PEFT layers, or whose family has no table, is left as it
        is. Without an adapter active the layers run the base alone. Returns fd_lora_handles()."""
        with pipe_lock(self):
            modules = self._fd_modules()
            comp = self._fd_denoiser()
            model = modules.get(comp)
            if (model is not None and registry_of_models.get(model) is None and targets_for(model)
                    and not tree.scan(model).peft):
                self._fd_install(self._fd_new_handle(comp, model, max_slots, max_rank, 0), [])
                _reapply_group_offloading(model)
            return self._fd_handles(modules)

    def _fd_new_handle(self, comp: str, model: nn.Module, max_slots: int | None, max_rank: int | None,
                       need: int) -> FdLoraHandle:
        """A component's handle as its first load makes it (not yet wrapping anything: `_fd_install`)."""
        h = FdLoraHandle(model, max_slots=max_slots or DEFAULT_SLOTS, max_rank=max(max_rank or DEFAULT_RANK, need))
        if _is_compiled(self.components[comp]):
            h.freeze()
        return h

    def _fd_install(self, h: FdLoraHandle, extra: Sequence[str]) -> None:
        """Wrap a new handle's target table (plus `extra` paths) and register it with the model."""
        self._fd_wrap_table(h, extra)
        registry_of_models[h.model] = h
        install_scale_hook(h.model)

    def _fd_wrap_table(self, h: FdLoraHandle, extra: Sequence[str]) -> None:
        targets = targets_for(h.model) + list(extra)
        if targets:
            with contextlib.suppress(TargetError):
                h.wrap(match_targets(h.model, targets))

    @staticmethod
    def _fd_refuse_peft(comp: str) -> None:
        raise FdLoraError(
            f"{comp} already holds LoRA layers from diffusers' load_lora_weights (PEFT). Convert them with "
            "fdlora.from_diffusers(pipe), or remove them with pipe.unload_lora_weights() before load_fd_lora."
        )

    def _fd_all_names(self, handles: Mapping[str, FdLoraHandle] | None = None) -> list[str]:
        """Every loaded adapter, resident in a GPU slot or evicted to RAM (`handles`: fd_lora_handles())."""
        handles = self.fd_lora_handles() if handles is None else handles
        return list(dict.fromkeys(n for h in handles.values() for n in AdapterPool.of(h).names()))

    # --- switching -----------------------------------------------------------------------------
    def set_adapters(self, adapter_names: str | Sequence[str], adapter_weights: Any = None) -> None:
        """diffusers semantics: float, list, {component: w} and UNet block dicts; None means 1.0. O(1) for numbers."""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        if adapter_weights is None or not isinstance(adapter_weights, (list, tuple)):
            adapter_weights = [adapter_weights] * len(names)
        if len(adapter_weights) != len(names):
            raise FdLoraError(f"{len(names)} adapter names but {len(adapter_weights)} weights; give one per name.")
        with pipe_lock(self):
            handles = self.fd_lora_handles()
            loaded = set(self._fd_all_names())
            unknown = [n for n in names if n not in loaded]
            if unknown:
                raise prefetching.unknown_error(self, unknown, loaded)
            for comp, h in handles.items():
                pool, ns, ws = AdapterPool.of(h), [], []
                known = set(pool.names())
                for n, w in zip(names, adapter_weights):
                    if n not in known:
                        continue
                    if isinstance(w, Mapping) and set(w) & set(self.components):
                        w = w.get(comp, 1.0)  # per-component dict
                    if isinstance(w, Mapping):
                        w = block_weight_fn(h.model, w)
                    ns.append(n)
                    ws.append(1.0 if w is None else w)
                pool.ensure([n for n in ns if n in pool.known()], evict_active=True)  # evicted ones come back
                h.set_adapters(ns, ws)

    def get_active_adapters(self) -> list[str]:
        return list(dict.fromkeys(n for h in self.fd_lora_handles().values() for n in h.active_adapters()))

    def get_list_adapters(self) -> dict[str, list[str]]:
        return {c: p.names() for c, p in self.fd_lora_pools().items() if p.names()}

    def delete_adapters(self, adapter_names: str | Sequence[str]) -> None:
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        with pipe_lock(self):
            names = prefetching.cancel_pending(self, names)  # a name still being prefetched: cancelled
            loaded = set(self._fd_all_names())
            unknown = [n for n in names if n not in loaded]
            if unknown:
                raise UnknownAdapterError(f"adapter(s) {unknown} are not loaded (loaded: {sorted(loaded)}).")
            for pool in self.fd_lora_pools().values():
                pooled = [n for n in names if n in pool.known()]
                if pooled:
                    pool.delete(pooled)
                pool.handle.delete_adapter([n for n in names if n in pool.handle.list_adapters()])

    def disable_lora(self) -> None:
        with pipe_lock(self):
            for h in self.fd_lora_handles().values():
                h.disable()

    def enable_lora(self) -> None:
        with pipe_lock(self):
            for h in self.fd_lora_handles().values():
                if not getattr(h, "fused", None):
                    h.enable()

    def unload_lora_weights(self, *args: Any, **kwargs: Any) -> None:
        """Remove fd-lora from every component: original modules back (bit-exact unless fused first)."""
        with pipe_lock(self):
            prefetching.cancel_all(self)
            for m in self._fd_denoisers():
                release_steps(m)  # captured graphs hold the fused layers' launches
            for h in self.fd_lora_handles().values():
                h.__dict__.pop("fused", None)  # diffusers semantics: fuse then unload keeps the fused weights
                remove_scale_hook(h.model)
                h.restore()
            self.__dict__.pop("_fdlora_fused", None)
            base = type(self).__dict__.get("_fdlora_base")
            if base is not None:
                self.__class__ = base

    # --- captured steps (fdlora.layers.captured) ---------------------------------------------------
    def _fd_denoisers(self) -> list[nn.Module]:
        mods = self._fd_modules()
        return [mods[n] for n in dict.fromkeys((self._fd_denoiser(), "transformer_2")) if n in mods]

    def enable_fd_lora_cuda_graphs(self, *, clone_outputs: bool = True, max_graphs: int = 8) -> None:
        """Run the denoiser's steps as CUDA graphs (captured per input shape on first use, then replayed): the
        eager step's host cost goes, adapter switches and slider moves still apply on the next replay."""
        with pipe_lock(self):
            for m in self._fd_denoisers():
                if steps_of(m) is None:
                    capture_steps(m, clone_outputs=clone_outputs, max_graphs=max_graphs)

    def disable_fd_lora_cuda_graphs(self) -> None:
        with pipe_lock(self):
            for m in self._fd_denoisers():
                release_steps(m)

    # --- fusing --------------------------------------------------------------------------------
    def fuse_lora(self, components: Sequence[str] | None = None, lora_scale: float = 1.0, safe_fusing: bool = False,
                  adapter_names: Sequence[str] | None = None, **kwargs: Any) -> None:
        """Bake the active adapters (or `adapter_names`) into the base weights; unfuse_lora restores them exactly."""
        with pipe_lock(self):
            handles = {c: h for c, h in self.fd_lora_handles().items() if components is None or c in components}
            done = []
            try:
                for comp, h in handles.items():
                    if getattr(h, "fused", None):
                        raise FdLoraError(f"{comp} is already fused; call unfuse_lora() first.")
                    names = list(adapter_names) if adapter_names is not None else h.active_adapters()
                    pool = AdapterPool.of(h)
                    pool.ensure([n for n in names if n in pool.known()])
                    # each adapter at its current weight (a number, or block-wise per layer), 1.0 if inactive
                    slots = {h.state.slots.by_name[n]: h.state.active.get(n, 1.0)
                             for n in names if n in h.state.slots.by_name}
                    originals = {}
                    done.append((h, originals))
                    for layer in h.layers.values():
                        if any(layer.bank.used):
                            w = torch.zeros(h.state.slots.capacity)
                            for slot, a in slots.items():
                                w[slot] = (a(layer.path) if callable(a) else a) * lora_scale
                            originals[layer.path] = fusing.fuse_layer(
                                layer, w * h.state.table.scaling[layer.index], safe_fusing)
                    h.fused = (originals, names)
                    h.disable()
            except Exception:
                for h, originals in done:
                    for path, orig in originals.items():
                        fusing.unfuse_layer(h.layers[path], orig)
                    h.__dict__.pop("fused", None)
                    h.enable()
                raise
            self._fdlora_fused = sorted({n for h, _ in done for n in h.fused[1]})

    def unfuse_lora(self, components: Sequence[str] | None = None, **kwargs: Any) -> None:
        with pipe_lock(self):
            for comp, h in self.fd_lora_handles().items():
                if (components is None or comp in components) and getattr(h, "fused", None):
                    originals, _ = h.fused
                    for path, orig in originals.items():
                        fusing.unfuse_layer(h.layers[path], orig)
                    del h.fused
                    h.enable()
            self._fdlora_fused = sorted({n for h in self.fd_lora_handles().values()
                                         for n in (getattr(h, "fused", None) or ((), ()))[1]})

    @property
    def fused_loras(self) -> set[str]:
        return set(self.__dict__.get("_fdlora_fused", ()))

    @property
    def num_fused_loras(self) -> int:
        return len(self.fused_loras)

    # --- calls ---------------------------------------------------------------------------------
    def encode_prompt(self, *args: Any, lora_scale: float | None = None, **kwargs: Any):
        if lora_scale is not None:  # (Wan, Qwen-Image and others have no lora_scale: pass it only when given)
            kwargs["lora_scale"] = lora_scale
        with pipe_lock(self), self._fd_scaled(lora_scale, text_only=True):
            return super().encode_prompt(*args, **kwargs)

    @contextlib.contextmanager
    def _fd_scaled(self, scale: float | None, text_only: bool = False):
        if scale is None:
            yield
            return
        handles = [h for c, h in self.fd_lora_handles().items() if not text_only or c.startswith("text_encoder")]
        saved = [h.state.table.multiplier for h in handles]
        for h in handles:
            h.set_multiplier(float(scale))
        try:
            yield
        finally:
            for h, m in zip(handles, saved):
                h.set_multiplier(m)

    def __call__(self, *args: Any, fd_lora_adapters: Sequence[Any] | None = None,
                 fd_lora_schedule: Mapping[str, Any] | None = None, **kwargs: Any):
        """A generation; `fd_lora_adapters` gives one adapter (name, None, or {name: weight}) per prompt;
        `fd_lora_schedule` a strength per denoising step for the adapters it names (see diffusers/schedule.py)."""
        scale = None
        for key in SCALE_KWARGS:  # diffusers' per-call LoRA scale: one table write instead of a module walk
            kw = kwargs.get(key)
            if isinstance(kw, Mapping) and "scale" in kw:
                scale = float(kw["scale"])
                kwargs[key] = {k: v for k, v in kw.items() if k != "scale"}
        with pipe_lock(self), contextlib.ExitStack() as stack:
            if scale is not None:
                stack.enter_context(self._fd_scaled(scale))
            if fd_lora_adapters is not None:
                # room for the requested adapters may evict active ones; the blend comes back after the call
                before = {c: dict(h.state.active) for c, h in self.fd_lora_handles().items()}
                stack.callback(self._fd_reactivate, before)
                for h, by_batch in self._fd_sample_specs(fd_lora_adapters, args, kwargs):
                    stack.enter_context(h.per_sample(by_batch))
            if fd_lora_schedule:
                schedule.check(fd_lora_schedule)
                steps = int(kwargs.get("num_inference_steps") or 50)
                names = list(fd_lora_schedule)
                before = {c: dict(h.state.active) for c, h in self.fd_lora_handles().items()}
                self.set_adapters(names, [schedule.strength_at(fd_lora_schedule[n], 0, steps) for n in names])
                stack.callback(self._fd_reactivate, before)
                kwargs["callback_on_step_end"] = schedule.step_callback(self, fd_lora_schedule, steps,
                                                                        kwargs.get("callback_on_step_end"))
            return super().__call__(*args, **kwargs)

    def _fd_sample_specs(self, specs: Sequence[Any], args: tuple, kwargs: dict):
        prompt = kwargs.get("prompt", args[0] if args else None)
        if isinstance(prompt, str):
            P = 1
        elif prompt is not None:
            P = len(prompt)
        elif kwargs.get("prompt_embeds") is not None:
            P = int(kwargs["prompt_embeds"].shape[0])
        else:
            raise FdLoraError("fd_lora_adapters needs `prompt` (or `prompt_embeds`) to know the batch.")
        specs = list(specs)
        if len(specs) != P:
            raise FdLoraError(f"fd_lora_adapters has {len(specs)} entries for {P} prompts; give one per prompt "
                              "(a name, None for the base model, or a {name: weight} blend).")
        loaded = set(self._fd_all_names())
        named = {n for s in specs if s is not None for n in ([s] if isinstance(s, str) else s)} - {"__base__"}
        if named - loaded:
            raise prefetching.unknown_error(self, sorted(named - loaded), loaded,
                                            "fd_lora_adapters names {}, which are not loaded")
        n = int(kwargs.get("num_images_per_prompt") or kwargs.get("num_videos_per_prompt") or 1)  # video: per video
        for comp, h in self.fd_lora_handles().items():
            routed = next((p for p in h.layers if ROUTED.search(p)), None)
            if routed is not None:  # rows of a routed expert's input are the tokens sent to it, not prompts
                raise FdLoraError(
                    f"per-prompt adapters cannot go through {comp}'s routed MoE experts ({routed}): the tokens each "
                    "expert sees are gathered across the batch, so its rows no longer line up with prompts. Run one "
                    "prompt per adapter, or a blend (set_adapters) for the whole batch.")
            pool = AdapterPool.of(h)
            pool.ensure(sorted(named & set(pool.known())), evict_active=True)  # all resident at once
            have = set(h.list_adapters())

            def only(s, have=have):
                if s is None or isinstance(s, str):
                    return s if s in have else None
                return {k: v for k, v in s.items() if k in have}

            per_prompt = [only(s) for s in specs]
            per_image = [s for s in per_prompt for _ in range(n)]
            yield h, {P: per_prompt, P * n: per_image, 2 * P * n: per_image + per_image}


_SUBCLASSES: dict[type, type] = {}


def enable_fd_lora(pipe: Any) -> Any:
    """Give one pipeline instance fd-lora's LoRA methods (its class gains FdLoraPipelineMixin first)."""
    cls = type(pipe)
    if not isinstance(pipe, FdLoraPipelineMixin):
        sub = _SUBCLASSES.get(cls)
        if sub is None:
            sub = _SUBCLASSES[cls] = type(cls.__name__, (FdLoraPipelineMixin, cls),
                                          {"__module__": cls.__module__, "_fdlora_base": cls})
        pipe.__class__ = sub
    return pipe


def load_fd_lora(self, source: Any, adapter_name: str | None = None, **kwargs: Any):
    """Load a LoRA into this pipeline with fd-lora (see FdLoraPipelineMixin.load_fd_lora)."""
    return enable_fd_lora(self).load_fd_lora(source, adapter_name, **kwargs)


def prefetch_fd_lora(self, source: Any, adapter_name: str | None = None, **kwargs: Any):
    """Load a LoRA into this pipeline in the background (see FdLoraPipelineMixin.prefetch_fd_lora)."""
    return enable_fd_lora(self).prefetch_fd_lora(source, adapter_name, **kwargs)


def _reapply_group_offloading(model: Any) -> None:
    """diffusers' group offloading (enable_group_offload) lists a group's tensors when it is applied; with streams
    it keeps a pinned copy of each and looks every tensor up on each onload, so the banks of layers wrapped after it
    was enabled would fail that lookup (KeyError). diffusers' own LoRA loader re-applies it after changing a
    model; fd-lora does the same when it wrapped new layers."""
    try:
        from diffusers.hooks.group_offloading import _maybe_remove_and_reapply_group_offloading
    except ImportError:  # a diffusers without group offloading
        return
    _maybe_remove_and_reapply_group_offloading(model)
