"""The reader process: a background load's read and conversion run in another Python, off the serving thread's GIL.

Why: an eager step of a full-size model is host-bound, and the Python thread that issues it releases the GIL at
every torch op. A background thread reading and converting an adapter (safetensors' per-tensor reads, the
format's key mapping, ~2,000 small Python objects for an SDXL LoRA) takes the GIL at each of those releases and
keeps it until its own next release, so the serving thread waits in turns: on an H100 host an SDXL step took 2.15x
its idle time while a 170 MB adapter was prefetched (benchmarks/results/nvidia-h100-80gb-hbm3/prefetch.json), and
a CPU proxy of the same (benchmarks/probes/probe_prefetch_gil.py) shows 2x. In a separate process that work
takes no GIL of ours. What comes back is one packed file of tensor bytes (read here into one buffer, page-locked
with CUDA, by `safefile.read_into`'s threads, which release the GIL) plus a small index; rebuilding the adapter
objects over views of that buffer is the only Python work left on this side.

    adapters, report = run(build_adapters, resolved, page_locked=True, **options)  # as build_adapters(...) here

The process is started on first use (`start()` does it ahead of time: fdlora.pipelines.warmup calls it), is reused
by later loads (at most `MAX_WORKERS` at once), sees no GPU (`CUDA_VISIBLE_DEVICES` empty: it never makes a CUDA
context) and exits when this process closes its pipe. Its errors are raised here as they would be in-process;
if it dies, the load raises FdLoraError saying so and the next load starts a fresh one. `FDLORA_PREFETCH_READER
=thread` keeps background reads in this process instead (fdlora.env.prefetch_reader).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import pickle
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from ..errors import FdLoraError
from .adapter import LoraAdapter, ModuleLora
from .cache import ALIGN, known_span
from .safefile import read_into

MAX_WORKERS = 2  # reader processes at once; also how many prefetches read at once (pipelines.background)
TENSOR_FIELDS = ("A", "B", "bias", "magnitude")
PRELOAD = ("fdlora.hub.load", "peft", "diffusers.loaders.lora_pipeline", "diffusers.loaders.lora_conversion_utils")
_idle: list[_Worker] = []
_started: list[_Worker] = []
_lock = threading.Lock()
_slots = threading.BoundedSemaphore(MAX_WORKERS)
_count = itertools.count()


def run(fn: Callable[..., Any], *args: Any, page_locked: bool, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` run in a reader process (`fn` module-level: it is sent by name) and its result back.
    Tensors in the result, loose or in LoraAdapters, within dicts, lists and tuples, come back as views into one
    host buffer (page-locked with `page_locked` where CUDA is), an adapter's own tensors in one span of it, ready
    for one device transfer (fdlora.hub.cache.stage); everything else in the result is pickled."""
    path = os.path.join(_blob_dir(), f"fdlora-read-{os.getpid()}-{next(_count)}.bin")
    try:
        with _slots:
            worker = _take()
            try:
                skeleton, loose, size = worker.call(dict(fn=fn, args=args, kwargs=kwargs, path=path))
            except BaseException:
                worker.close()  # a worker interrupted mid-answer is not reused
                raise
            _give_back(worker)
        return _Unpacker(path, size, page_locked, loose).tree(skeleton)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def start() -> None:
    """Start one reader process now, if none is running (its imports take a few seconds, off this thread's GIL)."""
    with _lock:
        if _idle or _started:
            return
    _give_back(_Worker())


# --- this side ---------------------------------------------------------------------------------------------------
class _Worker:
    """One reader process and the two pipes to it."""

    def __init__(self) -> None:
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="",  # read and convert on the CPU: no CUDA context there
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the same fdlora and packages as here
        preload = [m for m in PRELOAD if m in sys.modules]  # what a load imports, where this process has it
        code = f"from fdlora.hub.worker import serve; serve({to_child}, {from_child}, {preload!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(to_child, from_child), env=env,
                                     stdin=subprocess.DEVNULL, close_fds=True)
        os.close(to_child)
        os.close(from_child)
        self.send, self.recv = Connection(from_parent, readable=False), Connection(to_parent, writable=False)
        with _lock:
            _started.append(self)

    def call(self, request: dict[str, Any]) -> Any:
        try:
            self.send.send(request)
            status, payload = self.recv.recv()  # (waits in the OS, without the GIL)
        except (EOFError, OSError) as e:
            try:
                why = f"exit code {self.proc.wait(timeout=5)}"  # (its pipe closed: it is ending, or has ended)
            except subprocess.TimeoutExpired:
                why = repr(e)
            raise FdLoraError(f"fd-lora's reader process ended while reading ({why}); nothing was loaded. Load again "
                              "(a new reader starts), or set FDLORA_PREFETCH_READER=thread to read in this "
                              "process.") from None
        if status == "error":
            raise payload
        return payload

    def close(self) -> None:
        with _lock:
            if self in _started:
                _started.remove(self)
        for c in (self.send, self.recv):
            c.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _take() -> _Worker:
    with _lock:
        while _idle:
            w = _idle.pop()
            if w.proc.poll() is None:
                return w
            _started.remove(w)
    return _Worker()


def _give_back(worker: _Worker) -> None:
    with _lock:
        _idle.append(worker)


@atexit.register
def _close_all() -> None:
    for w in list(_started):
        w.close()


def _blob_dir() -> str:
    """Where the reader process leaves the packed bytes: RAM-backed /dev/shm where it can, else the temp dir."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


class _Loose(tuple):
    """(index,): a tensor of the result outside any adapter, by its place in the result (the loose tensors' groups
    and their positions there come beside the skeleton)."""


class _Adapter(tuple):
    """(use_rslora, name, provenance, modules, groups, (first byte, end byte)) of a packed LoraAdapter; a module's
    tensors are referred to by their position in the adapter's groups."""


