"""The machinery of background loads (fdlora.integrations.prefetch says what they do and promise).

A `Prefetch` is the future a caller gets; `start` runs a job's read step on a daemon thread (at most
`MAX_READERS` at once; a pipeline job's file read and conversion run in the reader process,
fdlora.hub.worker), then its publish step under the target's lock (fdlora.runtime.scope.lock_of), unless it
was cancelled by then. Pending jobs are registered per pipeline or model, so that calls naming an adapter still
being prefetched say so (`unknown_error`) and deletes cancel it (`cancel_pending`). `pipeline_job` is the
pipeline's job: load_fd_lora's read step plus a side-stream device copy, then its attach step without
activation; everything per tensor or per module it does in this process happens in the publish step, while no
step runs (`_pipeline_steps`). Imports nothing of diffusers (the pipeline mixin imports this module).
"""

from __future__ import annotations

import inspect
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError
from typing import Any

import torch

from fdlora import env
from fdlora.errors import DuplicateAdapterError, FdLoraError, UnknownAdapterError
from fdlora.hub.load import PendingLoad, materialize_steps
from fdlora.hub.worker import MAX_WORKERS
from fdlora.runtime.scope import lock_of
from fdlora.steps import COMMIT, EVERY, drain

MAX_READERS = MAX_WORKERS  # prefetches reading at once (each holds its adapter's bytes): a reader process each
SLICE_S = 0.0015  # the longest a publication in pieces holds the pipeline's lock before letting a step run
PAUSE_S = 0.0002  # its pause between holds, so that a step blocked on the lock gets it first
_readers = threading.BoundedSemaphore(MAX_READERS)
_pending: weakref.WeakKeyDictionary[Any, dict[str, Prefetch]] = weakref.WeakKeyDictionary()
_registry = threading.Lock()
_streams: dict[torch.device, torch.cuda.Stream] = {}
_count = iter(range(1 << 62))


class _Cancelled(Exception):
    pass


class Prefetch:
    """A background load (a future): `done()`, `result(timeout)`, `exception(timeout)`, `cancel()`; `stage` says
    where it is ("queued"; "reading": resolve, read, convert and on CUDA the side-stream copy; "waiting for the
    pipeline"; "publishing"; then "done", "failed" or "cancelled"), `seconds` how long each stage took and
    `cpu_seconds` how much of that the prefetch's thread spent on a CPU (its own Python and C++, not the reader
    process's or a copy engine's: what it may take from the serving thread), `slices` the seconds of each hold of
    the pipeline's lock while publishing (a pipeline's publication holds it in pieces, see `_publish`)."""

    def __init__(self, name: str, source: Any) -> None:
        self.name = name
        self.source = source if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__") else "<in memory>"
        self.stage = "queued"
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self._cpu: float | None = None  # the job thread's CPU clock at its last stage change
        self._done = threading.Event()
        self._state = threading.Lock()
        self._cancelled = self._publishing = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Prefetch], Any]] = []
        self.slices: list[float] = []  # seconds of each hold of the pipeline's lock while publishing
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

    def _account(self) -> None:
        """Add the wall time since the last stage change to the current stage, and the job thread's CPU time (its
        clock starts at the first stage change on that thread; a finish from another thread adds none)."""
        now, cpu = time.perf_counter(), time.thread_time()
        self.seconds[self.stage] = self.seconds.get(self.stage, 0.0) + now - self._t
        if self._cpu is not None:
            self.cpu_seconds[self.stage] = self.cpu_seconds.get(self.stage, 0.0) + cpu - self._cpu
        self._t, self._cpu = now, cpu

    def _step(self, stage: str) -> None:
        self._account()
        self.stage = stage
        if self._cancelled:
            raise _Cancelled

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        with self._state:
            self._result, self._error = result, error
            self._account()
            self.stage = "cancelled" if self._cancelled else "failed" if error is not None else "done"
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def __repr__(self) -> str:
        return f"Prefetch({self.name!r}, source={self.source!r}, stage={self.stage!r})"


# --- registry of pending jobs ------------------------------------------------------------------------------------
def pending(obj: Any) -> dict[str, Prefetch]:
    """Prefetches of `obj` (a pipeline or a model) not finished yet, by adapter name."""
    with _registry:
        return {n: j for n, j in _pending.get(getattr(obj, "_orig_mod", obj), {}).items() if not j.done()}


