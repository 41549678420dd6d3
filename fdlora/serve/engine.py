"""What one replica does, without Ray: a pipeline built from a run config, the adapters the config allows, and
a batch of requests with different adapters run as ONE per-prompt call (`pipe(prompt=[...],
fd_lora_adapters=[...])`).

Adapters load on first use from the config's sources (through huggingface_hub's cache and fd-lora's RAM
cache) into the pipeline's slot pool, sized `adapters_per_replica`: the pool is the replica's LRU of
GPU-resident adapters (fdlora.hub.pool), and an adapter it evicts comes back from RAM. Ray Serve's
multiplexing (fdlora.serve.deployment) routes requests to the replica that holds their adapter and calls
`release` when its own LRU drops one; a release of an adapter a queued request still needs is harmless,
since `run` loads what its batch names first. The other adapters of a blend load here too, outside Ray's
LRU: they are `partners`, at most `adapters_per_replica` of them kept (least recently used deleted after a call),
so host memory holds the adapters Ray's LRU holds plus that many, the device at most `adapters_per_replica`.

Each request keeps its own seed (one torch.Generator per prompt), so a request's image does not depend on
the batch it lands in, up to float rounding of batched matmuls (CPU: ~2e-6, at most 1/255 after the PNG
conversion). Nor on the slots its adapters landed in: before each call, the call's adapters are put in slots in
name order (`_arrange`), so sums over slots meet them in one order whatever the replica's load history.

A failure stays with the requests that cause it (`run_each`): an adapter that fails to load (its file corrupt
or gone) fails only the requests that name it, with a one-line 500; a call that runs out of device memory drops
the merged-weight copies (halving their budget) and is run again one request at a time, and only a request that
still does not fit with no copy left to drop fails, with a 507 naming the limit. An engine puts its process's C heap
on one glibc arena and gives the heap's free pages back once a call's images are encoded, and again once the server
has been idle a second (fdlora.serve.heap), so the RSS follows the data that lives, not the threads that served.
"""

from __future__ import annotations

import base64
import collections
import functools
import io
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from ..api import dispatch_counts
from ..errors import FdLoraError
from . import heap
from .schema import ImageRequest, Limits, RequestError

log = logging.getLogger(__name__)


def make_engine(cfg):
    """The engine for a config: images for `pipeline:`, greedy token generation for `model:`."""
    return Engine(cfg) if cfg.kind == "pipeline" else TextEngine(cfg)


