"""fd-lora on diffusers pipelines: `pipe.load_fd_lora(...)` and diffusers' own LoRA calls with fd-lora semantics.

`DiffusionPipeline.load_fd_lora` is the one method fd-lora adds to a diffusers class. On first use
it switches that pipeline *instance* to a subclass of its own class with `FdLoraPipelineMixin`
first in the MRO (same class name), so `set_adapters`, `fuse_lora`, `__call__` and friends on that
pipe get fd-lora semantics while every other pipe is untouched; `unload_lora_weights()` switches it
back. Custom pipelines can inherit `FdLoraPipelineMixin` directly.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fdlora.errors import FdLoraError, UnknownAdapterError
from fdlora.hub.pool import AdapterPool
from fdlora.integrations import fuse as fusing
from fdlora.integrations.diffusers import schedule
from fdlora.integrations.diffusers.family import family_of
from fdlora.integrations.diffusers.loading import FdLoraLoading
from fdlora.integrations.diffusers.scale import remove_scale_hook
from fdlora.integrations.diffusers.targets import SCALE_KWARGS
from fdlora.layers import FdLoraHandle, registry_of_models
from fdlora.layers.fastpath.captured import capture_steps, release_steps, steps_of
from fdlora.runtime import background as prefetching
from fdlora.runtime.scope import pipe_lock

logger = logging.getLogger("fdlora")

ROUTED = re.compile(r"\.experts\.\d+\.")  # a routed MoE expert's layers (HiDream); shared experts see every token


def _unwrap(m: Any) -> Any:
    return getattr(m, "_orig_mod", m)  # torch.compile(...) wrapper -> the module


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


class FdLoraPipelineMixin(FdLoraLoading):
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

    # --- captured steps (fdlora.layers.fastpath.captured) ---------------------------------------------------
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
