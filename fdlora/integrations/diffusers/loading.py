"""Loading onto a diffusers pipeline, the loading part of FdLoraPipelineMixin (fdlora.integrations.diffusers.pipeline):
`load_fd_lora`, `prefetch_fd_lora`, diffusers' `load_lora_weights` / hotswap, `fd_lora_prepare`, and the attach step
they share (every component checked, room made, layers wrapped, banks written: all or nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from fdlora.errors import DuplicateAdapterError, FdLoraError, PartialLoadWarning, TargetError
from fdlora.hub.adapter import LoraAdapter
from fdlora.hub.pool import AdapterPool
from fdlora.integrations.diffusers import fused_qkv, tree
from fdlora.integrations.diffusers.family import family_of
from fdlora.integrations.diffusers.scale import install_scale_hook
from fdlora.integrations.diffusers.targets import targets_for
from fdlora.layers import FdLoraHandle, match_targets, padded_rank, registry_of_models
from fdlora.layers.quant import quantized
from fdlora.runtime import background as prefetching
from fdlora.runtime.scope import pipe_lock
from fdlora.steps import COMMIT, Steps, drain

logger = logging.getLogger("fdlora")

DEFAULT_SLOTS = 4
DEFAULT_RANK = 64


def _is_compiled(m: Any) -> bool:
    return hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None


class FdLoraLoading:
    """FdLoraPipelineMixin's loading methods (it inherits them; on their own they are not a pipeline API: they use
    its components, handles and switching)."""

    def load_fd_lora(self, source: Any, adapter_name: str | None = None, *, strict: bool = False,
                     max_slots: int | None = None, max_rank: int | None = None, validate: bool = True,
                     targets: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
                     load_into_transformer_2: bool = False, **hub_kwargs: Any):
        """Load an adapter (Hub repo id, directory, file, state dict, or {component: LoraAdapter}).

        Routes each component's modules to `unet` / `transformer` / `text_encoder*`. Atomic: every
        component is validated before anything is written. The new adapter becomes the only active one,
        as with diffusers' `load_lora_weights`. Returns the load report (None for canonical input).

        The first load into a component sets its capacity (`max_slots`: adapters resident at once, DEFAULT_SLOTS
        unless given; `max_rank`) and wraps the architecture's table of targets
        (fdlora.integrations.diffusers.targets), plus `targets` (module-name suffixes for the denoiser, or
        {component: suffixes}): later adapters within them load without touching the module tree. The banks hold
        what is loaded: a slot per adapter up to `max_slots` and the largest rank loaded (unless `max_rank` is
        given); a frozen or compiled denoiser gets the full capacity up front, so it never recompiles. Banks that do
        not fit raise DeviceMemoryError with the pipeline as it was.

        The file's layout is read the way this pipeline's diffusers LoRA mixin reads it (its
        `lora_state_dict` converters; fdlora.integrations.diffusers.family). `load_into_transformer_2=True`
        (Wan 2.2) loads the transformer weights into `transformer_2`, as diffusers does.
        """
        with pipe_lock(self):
            adapters, report = self._fd_read(source, strict=strict, **hub_kwargs)
            return self._fd_attach(adapters, report, adapter_name, strict=strict, max_slots=max_slots,
                                   max_rank=max_rank, validate=validate, targets=targets,
                                   load_into_transformer_2=load_into_transformer_2)

    def prefetch_fd_lora(self, source: Any, adapter_name: str | None = None, **kwargs: Any):
        """Load an adapter in the background while this pipeline keeps serving; returns a `Prefetch` (a future) at
        once. Same keywords as `load_fd_lora`; the adapter is not activated. See fdlora.integrations.prefetch."""
        return prefetching.pipeline_job(self, source, adapter_name, kwargs)

    def _fd_attach(self, adapters: dict[str, Any], report: Any, adapter_name: str | None, **kw: Any):
        """The attach step of `load_fd_lora` (the caller holds the pipe lock): check every component, make room,
        write. With `activate=False` (a prefetch, fdlora.integrations.prefetch) the active set stays as it is, so
        room is made by evicting inactive adapters only. `staged`: per component, the adapter's device copy
        made off the lock (fdlora.hub.cache.stage), used when it still covers the adapter's tensors."""
        return drain(self._fd_attach_steps(adapters, report, adapter_name, **kw))

    def _fd_attach_steps(self, adapters: dict[str, Any], report: Any, adapter_name: str | None, *,
                         strict: bool = False, max_slots: int | None = None, max_rank: int | None = None,
                         validate: bool = True, targets: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
                         load_into_transformer_2: bool = False, activate: bool = True,
                         staged: Mapping[str, Any] | None = None, every: int = 0) -> Steps[Any]:
        """`_fd_attach` in pieces (fdlora.steps), as a prefetch publishes: with `every`, the checks and the
        bank writes' tables are made `every` modules at a time, the pipeline unchanged until COMMIT; after it the
        writes are launched, unless something changed the components since (`_fd_stamp`): then the whole attach
        runs again at once. So does an attach that must wrap layers or grow a component's rank capacity; room made
        by evicting is made in one piece, before the writes' tables."""
        again = dict(strict=strict, max_slots=max_slots, max_rank=max_rank, validate=validate, targets=targets,
                     load_into_transformer_2=load_into_transformer_2, activate=activate, staged=staged)
        whole = (adapters, report, adapter_name)
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
        trees = {}  # PEFT layers, fused q/k/v: one walk per component (~4k modules on a wrapped SDXL UNet)
        for c in adapters:
            trees[c] = yield from tree.scan_steps(modules[c], every * 8)  # (a module: ~1/8 of a module's check)
        adapters = {c: fused_qkv.retarget(modules[c], a) if trees[c].fused else a  # fuse_qkv_projections
                    for c, a in adapters.items()}
        handles = self._fd_handles(modules)
        names = self._fd_all_names(handles)
        name = adapter_name or f"default_{len(names)}"
        if name in names:
            raise DuplicateAdapterError(f"an adapter named {name!r} is already loaded; delete_adapters() it "
                                        "first or pick another adapter_name.")
        if every:
            if any(c not in handles or padded_rank(max(m.rank for m in a.modules.values())) > handles[c].max_rank
                   for c, a in adapters.items()):  # wrapping or growing: at once
                return drain(self._fd_attach_steps(*whole, **again))
            stamp = self._fd_stamp(handles)
            yield
        plans, grown = [], []
        before = {c: dict(h.state.active) for c, h in handles.items()}  # an eviction below may deactivate
        try:
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
                    grown.append(h)
                pool = AdapterPool.of(h)
                plans.append((comp, h, pool, fresh, (yield from pool.check_steps(
                    name, adapter, validate=validate, staged=staged.get(comp), every=every))))
        except BaseException:  # banks grown for this load give the rank back (a refused load changes nothing)
            for h in grown:
                h.shrink()
            raise
        if every and (self._fd_stamp(handles) != stamp  # checked against components that changed since, or
                      or any(plan.to_wrap for *_, (plan, host) in plans)):  # layers to wrap (as growing: at once)
            return drain(self._fd_attach_steps(*whole, **again))
        try:  # every component checked: now full pools make room (evicting their least recently used)
            plans = [(comp, h, pool, fresh, pool.make_room(plan, evict_active=activate))
                     for comp, h, pool, fresh, plan in plans]
        except BaseException:  # Ctrl-C too: no half-made room
            self._fd_reactivate(before)
            raise
        notes = None
        if every:  # the writes made ahead, each for the slot commit will take while nothing changes
            stamp = self._fd_stamp(handles)
            plans = [(comp, h, pool, fresh, (dataclasses.replace(plan, slot=h.free_slot(name)), host))
                     for comp, h, pool, fresh, (plan, host) in plans]
            ahead = []
            for comp, h, pool, fresh, (plan, host) in plans:
                yield
                ahead.append((comp, h, pool, fresh, (dataclasses.replace(
                    plan, writes=(yield from h.writes_steps(plan, every, rekey=not activate))), host)))
            plans = ahead
            yield
            notes = self._fd_quantized_notes([comp for comp, *_ in plans], handles)
        yield COMMIT
        if every and self._fd_stamp(handles) != stamp:
            return drain(self._fd_attach_steps(*whole, **again))
        done: list[tuple[FdLoraHandle, AdapterPool, bool]] = []
        wrapped = {comp: len(h.layers) for comp, h in handles.items()}
        try:
            for comp, h, pool, fresh, plan in plans:
                if fresh:  # (diffusers' `components`, which _fd_denoiser reads, inspects signatures)
                    extra = targets if isinstance(targets, Mapping) else {self._fd_denoiser(): targets or []}
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
        if notes is None:
            notes = self._fd_quantized_notes([comp for comp, *_ in plans], self._fd_handles(modules))
        return self._fd_note(report, notes)

    @staticmethod
    def _fd_stamp(handles: Mapping[str, FdLoraHandle]) -> tuple:
        """What a load's checks and prepared writes rely on, per component: its handle still wrapping its model, the
        wrapped layers, their banks' shapes, the loaded names and their slots (a publication in pieces compares it
        before committing; a step changes none of it)."""
        return tuple((c, id(h), registry_of_models.get(h.model) is h, h.state.epoch, len(h.layers), h.max_rank,
                      h.state.slots.capacity, tuple(h.state.slots.by_name.items()), tuple(AdapterPool.of(h).known()))
                     for c, h in handles.items())

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
        from fdlora.hub import load_adapters

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

    @staticmethod
    def _fd_quantized_notes(comps: Sequence[str], handles: Mapping[str, FdLoraHandle]) -> list[str]:
        """Which wrapped layers of `handles` have quantized or float8-stored bases (torchao, GGUF, bitsandbytes,
        layerwise casting): they run base output + delta and keep no merged copy. One note per component."""
        notes = []
        for comp in comps:
            kinds = Counter([k for lay in handles[comp].layers.values() if (k := quantized.kind(lay.base))])
            if kinds:
                n = len(handles[comp].layers)
                notes.append(f"{comp}: {sum(kinds.values())} of {n} LoRA layers have quantized bases ("
                             + ", ".join(f"{k}: {c}" for k, c in sorted(kinds.items()))
                             + "): base output + LoRA delta, no dequantized copy (the merged-weight cache skips "
                             "them; fuse_lora refuses them)")
        return notes

    @staticmethod
    def _fd_note(report: Any, notes: list[str]):
        """Say `notes` in the report (a copy: it may be the RAM cache's) and the log."""
        for note in notes:
            logger.info("fd-lora: %s", note)
        if report is None or not notes or all(n in report.notes for n in notes):
            return report
        return dataclasses.replace(report, notes=list(report.notes) + [n for n in notes if n not in report.notes])

    def fd_lora_prepare(self, *, max_slots: int | None = None, max_rank: int | None = None) -> dict[str, FdLoraHandle]:
        """Swap fd-lora layers in for the denoiser's LoRA target table now, as the first `load_fd_lora` would (the same
        table, slots and rank: DEFAULT_SLOTS / DEFAULT_RANK unless given), so that the first load only reads and
        writes. On an H100 host wrapping SDXL's 722 layers (module objects, banks) was most of a first load after
        warmup (0.57 s; benchmarks/probes/probe_prefetch_cold.py). fdlora.integrations.warmup calls it before the
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
        compiled = _is_compiled(self.components[comp])
        # The banks hold what is loaded: one slot (more as loads need them, up to max_slots or DEFAULT_SLOTS) at the
        # first adapter's rank (grown by a later, larger one). A compiled component, or a prepare (need 0), gets the
        # full capacity now: its banks must not change shape later.
        lazy = not compiled and need > 0
        rank = max_rank or (need if lazy else DEFAULT_RANK)
        limit = max_slots or DEFAULT_SLOTS
        h = FdLoraHandle(model, max_slots=1 if lazy else limit, max_rank=max(rank, need), slot_limit=limit,
                         frozen_rank=max(max_rank or DEFAULT_RANK, need))
        if compiled:
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