def unknown_error(obj: Any, unknown: list[str], loaded: set[str] | list[str],
                  lead: str = "adapter(s) {} are not loaded") -> UnknownAdapterError:
    """The UnknownAdapterError for names that are not loaded (`lead` formatted with them), saying which of them are
    still being prefetched."""
    jobs = pending(obj)
    busy = [n for n in unknown if n in jobs]
    msg = f"{lead.format(unknown)} (loaded: {sorted(loaded)})."
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


# --- jobs -------------------------------------------------------------------------------------------------------
def pipeline_job(pipe: Any, source: Any, name: str | None, kwargs: dict[str, Any], key: Any = None) -> Prefetch:
    """`pipe.prefetch_fd_lora(source, name, **kwargs)`, registered under `key` (default: the pipe; the model for a
    one-model holder, fdlora.integrations.diffusers.model)."""
    check_kwargs(kwargs)
    return start(pipe if key is None else key, pipe, name, source, *_pipeline_steps(pipe, source, kwargs))


def check_kwargs(kwargs: dict[str, Any]) -> None:
    if kwargs.pop("activate", False):
        raise FdLoraError("a prefetch never activates its adapter (calls running meanwhile keep theirs); call "
                          "set_adapters (or pass fd_lora_adapters=...) once the prefetch's .result() returned.")


def _pipeline_steps(pipe: Any, source: Any, kwargs: dict[str, Any]):
    """(read, publish) for a pipeline (or a one-model holder): load_fd_lora's read step, a side-stream copy,
    then its attach step without activation.

    With the reader process, the read step returns before any per-tensor work in this process (fdlora.hub.load
    `deferred`): the tensors arrive in one host block, go to each CUDA device in one copy and are checked for
    NaN/Inf in one pass over it; the adapter objects are built at publication, between two steps."""
    attach_kw = {k: kwargs.pop(k) for k in ("max_slots", "max_rank", "validate", "targets", "load_into_transformer_2")
                 if k in kwargs}
    strict = kwargs.pop("strict", False)
    t2 = attach_kw.get("load_into_transformer_2", False)
    validate = attach_kw.get("validate", True)

    def read(name):
        here = env.prefetch_reader() == "thread"
        adapters, report = pipe._fd_read(source, strict=strict, in_process=here, deferred=not here, **kwargs)
        modules = pipe._fd_modules()
        devices = {c: _device_of(modules.get("transformer_2" if t2 and c == "transformer" else c)) for c in adapters}
        if isinstance(report, PendingLoad):
            staged, finite = _stage_block(report.packed, devices, validate)
            return (adapters, report, finite), staged
        adapters, staged = _stage(adapters, devices, validate)
        return (adapters, report, False), staged

    def publish(payload, staged, name):  # in pieces (fdlora.steps): see `_publish`
        adapters, report, finite = payload
        adapters, report = yield from materialize_steps(adapters, report, finite=finite, every=EVERY * 2)
        yield
        if t2:
            staged = {("transformer_2" if c == "transformer" else c): s for c, s in staged.items()}
        return (yield from pipe._fd_attach_steps(adapters, report, name, strict=strict, activate=False, staged=staged,
                                                 every=EVERY, **attach_kw))

    return read, publish


def start(key: Any, target: Any, name: str | None, source: Any, read, publish) -> Prefetch:
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
    threading.Thread(target=_run, args=(job, key, lock_of(target), read, publish, torch.is_inference_mode_enabled()),
                     daemon=True, name=f"fdlora-prefetch-{name}").start()
    return job


def _run(job: Prefetch, key: Any, lock, read, publish, inference: bool) -> None:
    with torch.inference_mode(inference):  # the caller's mode: tensors made here are as its own would be, and those
        _job(job, key, lock, read, publish)  # made under inference_mode (a scale table) can be written


def _job(job: Prefetch, key: Any, lock, read, publish) -> None:
    staged: Mapping[str, Any] = {}
    try:
        with _readers:
            job._step("reading")
            payload, staged = read(job.name)
        job._step("waiting for the pipeline")
        result = _publish(job, lock, publish, payload, staged)
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