class Engine:
    def __init__(self, cfg, pipe: Any = None) -> None:
        if cfg.kind != "pipeline":
            raise FdLoraError(f"{cfg.source}: Engine serves diffusers pipelines; use TextEngine for 'model:'")
        self._setup(cfg, pipe)
        self.pipe.set_progress_bar_config(disable=True)
        self._dtypes = _uniform_dtypes(self.pipe)  # put back after a failed call (see _call)

    def _setup(self, cfg, pipe: Any) -> None:
        """What every engine keeps: the config's limits and allowlist, the pipeline or model (built from the config
        when not given), the lock and the counters its stats report."""
        from ..config import build

        heap.limit_arenas()
        self.cfg = cfg
        self.limits = Limits.from_config(cfg)
        serve = cfg.serve or {}
        self.slots = serve.get("adapters_per_replica", 4)
        self.max_call = serve.get("max_call") or serve.get("max_batch", 8)  # images per pipeline call
        self.specs = {a.name: a for a in cfg.adapters}
        self.pipe = pipe if pipe is not None else build(replace(cfg, adapters=[]))
        self._lock = threading.RLock()  # ensure + call, and release, never interleave
        self.calls = 0  # pipeline calls (a batch of several shapes makes several)
        self.batches = 0  # batches handed to run_each (what Ray's or the bench's batcher gathered)
        self.loads = 0
        self.mixed = 0  # calls whose requests named different adapter sets: one per-prompt batch for all
        self.kinds: set[tuple[int, int, int]] = set()  # (images, distinct adapter sets, adapters) of every call so far
        self.oom_retries = 0  # calls that ran out of device memory and were run again one request at a time
        self.failed_loads = 0
        self.load_s = 0.0  # wall seconds spent loading adapters (files read, banks written)
        self.call_s = 0.0  # wall seconds inside pipeline calls
        self.paths: collections.Counter = collections.Counter()  # fused layers by dispatch path, over every call
        self.held: set[str] = set()  # adapters Ray's multiplexed LRU holds (hold / release)
        self.partners: dict[str, None] = {}  # other adapters of recent calls, least recently used first

    def _count(self, reqs: list, names: Sequence[str]) -> None:
        """A call's counters: every call, mixed ones, and the kinds of call (images, adapter sets, adapters)."""
        sets = {tuple(sorted(r.adapters)) for r in reqs}
        self.calls += 1
        self.mixed += len(sets) > 1
        self.kinds.add((len(reqs), len(sets), len(names)))

    # --- adapters ------------------------------------------------------------------------------
    def known(self) -> list[str]:
        names = getattr(self.pipe, "_fd_all_names", None)
        return list(names()) if names else []

    def ensure(self, names: Sequence[str]) -> None:
        """Load each allowed adapter not yet known to the pipeline (it stays in RAM until released)."""
        with self._lock:
            for name in names:
                if name in self.known():
                    continue
                spec = self.specs.get(name)
                if spec is None:
                    raise RequestError(422, "adapters: not an adapter this server offers")
                t = time.perf_counter()
                self._load(name, spec)
                self.load_s += time.perf_counter() - t
                self.loads += 1

    def _load(self, name: str, spec) -> None:
        self.pipe.load_fd_lora(spec.source, adapter_name=name, max_slots=self.slots, **spec.hub)

    def hold(self, name: str) -> None:
        """Load an adapter Ray's multiplexed LRU now holds (its requests route here); kept until `release`."""
        with self._lock:
            self.ensure([name])
            self.held.add(name)
            self.partners.pop(name, None)

    def release(self, name: str) -> None:
        """Forget an adapter (Ray's multiplexed LRU dropped it); a later request loads it again."""
        with self._lock:
            self.held.discard(name)
            self.partners.pop(name, None)
            if name in self.known():
                self._delete(name)

    def _delete(self, name: str) -> None:
        self.pipe.delete_adapters(name)

    def _arrange(self, names: Sequence[str]) -> None:
        """The call's adapters in slots in name order (fdlora.hub.pool.AdapterPool.arrange), in every component: a
        blend sums its adapters in that order, so a request's image does not depend on the slots its adapters
        landed in after earlier loads, evictions and releases."""
        from ..hub.pool import AdapterPool

        handles = getattr(self.pipe, "fd_lora_handles", None)
        for h in (handles() if handles else {}).values():
            AdapterPool.of(h).arrange(sorted(names))

    def _used(self, names: Sequence[str]) -> None:
        """After a call naming `names`: the ones Ray does not hold become the most recent partners; past
        `adapters_per_replica` partners, the least recently used go (a later request loads them again)."""
        for name in names:
            if name not in self.held:
                self.partners.pop(name, None)
                self.partners[name] = None
        while len(self.partners) > self.slots:
            old = next(iter(self.partners))
            del self.partners[old]
            if old in self.known():
                self._delete(old)

    # --- requests --------------------------------------------------------------------------------
    def run(self, requests: Sequence[ImageRequest]) -> list[bytes]:
        """PNG bytes per request; one pipeline call per group of requests sharing steps and size (split further
        only when a group names more distinct adapters than the pool has slots). Raises the first request's error."""
        out = self.run_each(requests)
        for o in out:
            if isinstance(o, RequestError):
                raise o
        return out

    def run_each(self, requests: Sequence[ImageRequest]) -> list:
        """`run`, with each request's own outcome: its output, or the RequestError that failed it alone."""
        out: dict[int, Any] = {}
        self.batches += 1
        for group in self.plan(requests):
            out.update(zip(group, self._outcomes([requests[i] for i in group])))
        return [out[i] for i in range(len(requests))]

    def _outcomes(self, reqs: list) -> list:
        with self._lock:
            broken = {}
            for name in sorted({n for r in reqs for n in r.adapters}):
                try:
                    self.ensure([name])
                except RequestError as e:
                    broken[name] = e
                except Exception as e:  # a file corrupted or removed since start-up: its requests fail, not the rest
                    log.warning("adapter %r failed to load: %s", name, e)
                    self.failed_loads += 1
                    broken[name] = RequestError(500, f"adapter {name!r} failed to load on this server (its file is "
                                                     "unreadable); requests without it are served")
            out: list[Any] = [next((broken[n] for n in sorted(r.adapters) if n in broken), None) for r in reqs]
            ok = [i for i, o in enumerate(out) if o is None]
            for i, o in zip(ok, self._fitting([reqs[i] for i in ok]) if ok else []):
                out[i] = o
        return out

    def _fitting(self, reqs: list) -> list:
        """The call's outputs; out of device memory, merged-weight copies cut (`_shrink_merge_cache`) and each request
        again alone, and a 507 for one that still fails with no copy left to drop."""
        import torch

        try:
            return self._call(reqs)
        except RequestError as e:
            return [e] * len(reqs)
        except torch.OutOfMemoryError:
            failure = None
        except Exception as e:  # a failure inside the pipeline: find the request it belongs to, serve the rest
            failure = type(e).__name__
            log.warning("pipeline call of %d request(s) failed: %s: %s", len(reqs), failure,
                        (str(e).splitlines() or [""])[0][:200])
        # handled here, outside the except clauses: the failed call's frames (and the activations they hold) are gone
        # before anything runs again
        if failure is not None:
            if len(reqs) > 1:
                return [o for r in reqs for o in self._fitting([r])]
            return [RequestError(500, f"generation failed on this server ({failure}); other requests are served")]
        fewer_copies = _shrink_merge_cache(self.pipe)
        _free_device_cache()
        if len(reqs) == 1 and fewer_copies:
            return self._fitting(reqs)
        if len(reqs) == 1:
            return [RequestError(507, f"out of device memory: this request alone needs more than the "
                                      f"{_memory_limit(self.pipe)} this server may use; ask for a smaller height "
                                      "and width")]
        self.oom_retries += 1
        return [o for r in reqs for o in self._fitting([r])]

    def plan(self, requests: Sequence[ImageRequest]) -> list[list[int]]:
        """The pipeline calls for a batch, as lists of request indices: requests of one shape share a call, packed
        first-fit in arrival order so that no call names more adapters than the pool has slots (a request naming
        more goes alone) or holds more than `max_call` requests. Calls needing fewer adapter loads run first: an
        adapter resident now serves its call before a later call evicts it, and what the last call loads stays for
        the next batch."""
        calls: list[tuple[tuple, set[str], list[int]]] = []  # (shape, adapters named, requests)
        for i, r in enumerate(requests):
            names = set(r.adapters)
            home = next((c for c in calls if c[0] == r.shape and len(c[1] | names) <= self.slots
                         and len(c[2]) < self.max_call), None)
            if home is None:
                calls.append((r.shape, names, [i]))
            else:
                home[1].update(names)
                home[2].append(i)
        order, resident = [], set(self.known())
        while calls:
            call = min(calls, key=lambda c: len(c[1] - resident))  # the first of equals: arrival order
            calls.remove(call)
            order.append(call[2])
            resident |= call[1]
        return order

    def _call(self, reqs: list[ImageRequest]) -> list[bytes]:
        import torch

        names = sorted({n for r in reqs for n in r.adapters})
        steps, h, w = reqs[0].shape
        kw: dict[str, Any] = dict(prompt=[r.prompt for r in reqs], num_inference_steps=steps, height=h, width=w,
                                  generator=[torch.Generator("cpu").manual_seed(r.seed) for r in reqs],
                                  output_type="pil")
        if any(r.negative_prompt for r in reqs):
            kw["negative_prompt"] = [r.negative_prompt or "" for r in reqs]
        if type(self.pipe).__name__.startswith(("Flux", "StableDiffusion3")) and self.cfg.base.startswith("tiny-"):
            kw["max_sequence_length"] = 32
        with self._lock:
            self.ensure(names)
            self._arrange(names)
            if self.known():  # always per prompt: a load activates its adapter, a request without any is the base
                kw["fd_lora_adapters"] = [dict(r.adapters) or None for r in reqs]
            t = time.perf_counter()
            try:
                with torch.inference_mode():
                    images = self.pipe(**kw).images
            except BaseException:
                _restore_dtypes(self.pipe, self._dtypes)
                raise
            finally:
                self.call_s += time.perf_counter() - t
            self._used(names)
            self.paths.update(dispatch_counts(_denoiser(self.pipe)))
            self._count(reqs, names)
        pngs = encode(images)
        del images
        heap.trim()  # after the images' host buffers are freed too, not only the call's
        heap.trim_later()  # and what the answers hold, once they are sent and the server is idle
        return pngs


