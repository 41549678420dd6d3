"""The reader process: a background load's read and conversion run in another Python, off the serving thread's GIL.

Why: an eager step of a full-size model is host-bound, and the Python thread that issues it releases the GIL at
every torch op. Any Python this process runs meanwhile (a reading thread's per-tensor loops, safetensors' reads,
the format's key mapping) takes the GIL at those releases and keeps it until its own next release, so the
serving thread waits in turns: on an H100 host a busy Python thread made SDXL steps 300x slower, a thread
reading an adapter 2.15x (benchmarks/probes/probe_prefetch_stall.py). In a
separate process that work takes no GIL of ours.

The result comes back without a copy and without per-tensor work here. The reader converts, then asks for a
block of the shared host arena (`HostArena`: files in /dev/shm mapped by both processes; the part reserved with
`reserve` is page-locked for CUDA once, so no page-locked memory is allocated while steps run) and writes every
tensor into it, each adapter's tensors in one span, grouped by dtype. What this process receives is the block's
place, a small header (the dtype groups, for one fused finite check) and the pickled skeleton of the result,
kept as bytes: `Packed`. Turning it into adapter objects over views of the block (`Packed.tree`) is the only
per-tensor work, and its caller chooses when (a prefetch does it at publication, between two steps).

    packed = read(build_adapters, resolved, page_locked=True, **options)   # O(1) Python here
    adapters, report = packed.tree()                                       # as build_adapters(...) here

The process is started on first use (`start()` does it ahead of time: fdlora.integrations.warmup calls it), is reused
by later loads (at most `MAX_WORKERS` at once), sees no GPU (`CUDA_VISIBLE_DEVICES` empty: it never makes a CUDA
context) and exits when this process closes its pipe. Its errors are raised here as they would be in-process;
if it dies, the load raises FdLoraError saying so and the next load starts a fresh one. `FDLORA_PREFETCH_READER
=thread` keeps background reads in this process instead (fdlora.env.prefetch_reader).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import mmap
import os
import pickle
import secrets
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from ..errors import FdLoraError
from ..steps import Steps, drain
from .adapter import LoraAdapter, ModuleLora
from .cache import ALIGN, known_span

MAX_WORKERS = 2  # reader processes at once; also how many prefetches read at once (pipelines.background)
TENSOR_FIELDS = ("A", "B", "bias", "magnitude")
PRELOAD = ("fdlora.hub.load", "peft", "diffusers.loaders.lora_pipeline", "diffusers.loaders.lora_conversion_utils")
PAGE = mmap.ALLOCATIONGRANULARITY  # blocks start on a page: the reader maps just its block
FILE_PREFIX = "fdlora-arena-"
_idle: list[_Worker] = []
_started: list[_Worker] = []
_lock = threading.Lock()
_slots = threading.BoundedSemaphore(MAX_WORKERS)


def read(fn: Callable[..., Any], *args: Any, page_locked: bool, **kwargs: Any) -> Packed:
    """`fn(*args, **kwargs)` run in a reader process (`fn` module-level: it is sent by name), its tensors written
    into one block of the host arena (from the page-locked reserve where it has room and `page_locked`), the
    rest of the result pickled: O(1) Python work on this side, whatever the number of tensors."""
    with _slots:
        worker = _take()
        try:
            packed = worker.call(dict(fn=fn, args=args, kwargs=kwargs), page_locked)
        except BaseException:
            worker.close()  # a worker interrupted mid-answer is not reused
            raise
        _give_back(worker)
    return packed


def run(fn: Callable[..., Any], *args: Any, page_locked: bool, **kwargs: Any) -> Any:
    """`read(...)` turned into objects at once: tensors in the result, loose or in LoraAdapters, within dicts,
    lists and tuples, come back as views into the block, an adapter's own tensors in one span of it, ready for
    one device transfer (fdlora.hub.cache.stage); everything else as it was."""
    return read(fn, *args, page_locked=page_locked, **kwargs).tree()


def start() -> None:
    """Start one reader process now, if none is running, and return once it is ready: its imports take a few seconds
    (off this thread's GIL, but on a core: a load right after a `start` that returned at once ran beside them, and
    a cold first load after fdlora.integrations.warmup took 0.55 s on an H100 host where it took 0.48 s without)."""
    with _lock:
        if _idle or _started:
            return
    worker = _Worker()
    try:
        worker.call(dict(fn=_ready, args=(), kwargs={}), page_locked=False)  # answered after the preloads
    except BaseException:
        worker.close()
        raise
    _give_back(worker)


def _ready() -> None:
    """The request `start` waits on: answered once the reader process has imported what loads need."""


def reserve(nbytes: int) -> int:
    """Add `nbytes` (rounded up to a page) to the arena's reserve, page-locked for CUDA where CUDA is: done once,
    before serving (fdlora.integrations.warmup), so background loads never page-lock memory while steps run.
    Returns the bytes now page-locked in all (0 without CUDA)."""
    return ARENA.reserve(nbytes)


# --- the shared host arena ----------------------------------------------------------------------------------------
class _Chunk:
    """One shared file mapped here: the reserve's chunks are carved into blocks (first fit, freed ranges merged);
    an overflow chunk holds one block and goes away with it."""

    def __init__(self, size: int, pinned: bool, overflow: bool) -> None:
        self.size, self.overflow = size, overflow
        self.path, self.mm = _shared_file(size)
        self.view = memoryview(self.mm)
        self.free = [(0, size)]  # (offset, bytes), by offset
        self.pinned = pinned and _register(self.view)

    def take(self, n: int) -> int | None:
        for i, (off, size) in enumerate(self.free):
            if size >= n:
                self.free[i:i + 1] = [(off + n, size - n)] if size > n else []
                return off
        return None

    def give(self, off: int, n: int) -> None:
        free = sorted([*self.free, (off, n)])
        merged = [free[0]]
        for o, s in free[1:]:
            lo, ls = merged[-1]
            if lo + ls == o:
                merged[-1] = (lo, ls + s)
            else:
                merged.append((o, s))
        self.free = merged

    def drop(self) -> None:
        """Forget the file (its pages go once the last view of it is gone)."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class HostArena:
    """Host memory shared with the reader processes, handed out as page-aligned blocks that return to the arena
    when the last tensor viewing them is gone. The reserve (`reserve`) is page-locked once; a block that does not
    fit in it gets a pageable chunk of its own (its device copy is then a synchronous one, still off the GIL)."""

    def __init__(self) -> None:
        self._chunks: list[_Chunk] = []
        self._lock = threading.Lock()
        self._freed: collections.deque = collections.deque()  # (chunk, offset, bytes) given back, not yet merged

    def reserve(self, nbytes: int) -> int:
        pin = torch.cuda.is_available()
        chunk = _Chunk(-(-int(nbytes) // PAGE) * PAGE, pinned=pin, overflow=False)
        with self._lock:
            self._chunks.append(chunk)
        return self.pinned_bytes

    def alloc(self, nbytes: int, page_locked: bool = True) -> Block:
        n = max(PAGE, -(-int(nbytes) // PAGE) * PAGE)
        if self._freed and torch.cuda.is_initialized():  # a non-blocking copy from a freed page-locked range (a pool
            for d in range(torch.cuda.device_count()):  # reload) may still be queued: it reads the old bytes first
                torch.cuda.synchronize(d)  # (on the loading thread, without the GIL; never a step's thread)
        with self._lock:
            self._merge_freed()
            for chunk in self._chunks:
                if not chunk.overflow and not (chunk.pinned and not page_locked):
                    off = chunk.take(n)
                    if off is not None:
                        return Block(self, chunk, off, nbytes, n)
        chunk = _Chunk(n, pinned=False, overflow=True)
        with self._lock:
            self._chunks.append(chunk)
            return Block(self, chunk, chunk.take(n), nbytes, n)

    def _release(self, chunk: _Chunk, off: int, n: int) -> None:
        """A block's last view is gone. Runs from a finalizer, on any thread and at any allocation (the garbage
        collector), maybe inside this arena's own locked code: so it only queues the range (and removes an
        overflow chunk's file); the next alloc merges it."""
        self._freed.append((chunk, off, n))
        if chunk.overflow:
            chunk.drop()

    def _merge_freed(self) -> None:
        while self._freed:
            chunk, off, n = self._freed.popleft()
            if chunk.overflow:
                self._chunks.remove(chunk)
            else:
                chunk.give(off, n)

    @property
    def pinned_bytes(self) -> int:
        return sum(c.size for c in self._chunks if c.pinned)

    def stats(self) -> dict[str, int]:
        """Bytes: page-locked reserve, of which free; pageable (reserve without CUDA, and overflow blocks); overflow
        blocks alive. (Reads the queue of freed ranges without merging it: only `alloc` may, after its sync.)"""
        with self._lock:
            freed = list(self._freed)
            gone = {id(c) for c, _, _ in freed if c.overflow}
            chunks = [c for c in self._chunks if id(c) not in gone]
            return {"pinned": self.pinned_bytes,
                    "pinned_free": sum(s for c in chunks if c.pinned for _, s in c.free)
                    + sum(n for c, _, n in freed if c.pinned),
                    "pageable": sum(c.size for c in chunks if not c.pinned),
                    "overflow_blocks": sum(c.overflow for c in chunks)}

    def close(self) -> None:
        with self._lock:
            for c in self._chunks:
                c.drop()


class Block:
    """`nbytes` of the arena at `offset` in the file `path`; `tensor` is a uint8 view of it, and the range goes back
    to the arena once that tensor and every view of it are gone."""

    def __init__(self, arena: HostArena, chunk: _Chunk, offset: int, nbytes: int, span: int) -> None:
        self.path, self.offset, self.nbytes, self.pinned = chunk.path, offset, nbytes, chunk.pinned
        view = chunk.view[offset:offset + nbytes]
        weakref.finalize(view, arena._release, chunk, offset, span)  # (the tensor keeps `view` alive)
        self.tensor = torch.frombuffer(view, dtype=torch.uint8)


def _shared_file(size: int) -> tuple[str, mmap.mmap]:
    """A new file of `size` bytes, space allocated (a full /dev/shm fails here, not as a SIGBUS on first touch), in
    /dev/shm where it can be, else the temp dir; mapped shared."""
    for folder in (d for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d) and os.access(d, os.W_OK)):
        path = os.path.join(folder, f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            return path, mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            continue
        finally:
            os.close(fd)
    raise FdLoraError(f"no room for {size / 2**20:.0f} MiB of shared memory for fd-lora's reader process in "
                      f"/dev/shm or {tempfile.gettempdir()}; free some, or set FDLORA_PREFETCH_READER=thread.")


def _register(view: memoryview) -> bool:
    """Page-lock `view` for CUDA copies (cudaHostRegister, portable to every device); False if CUDA refuses. Called
    on a thread of its own: a refusal leaves the CUDA runtime's last error set on the calling thread, which torch's
    next kernel-launch check there would report as that kernel's failure."""
    if not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    ptr = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(cudart.cudaHostRegister(ptr, len(view), 1)
                                                    == cudart.cudaError.success), name="fdlora-register")
    t.start()
    t.join()
    return bool(done and done[0])


ARENA = HostArena()


# --- this side ---------------------------------------------------------------------------------------------------
@dataclass
class Packed:
    """A reader-process result: its tensors in `block` (None without tensors), the rest pickled in `skeleton`.
    `groups`: (dtype name, byte offset in the block, bytes) of each dtype run of every adapter's tensors, for a
    check over the block in a few ops; `adapters`: where each LoraAdapter sits in the result (its key path)."""

    block: Block | None
    skeleton: bytes
    groups: list[tuple[str, int, int]]
    adapters: list[tuple]

    @property
    def tensor(self) -> torch.Tensor | None:
        return None if self.block is None else self.block.tensor

    def tree(self, finite: bool = False) -> Any:
        """The result with its objects rebuilt over views of the block (`finite`: mark every module's tensors as
        checked, after a check over the block passed)."""
        return drain(self.tree_steps(finite))

    def tree_steps(self, finite: bool = False, every: int = 0) -> Steps[Any]:
        """`tree`, stopping every `every` modules (fdlora.steps: a prefetch's publication builds the ~700
        modules of an SDXL LoRA between serving steps)."""
        skeleton, loose = pickle.loads(self.skeleton)
        return (yield from _Unpacker(self.tensor, loose, finite, every).tree(skeleton))


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

    def call(self, request: dict[str, Any], page_locked: bool = True) -> Packed:
        """Send `request`; answer the reader's request for a block; the Packed result (the skeleton not unpickled)."""
        block = None
        try:
            self.send.send(request)
            while True:
                status, payload = self.recv.recv()  # (waits in the OS, without the GIL)
                if status != "alloc":
                    break
                block = ARENA.alloc(payload, page_locked)
                self.send.send((block.path, block.offset))
            if status == "ok":
                return Packed(block, self.recv.recv_bytes(), *payload)
        except (EOFError, OSError) as e:
            try:
                why = f"exit code {self.proc.wait(timeout=5)}"  # (its pipe closed: it is ending, or has ended)
            except subprocess.TimeoutExpired:
                why = repr(e)
            raise FdLoraError(f"fd-lora's reader process ended while reading ({why}); nothing was loaded. Load again "
                              "(a new reader starts), or set FDLORA_PREFETCH_READER=thread to read in this "
                              "process.") from None
        raise payload

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
    ARENA.close()


class _Loose(tuple):
    """(index,): a tensor of the result outside any adapter, by its place in the result (the loose tensors' groups
    and their positions there come beside the skeleton)."""


class _Adapter(tuple):
    """(use_rslora, name, provenance, modules, groups, (first byte, end byte)) of a packed LoraAdapter; a module's
    tensors are referred to by their position in the adapter's groups."""


class _Unpacker:
    """Rebuilds a result over views into the block: per run of same-shape tensors of a dtype group (the packer
    places each group by shape), one view of the block unbound into every tensor of the run (a few C++ calls, not a
    Python call per tensor: an SDXL LoRA has ~1,400 tensors in ~40 runs); modules without checking them again
    (their constructor ran in the reader process) and adapters with their span given."""

    def __init__(self, buf: torch.Tensor | None, loose: tuple[list[tuple], list[int]], finite: bool,
                 every: int = 0) -> None:
        self.buf, self.finite, self.every = buf, finite, every
        groups, positions = loose
        written = self.tensors(groups)
        self.loose = [written[p] for p in positions]

    def tensors(self, groups: list[tuple]) -> list[torch.Tensor]:
        out = []
        for dtype_name, offset, runs in groups:
            dtype = getattr(torch, dtype_name)
            whole = self.buf[offset:offset + sum(n * numel for _, n, numel in runs) * dtype.itemsize].view(dtype)
            at = 0
            for shape, n, numel in runs:
                out += whole[at:at + n * numel].view(n, *shape).unbind(0)
                at += n * numel
        return out

    def tree(self, obj: Any) -> Steps[Any]:
        if type(obj) is _Loose:
            return self.loose[obj[0]]
        if type(obj) is _Adapter:
            return (yield from self.adapter(*obj))
        if type(obj) is dict:
            out = {}
            for k, v in obj.items():
                out[k] = yield from self.tree(v)
            return out
        if type(obj) in (list, tuple):
            items = []
            for v in obj:
                items.append((yield from self.tree(v)))
            return type(obj)(items)
        return obj

    def adapter(self, use_rslora, name, provenance, modules, groups, span) -> Steps[LoraAdapter]:
        tensors = self.tensors(groups)
        finite, mods, every = self.finite, {}, self.every
        for i, (p, ((a, b, bias, magnitude), fields)) in enumerate(modules.items()):  # (`fields`: just unpickled)
            if every and i and not i % every:
                yield
            fields["A"], fields["B"] = tensors[a], tensors[b]
            fields["bias"] = None if bias is None else tensors[bias]
            fields["magnitude"] = None if magnitude is None else tensors[magnitude]
            if finite:
                fields["finite"] = True
            mods[p] = ModuleLora.checked(fields)
        base = self.buf.data_ptr()
        return known_span(LoraAdapter(mods, use_rslora, name, provenance), (base, base + span[0], base + span[1]))


# --- the reader process -----------------------------------------------------------------------------------------
def serve(rfd: int, wfd: int, preload: list[str] = ()) -> None:
    """The reader process's loop: a request in, its answer out, until the other side closes the pipe.
    `preload`: modules the conversions import, imported before the first request (seconds for peft, diffusers)."""
    import importlib

    for name in preload:
        with contextlib.suppress(Exception):
            importlib.import_module(name)  # warm the converters this worker will run
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
            _answer(recv, send, **request)
        except (EOFError, BrokenPipeError):
            return
        except BaseException as e:  # the load's own error, raised on the other side
            try:
                send.send(("error", _sendable(e)))
            except (BrokenPipeError, OSError):
                return


def _answer(recv: Connection, send: Connection, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
    """Run the request, ask for a block of the result's size, write the tensors there, send the header and the
    skeleton."""
    packer = _Packer()
    skeleton = packer.tree(fn(*args, **kwargs))
    loose = packer.groups(packer.loose)
    if packer.offset:
        send.send(("alloc", packer.offset))
        path, offset = recv.recv()
        packer.write(path, offset)
    send.send(("ok", (packer.screen, packer.where)))
    send.send_bytes(pickle.dumps((skeleton, loose), protocol=pickle.HIGHEST_PROTOCOL))


class _Packer:
    """Lays out the tensors of a result in one block: each LoraAdapter's in one span (per dtype, back to back, each
    group ALIGN-ed), the loose ones last, grouped the same way; `tree` returns the result with placeholders,
    `write` copies the tensors into the block once the other side gave one."""

    def __init__(self) -> None:
        self.offset = 0
        self.loose: list[torch.Tensor] = []
        self.placed: list[tuple[int, torch.Tensor]] = []
        self.screen: list[tuple[str, int, int]] = []  # (dtype, offset, bytes) of the adapters' float groups
        self.where: list[tuple] = []  # key path of each adapter in the result
        self._path: tuple = ()

    def groups(self, tensors: list[torch.Tensor], screen: bool = False) -> tuple[list[tuple], list[int]]:
        """Place `tensors` grouped by dtype (first seen first), each group by shape (so `_Unpacker` makes a run of
        same-shape tensors in one call); ((dtype, offset, [(shape, count, numel) per run]) per group, each tensor's
        position in the placed order)."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        out, positions, n = [], [0] * len(tensors), 0
        for dtype, items in by_dtype.items():
            self.offset += -self.offset % ALIGN
            start = self.offset
            shapes = {i: tuple(tensors[i].shape) for i in items}
            items.sort(key=shapes.__getitem__)
            runs: list[list] = []
            for i in items:
                if runs and runs[-1][0] == shapes[i]:
                    runs[-1][1] += 1
                else:
                    runs.append([shapes[i], 1, tensors[i].numel()])
            out.append((str(dtype).removeprefix("torch."), start, [tuple(r) for r in runs]))
            for i in items:
                self.placed.append((self.offset, tensors[i]))
                self.offset += tensors[i].nbytes
                positions[i], n = n, n + 1
            if screen and dtype.is_floating_point:
                self.screen.append((out[-1][0], start, self.offset - start))
        return out, positions

    def write(self, path: str, offset: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, self.offset, offset=offset)
        finally:
            os.close(fd)
        try:
            dst = torch.frombuffer(mm, dtype=torch.uint8)
            for at, t in self.placed:
                dst[at:at + t.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
            del dst
        finally:
            mm.close()

    def tree(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.loose.append(obj)
            return _Loose((len(self.loose) - 1,))
        if isinstance(obj, LoraAdapter):
            self.where.append(self._path)
            return self.adapter(obj)
        if type(obj) is dict:
            return {k: self._at(k, v) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(self._at(i, v) for i, v in enumerate(obj))
        return obj

    def _at(self, key: Any, obj: Any) -> Any:
        outer, self._path = self._path, (*self._path, key)
        try:
            return self.tree(obj)
        finally:
            self._path = outer

    def adapter(self, a: LoraAdapter) -> _Adapter:
        where = [(p, i, getattr(m, f)) for p, m in a.modules.items() for i, f in enumerate(TENSOR_FIELDS)
                 if getattr(m, f) is not None]
        self.offset += -self.offset % ALIGN
        start = self.offset
        groups, positions = self.groups([t for *_, t in where], screen=True)
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