class _Unpacker:
    """Reads the packed file into one buffer and rebuilds the result over views into it: per dtype group, one split
    of the buffer into every tensor of the group (a few C++ calls, not a Python slice per tensor); modules without
    checking them again (their constructor ran in the reader process) and adapters with their span given."""

    def __init__(self, path: str, size: int, page_locked: bool, loose: tuple[list[tuple], list[int]]) -> None:
        self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=page_locked and torch.cuda.is_available())
        if read_into(path, self.buf) != size:
            raise FdLoraError(f"{path}: the reader process's output is shorter than it said; load again.")
        groups, positions = loose
        written = self.tensors(groups)
        self.loose = [written[p] for p in positions]

    def tensors(self, groups: list[tuple]) -> list[torch.Tensor]:
        out = []
        for dtype_name, offset, numels, shapes in groups:
            dtype = getattr(torch, dtype_name)
            whole = self.buf[offset:offset + sum(numels) * dtype.itemsize].view(dtype)
            out += [t.view(shape) for t, shape in zip(whole.split(numels), shapes)]
        return out

    def tree(self, obj: Any) -> Any:
        if type(obj) is _Loose:
            return self.loose[obj[0]]
        if type(obj) is _Adapter:
            return self.adapter(*obj)
        if type(obj) is dict:
            return {k: self.tree(v) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(self.tree(v) for v in obj)
        return obj

    def adapter(self, use_rslora, name, provenance, modules, groups, span) -> LoraAdapter:
        tensors = self.tensors(groups)
        mods = {p: ModuleLora.checked({**fields, **{f: None if i is None else tensors[i]
                                                    for f, i in zip(TENSOR_FIELDS, refs)}})
                for p, (refs, fields) in modules.items()}
        base = self.buf.data_ptr()
        return known_span(LoraAdapter(mods, use_rslora, name, provenance), (base, base + span[0], base + span[1]))


# --- the reader process -----------------------------------------------------------------------------------------
def serve(rfd: int, wfd: int, preload: list[str] = ()) -> None:
    """The reader process's loop: a request in, (status, payload) out, until the other side closes the pipe.
    `preload`: modules the conversions import, imported before the first request (seconds for peft, diffusers)."""
    import importlib

    for name in preload:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    recv, send = Connection(rfd, writable=False), Connection(wfd, readable=False)
    torch.set_num_threads(1)  # small conversions: one core is plenty, and the serving process keeps the others
    with contextlib.suppress(OSError):
        os.nice(10)  # where cores are few, the scheduler prefers the serving process
    while True:
        try:
            request = recv.recv()
        except (EOFError, OSError):
            return
        try:
            payload = ("ok", _run_packed(**request))
        except BaseException as e:  # the load's own error, raised on the other side
            payload = ("error", _sendable(e))
        try:
            send.send(payload)
        except (BrokenPipeError, OSError):
            return


def _run_packed(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], path: str) -> tuple[Any, tuple, int]:
    """(the result's skeleton, its loose tensors' (groups, positions), the file's bytes)."""
    with open(path, "wb") as f:
        packer = _Packer(f)
        skeleton = packer.tree(fn(*args, **kwargs))
        return skeleton, packer.groups(packer.loose), packer.offset


class _Packer:
    """Writes the tensors of a result to a file: each LoraAdapter's in one span (per dtype, back to back, each
    group ALIGN-ed), the loose ones last, grouped the same way; `tree` returns the result with placeholders."""

    def __init__(self, f) -> None:
        self.f, self.offset = f, 0
        self.loose: list[torch.Tensor] = []

    def write(self, data) -> None:
        view = memoryview(data)
        self.f.write(view)
        self.offset += view.nbytes

    def groups(self, tensors: list[torch.Tensor]) -> tuple[list[tuple], list[int]]:
        """Write `tensors` grouped by dtype (first seen first, each group in the given order); ((dtype, offset,
        numels, shapes) per group, each tensor's position in the written order)."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        out, positions, n = [], [0] * len(tensors), 0
        for dtype, items in by_dtype.items():
            self.write(bytes(-self.offset % ALIGN))
            out.append((str(dtype).removeprefix("torch."), self.offset, [tensors[i].numel() for i in items],
                        [tuple(tensors[i].shape) for i in items]))
            for i in items:
                self.write(tensors[i].detach().contiguous().reshape(-1).view(torch.uint8).numpy())
                positions[i], n = n, n + 1
        return out, positions

    def tree(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.loose.append(obj)
            return _Loose((len(self.loose) - 1,))
        if isinstance(obj, LoraAdapter):
            return self.adapter(obj)
        if type(obj) is dict:
            return {k: self.tree(v) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(self.tree(v) for v in obj)
        return obj

    def adapter(self, a: LoraAdapter) -> _Adapter:
        where = [(p, i, getattr(m, f)) for p, m in a.modules.items() for i, f in enumerate(TENSOR_FIELDS)
                 if getattr(m, f) is not None]
        start = self.offset
        groups, positions = self.groups([t for *_, t in where])
        refs = {(p, i): n for (p, i, _), n in zip(where, positions)}
        modules = {p: (tuple(refs.get((p, i)) for i in range(len(TENSOR_FIELDS))),
                       {k: v for k, v in vars(m).items() if k not in TENSOR_FIELDS})
                   for p, m in a.modules.items()}
        return _Adapter((a.use_rslora, a.name, a.provenance, modules, groups, (start, self.offset)))


def _sendable(e: BaseException) -> BaseException:
    """`e` if it pickles and unpickles as itself, else an FdLoraError with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return FdLoraError(f"{type(e).__name__}: {e}")