def _denoiser(pipe):
    """The module that runs every step (its LoRA family's denoiser: a UNet or a transformer), whose fused layers'
    paths a call records."""
    from ..integrations.diffusers.family import family_of

    fam = family_of(pipe)
    return getattr(pipe, fam.denoiser) if fam is not None else pipe


def _uniform_dtypes(pipe) -> dict[str, Any]:
    """Each pipeline component whose floating-point parameters share one dtype, and that dtype."""
    out = {}
    for name, m in getattr(pipe, "components", {}).items():
        kinds = {p.dtype for p in getattr(m, "parameters", lambda: ())() if p.is_floating_point()}
        if len(kinds) == 1:
            out[name] = kinds.pop()
    return out


def _restore_dtypes(pipe, dtypes: dict[str, Any]) -> None:
    """After a call that failed midway: components a pipeline recast for the call (diffusers upcasts an fp16 SDXL
    VAE to fp32 for decoding and casts it back only when decoding returns) go back to their dtype, so the next call
    finds the pipeline as it was."""
    for name, dtype in dtypes.items():
        m = pipe.components.get(name)
        if m is not None and any(p.dtype != dtype for p in m.parameters() if p.is_floating_point()):
            log.warning("restoring %s to %s after a failed call", name, dtype)
            m.to(dtype=dtype)