def _publish(job: Prefetch, lock, publish, payload: Any, staged: Mapping[str, Any]) -> Any:
    """Run `publish` under `lock`: at once, or, for a publication in pieces (a generator, fdlora.steps),
    piece after piece for up to SLICE_S at a time, letting go of the lock between them (a step waiting for it runs
    then), and from COMMIT to the end at once. Cancellable until COMMIT; `job.slices` gets each hold's seconds."""
    pieces = inspect.isgeneratorfunction(publish)
    work = None
    try:
        while True:
            with lock:
                with job._state:
                    if job._cancelled:
                        raise _Cancelled
                    job._publishing = not pieces
                t = time.perf_counter()
                if work is None:
                    job._step("publishing")
                    work = publish(payload, staged, job.name)
                    if not pieces:
                        return work
                try:
                    now, last = t, 0.0
                    while now == t or now - t + last <= SLICE_S:  # (one piece at least; none that would overrun)
                        mark = next(work)
                        last = time.perf_counter() - now
                        now += last
                        if mark is COMMIT:
                            with job._state:
                                if job._cancelled:
                                    raise _Cancelled
                                job._publishing = True
                            return drain(work)
                except StopIteration as done:
                    return done.value
                finally:
                    job.slices.append(time.perf_counter() - t)
            time.sleep(PAUSE_S)  # (a step blocked on the lock takes it now; without one, the next piece goes on)
    finally:
        if work is not None and pieces:
            work.close()  # (cancelled or failed before COMMIT: nothing was changed; after it: a no-op)


# --- the side-stream copy -------------------------------------------------------------------------------------
def _stage_block(packed: Any, devices: Mapping[str, torch.device | None],
                 check_finite: bool) -> tuple[dict[str, Any], bool]:
    """({component: its device copy}, whether every adapter tensor is finite) for a reader-process result: per CUDA
    device one copy of the whole block on a side stream, and with `check_finite` one fp32 sum per dtype run of
    the adapters' tensors on the first device copy (a NaN or Inf anywhere makes it non-finite;
    fdlora.hub.adapter._finite says why finite half-precision values cannot). A few ops in all, waited for on
    this thread only. False also means "not settled here" (a hit, maybe the sum of large finite bf16 / fp32 values
    overflowing; no CUDA component): publication then checks every tensor, as load_fd_lora does."""
    from fdlora.hub.cache import Staged

    host = packed.tensor
    cuda = sorted({d for d in devices.values() if d is not None and d.type == "cuda"}, key=str)
    flats, waits, ok, finite = {}, [], None, False
    try:
        for d in cuda:
            side = _side_stream(d)
            with torch.cuda.stream(side):
                flats[d] = host.to(d, non_blocking=packed.block.pinned)
                if check_finite and ok is None:
                    ok = (_all_finite(flats[d], packed.groups), side)
                ev = torch.cuda.Event(blocking=True)  # (its waiter sleeps instead of spinning a core)
                ev.record(side)
                waits.append(ev)
    finally:
        for ev in waits:
            ev.synchronize()  # (releases the GIL; the serving thread's stream never waits on this)
    if ok is not None:
        with torch.cuda.stream(ok[1]):  # (read back on the side stream: the default one may be busy with steps)
            finite = bool(ok[0])
    start = host.data_ptr()
    return {c: Staged(flats[d], start) for c, d in devices.items() if d in flats}, finite


def _all_finite(flat: torch.Tensor, groups: list[tuple[str, int, int]]) -> torch.Tensor:
    sums = [flat[o:o + n].view(getattr(torch, dtype)).sum(dtype=torch.float32) for dtype, o, n in groups]
    return torch.stack(sums).isfinite().all() if sums else torch.ones((), dtype=torch.bool)


def _stage(adapters: dict[str, Any], devices: Mapping[str, torch.device | None],
           check_finite: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapters packed in page-locked memory, their device copies) for components on CUDA, for adapters built in
    this process (a RAM-cache hit, an in-memory source, FDLORA_PREFETCH_READER=thread): one H2D transfer each on
    a side stream (NaN-checked on the device with `check_finite`), waited for on this thread only."""
    from fdlora.hub.adapter import LoraAdapter
    from fdlora.hub.cache import pack_adapters, packed_pinned, stage

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
            ev = torch.cuda.Event(blocking=True)
            ev.record(side)
        if s is not None:
            staged[c] = s
            events.append(ev)
    for ev in events:
        ev.synchronize()
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
