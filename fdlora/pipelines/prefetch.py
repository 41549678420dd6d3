"""`pipe.prefetch_fd_lora(source, name)`: load an adapter in the background while the pipeline keeps serving.

    job = pipe.prefetch_fd_lora("user/pixel-style", adapter_name="pixel")   # returns at once
    images = pipe("a castle").images                   # generations go on meanwhile, with their own adapters
    job.result()                                       # the load report; raises the load's error
    pipe.set_adapters(["pixel"])                       # or pipe(..., fd_lora_adapters=["pixel"])

How it overlaps. A background thread does everything that does not touch the model: resolve, read (into
page-locked memory on CUDA), convert, check the format; on CUDA it then copies the packed adapter to the
device on a side stream into one staging buffer (NaN-checked there, fdlora.hub.cache.stage) and waits for that
copy's event. Only then does it take the lock a generation holds from start to end
(fdlora.pipelines.scope.lock_of) and run the attach step of `load_fd_lora`: shapes checked against the
model, room made, the banks written from the staged copy in one device-to-device launch (fdlora.layers.bulk),
the name registered. So a generation in flight never sees a half-written slot and never waits on the file or
the PCIe transfer; what runs on the serving stream is that one device-to-device write (~0.1 ms for 225 MB on
an H100). The adapter is usable from the first call that starts after publication.

Why a staging buffer and not the bank rows themselves on the side stream: writing bank rows before
publication means holding a free slot meanwhile, and taking a slot (evicting, if the pool is full) needs the
lock, which a running generation holds for its whole length: the copy would start only after the current
generation and publish after the next one. Staging costs, for a moment, one device buffer of the adapter's size.

Semantics (what differs from `load_fd_lora`):
- The active adapters do not change (steps running meanwhile keep theirs): activate the adapter with
  `set_adapters` or use it per prompt once `.result()` returned. Room is made as for a load that does not
  activate: the least recently used *inactive* adapter is evicted (fdlora.hub.pool); if every slot holds an
  active adapter, `.result()` raises CapacityError.
- A name still being prefetched is not loaded: `set_adapters`, per-prompt `fd_lora_adapters` and the like raise
  UnknownAdapterError naming the prefetch and `.result()`. They do not wait: they hold the pipeline's lock,
  which the publication needs, and a call that silently waits on a file read is what prefetching avoids.
- `delete_adapters(name)` of a name being prefetched cancels it; `unload_lora_weights()` cancels every pending
  prefetch. `job.cancel()` is True while the adapter is not published yet; it is then never published.
- `.result()` raises exactly the error `load_fd_lora` would have raised, and the model is unchanged (the attach
  step is load_fd_lora's own, all or nothing).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError
from typing import Any

import torch

from ..errors import DuplicateAdapterError, FdLoraError, UnknownAdapterError
from .scope import lock_of

MAX_READERS = 2  # prefetches reading / converting at once: each holds its adapter's bytes, and the GIL in turns
_readers = threading.BoundedSemaphore(MAX_READERS)
_pending: weakref.WeakKeyDictionary[Any, dict[str, Prefetch]] = weakref.WeakKeyDictionary()
_registry = threading.Lock()
_streams: dict[torch.device, torch.cuda.Stream] = {}
_count = iter(range(1 << 62))


class _Cancelled(Exception):
    pass


class Prefetch:
    """A background load (a future): `done()`, `result(timeout)`, `exception(timeout)`, `cancel()`; `stage` says
    where it is ("queued", "reading", "copying", "waiting for the pipeline", "publishing", "done") and `seconds`
    how long each stage took."""

    def __init__(self, name: str, source: Any) -> None:
        self.name = name
        self.source = source if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__") else "<in memory>"
        self.stage = "queued"
        self.seconds: dict[str, float] = {}
        self._done = threading.Event()
        self._state = threading.Lock()
        self._cancelled = self._publishing = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Prefetch], Any]] = []
        self._t = time.perf_counter()

    def done(self) -> bool:
        return self._done.is_set()

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> bool:
        """Stop before publication: True if the adapter will never be published (now or already cancelled),
        False if it is published, being published, or failed."""
        with self._state:
            if self._cancelled:
                return True
            if self._publishing or self._done.is_set():
                return False
            self._cancelled = True
            return True

    def result(self, timeout: float | None = None) -> Any:
        """The load report (as `load_fd_lora` returns it), once published; raises the load's error, or
        CancelledError, or TimeoutError after `timeout` seconds."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the prefetch of {self.name!r} is not done after {timeout} s (stage: {self.stage}).")
        if self._cancelled:
            raise CancelledError(f"the prefetch of {self.name!r} was cancelled; nothing was loaded.")
        return self._error

    def add_done_callback(self, fn: Callable[[Prefetch], Any]) -> None:
        with self._state:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _step(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[self.stage] = self.seconds.get(self.stage, 0.0) + now - self._t
        self.stage, self._t = stage, now
        if self._cancelled:
            raise _Cancelled

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        with self._state:
            self._result, self._error = result, error
            self.seconds[self.stage] = self.seconds.get(self.stage, 0.0) + time.perf_counter() - self._t
            self.stage = "cancelled" if self._cancelled else "failed" if error is not None else "done"
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def __repr__(self) -> str:
        return f"Prefetch({self.name!r}, source={self.source!r}, stage={self.stage!r})"


# --- entry points ---------------------------------------------------------------------------------------------
def prefetch(obj: Any, source: Any, adapter_name: str | None = None, **kwargs: Any) -> Prefetch:
    """Start loading `source` into `obj` in the background; returns a `Prefetch` at once.

    `obj`: a diffusers pipeline (as `pipe.prefetch_fd_lora`), a diffusers model (as `fdlora.load_fd_lora(model,
    ...)`: its `family` / `prefix` keywords too) or a Transformers model (a PEFT adapter, as the Transformers
    `load_fd_lora`; there the weights are read off the lock and written under it, without a side stream).
    Keywords are the matching `load_fd_lora`'s; the adapter is never activated (see the module docstring).
    """
    from .diffusers.model import is_diffusers_model
    from .diffusers.pipeline import FdLoraPipelineMixin, enable_fd_lora

    if kwargs.pop("activate", False):
        raise FdLoraError("a prefetch never activates its adapter (calls running meanwhile keep theirs); call "
                          "set_adapters (or pass fd_lora_adapters=...) once the prefetch's .result() returned.")

    if isinstance(obj, FdLoraPipelineMixin) or hasattr(obj, "components") and hasattr(obj, "load_fd_lora"):
        pipe = enable_fd_lora(obj)
        return _start(pipe, pipe, adapter_name, source, *_pipeline_steps(pipe, source, kwargs))
    base = getattr(obj, "_orig_mod", obj)
    if is_diffusers_model(base):
        from .diffusers.family import family_of, family_of_model
        from .diffusers.model import _ModelHolder

        family, prefix = kwargs.pop("family", None), kwargs.pop("prefix", None)
        fam = family_of(family) if family is not None else family_of_model(base)
        comp = prefix or (fam.denoiser if fam is not None else
                          "unet" if type(base).__name__.startswith("UNet") else "transformer")
        holder = _ModelHolder(comp, obj, fam)
        return _start(base, holder, adapter_name, source, *_pipeline_steps(holder, source, kwargs))
    return _start(base, base, adapter_name or "default", source, *_transformers_steps(base, source, kwargs))


def pending(obj: Any) -> dict[str, Prefetch]:
    """Prefetches of `obj` (a pipeline or a model) not finished yet, by adapter name."""
    with _registry:
        return {n: j for n, j in _pending.get(getattr(obj, "_orig_mod", obj), {}).items() if not j.done()}


def unknown_error(obj: Any, unknown: list[str], loaded: set[str] | list[str]) -> UnknownAdapterError:
    """The UnknownAdapterError for names that are not loaded, saying which of them are still being prefetched."""
    jobs = pending(obj)
    busy = [n for n in unknown if n in jobs]
    msg = f"adapter(s) {unknown} are not loaded (loaded: {sorted(loaded)})."
    if busy:
        msg += (f" {busy} {'are' if len(busy) > 1 else 'is'} still being prefetched (pipe.prefetch_fd_lora): wait "
                "for the prefetch's .result() first, outside any generation (publication needs the pipeline's lock).")
    return UnknownAdapterError(msg)


def cancel_pending(obj: Any, names: list[str]) -> list[str]:
    """Cancel the prefetches of `names` that are not published yet; returns the names left to delete as loaded
    adapters (those not being prefetched, or published already)."""
    jobs = pending(obj)
    return [n for n in names if not (n in jobs and jobs[n].cancel())]


def cancel_all(obj: Any) -> None:
    for job in pending(obj).values():
        job.cancel()


# --- the two kinds of target ----------------------------------------------------------------------------------
def _pipeline_steps(pipe: Any, source: Any, kwargs: dict[str, Any]):
    """(read, publish) for a pipeline (or a one-model holder): load_fd_lora's read step, a side-stream copy,
    then its attach step without activation."""
    attach_kw = {k: kwargs.pop(k) for k in ("max_slots", "max_rank", "validate", "targets", "load_into_transformer_2")
                 if k in kwargs}
    strict = kwargs.pop("strict", False)
    t2 = attach_kw.get("load_into_transformer_2", False)

    def read(name):
        adapters, report = pipe._fd_read(source, strict=strict, **kwargs)
        modules = pipe._fd_modules()
        devices = {c: _device_of(modules.get("transformer_2" if t2 and c == "transformer" else c)) for c in adapters}
        adapters, staged = _stage(adapters, devices, attach_kw.get("validate", True))
        return (adapters, report), staged

    def publish(payload, staged, name):
        adapters, report = payload
        if t2:
            staged = {("transformer_2" if c == "transformer" else c): s for c, s in staged.items()}
        return pipe._fd_attach(adapters, report, name, strict=strict, activate=False, staged=staged, **attach_kw)

    return read, publish


def _transformers_steps(model: Any, source: Any, kwargs: dict[str, Any]):
    from .transformers.attach import attach
    from .transformers.model import enable
    from .transformers.quantized import check_quantized
    from .transformers.read import read as read_peft

    def read(name):
        check_quantized(model)
        return read_peft(model, source, name, **kwargs), {}

    def publish(load, staged, name):
        attach(model, [(name, load)], activate=None)
        enable(model)
        return model

    return read, publish


def _start(key: Any, target: Any, name: str | None, source: Any, read, publish) -> Prefetch:
    name = name if name is not None else f"prefetch_{next(_count)}"
    job = Prefetch(name, source)
    with _registry:
        jobs = _pending.setdefault(key, {})
        old = jobs.get(name)
        if old is not None and not old.done():
            job._finish(error=DuplicateAdapterError(f"an adapter named {name!r} is already being prefetched; wait "
                                                    "for that prefetch's .result() or cancel() it first."))
            return job
        jobs[name] = job
    threading.Thread(target=_run, args=(job, key, lock_of(target), read, publish), daemon=True,
                     name=f"fdlora-prefetch-{name}").start()
    return job


def _run(job: Prefetch, key: Any, lock, read, publish) -> None:
    staged: Mapping[str, Any] = {}
    try:
        with _readers:
            job._step("reading")
            payload, staged = read(job.name)
        job._step("waiting for the pipeline")
        with lock:
            with job._state:
                if job._cancelled:
                    raise _Cancelled
                job._publishing = True
            job._step("publishing")
            result = publish(payload, staged, job.name)
        for s in staged.values():  # the write launched on this thread's stream reads the staging buffer, which
            s.flat.record_stream(torch.cuda.current_stream(s.flat.device))  # the side stream's pool must not reuse yet
        job._finish(result)
    except _Cancelled:
        job._finish()
    except BaseException as e:  # the load's own error, for .result(); nothing was published
        job._finish(error=e)
    finally:
        with _registry:
            jobs = _pending.get(key, {})
            if jobs.get(job.name) is job:
                del jobs[job.name]


# --- the side-stream copy -------------------------------------------------------------------------------------
def _stage(adapters: dict[str, Any], devices: Mapping[str, torch.device | None],
           check_finite: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapters packed in page-locked memory, their device copies) for components on CUDA: one H2D transfer
    each on a side stream (NaN-checked on the device with `check_finite`), waited for on this thread only."""
    from ..hub.adapter import LoraAdapter
    from ..hub.cache import pack_adapters, packed_pinned, stage

    cuda = {c for c, d in devices.items()
            if d is not None and d.type == "cuda" and isinstance(adapters[c], LoraAdapter)}
    if not cuda:
        return adapters, {}
    adapters = dict(adapters)
    staged, events = {}, []
    for c in sorted(cuda):
        if not packed_pinned(adapters[c]):
            adapters[c] = pack_adapters({"": adapters[c]})[""]
        side = _side_stream(devices[c])
        with torch.cuda.stream(side):
            s = stage(adapters[c], devices[c], check_finite=check_finite)
            ev = torch.cuda.Event()
            ev.record(side)
        if s is not None:
            staged[c] = s
            events.append(ev)
    for ev in events:
        ev.synchronize()  # (releases the GIL; the serving thread's stream never waits on this)
    return adapters, staged


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    device = torch.device(device)
    with _registry:
        s = _streams.get(device)
        if s is None:
            s = _streams[device] = torch.cuda.Stream(device)
    return s


def _device_of(model: Any) -> torch.device | None:
    p = next(model.parameters(), None) if model is not None else None
    return None if p is None else p.device