def _shrink_merge_cache(pipe) -> bool:
    """After running out of device memory: drop the merged-weight copies on the pipeline's device and halve their
    budget (0 when they held under 2 GiB), so the call that is run again has the room the copies took; layers
    without a copy take the per-call paths. False when no copy could be dropped (the request itself is too large;
    copies a CUDA graph captured stay)."""
    from fdlora.layers.fastpath.merged import merge_cache_bytes, set_merge_cache

    dev = getattr(pipe, "device", None)
    held = merge_cache_bytes(dev) if dev is not None else 0
    if held <= 0:
        return False
    budget = held // 2 if held >= 2**31 else 0
    log.warning("out of device memory with %.1f GiB of merged-weight copies: copies dropped, their budget now "
                "%.1f GiB", held / 2**30, budget / 2**30)
    set_merge_cache(budget)
    return merge_cache_bytes(dev) < held


def _free_device_cache() -> None:
    """The failed call's tensors back to the device: reference cycles through its frames collected, then the
    caching allocator's free blocks released."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _memory_limit(pipe) -> str:
    """What an out-of-memory request exceeded: the CUDA device's memory times the process's allowed fraction."""
    import torch

    dev = getattr(pipe, "device", None)
    if dev is None or getattr(dev, "type", None) != "cuda":
        return "device memory"
    total = torch.cuda.get_device_properties(dev).total_memory * torch.cuda.get_per_process_memory_fraction(dev)
    return f"{total / 2**30:.1f} GiB of {torch.cuda.get_device_name(dev)}"


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def encode(images: Sequence[Any]) -> list[bytes]:
    """PNG bytes of a call's images, encoded side by side: Pillow's encoder releases the GIL, and a 1024² image from
    a diffusion model takes about 0.2 s of zlib, so a batch of 8 encoded one after another would hold the next call
    back by a second or more."""
    if len(images) < 2:
        return [png(im) for im in images]
    return list(_encoder().map(png, images))


@functools.cache
def _encoder() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="fdlora-png")


def json_body(image_png: bytes, request: ImageRequest, replica: str | None) -> dict[str, Any]:
    return {"image": base64.b64encode(image_png).decode(), "format": "png", "adapters": request.adapters,
            "seed": request.seed, "replica": replica}


class TextEngine(Engine):
    """A Transformers model (`model:` config): requests of the same prompt length and token budget run as one
    `generate(..., fd_lora_adapters=[one spec per row])`, greedy, no padding."""

    def __init__(self, cfg, model: Any = None) -> None:
        self._setup(cfg, model)
        self.vocab = int(self.pipe.get_input_embeddings().num_embeddings)

    def known(self) -> list[str]:
        from ..layers import registry_of_models

        h = registry_of_models.get(self.pipe)
        return list(h.list_adapters()) if h is not None else []

    def _load(self, name: str, spec) -> None:
        from fdlora.integrations.transformers import load_fd_lora

        load_fd_lora(self.pipe, spec.source, adapter_name=name, activate=False, **spec.hub)

    def _delete(self, name: str) -> None:
        from .. import api

        api.delete_adapter(self.pipe, name)

    def _call(self, reqs: list) -> list[list[int]]:
        import torch

        bad = [r for r in reqs if max(r.input_ids) >= self.vocab]
        if bad:
            raise RequestError(422, f"input_ids: token ids must be below the vocabulary size {self.vocab}")
        names = sorted({n for r in reqs for n in r.adapters})
        ids = torch.tensor([list(r.input_ids) for r in reqs], dtype=torch.long)
        eos = self.pipe.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        kw: dict[str, Any] = dict(attention_mask=torch.ones_like(ids), max_new_tokens=reqs[0].max_new_tokens,
                                  do_sample=False, pad_token_id=next(iter(eos), 0))
        with self._lock:
            self.ensure(names)
            if self.known():
                kw["fd_lora_adapters"] = [dict(r.adapters) or None for r in reqs]
            with torch.inference_mode():
                out = self.pipe.generate(ids, **kw)[:, ids.shape[1]:]
            self._used(names)
            self.paths.update(dispatch_counts(self.pipe))
            heap.trim()
            self._count(reqs, names)
        return [_until_eos(row.tolist(), eos) for row in out]


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
