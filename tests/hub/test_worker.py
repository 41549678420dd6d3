"""The reader process (fdlora.hub.worker): a load read and converted there equals the same load in-process.

Oracle: `load_adapters(..., in_process=True)` on the same file: every module's tensors (bit for bit, dtype and
shape), every other module field, and the report. Failures: the load's own error comes back as itself; a reader
that dies mid-read is a clear FdLoraError and the next load starts a new one; no shared file outlives its block.
The host arena: blocks come back when their last view goes, freed ranges merge, an oversized block gets a file of
its own. A deferred read does the same Python work here whatever the adapter's size.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import os
import sys
import tempfile
import threading

import pytest
import torch
from safetensors.torch import save_file
from support.loras import diffusers_files, make_lora, peft_files

from fdlora import errors
from fdlora.hub import load_adapters, worker
from fdlora.hub.cache import span_of
from fdlora.hub.load import PendingLoad, PendingPart, materialize


def arena_files() -> list[str]:
    """This process's shared files that hold blocks outside the reserve (the tests reserve nothing)."""
    return [f for d in ("/dev/shm", tempfile.gettempdir())
            for f in glob.glob(os.path.join(d, f"{worker.FILE_PREFIX}{os.getpid()}-*"))]


def bf16(g, *shape):
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A LyCORIS file mixing LoHa, LoRA with a DoRA scale and a full diff with its bias (bf16), and a diffusers
    file with two components (fp32, fp16)."""
    d = tmp_path_factory.mktemp("reader")
    g = torch.Generator().manual_seed(0)
    mixed = {"lycoris_fc1.hada_w1_a": bf16(g, 12, 4), "lycoris_fc1.hada_w1_b": bf16(g, 4, 10),
             "lycoris_fc1.hada_w2_a": bf16(g, 12, 4), "lycoris_fc1.hada_w2_b": bf16(g, 4, 10),
             "lycoris_fc1.alpha": torch.tensor(2.0), "lycoris_fc2.lora_down.weight": bf16(g, 3, 12),
             "lycoris_fc2.lora_up.weight": bf16(g, 7, 3), "lycoris_fc2.alpha": torch.tensor(1.5),
             "lycoris_fc2.dora_scale": bf16(g, 7, 1), "lycoris_fc3.diff": bf16(g, 5, 7),
             "lycoris_fc3.diff_b": bf16(g, 5)}
    save_file(mixed, str(d / "mixed.safetensors"))
    unet = make_lora({"down.0.to_q": (24, 40), "down.0.proj": (40, 24)}, rank=5, seed=1)
    te = make_lora({"layers.0.q_proj": (16, 16)}, rank=3, seed=2, dtype=torch.float16)
    for name, data in diffusers_files({"unet": unet, "text_encoder": te}).items():
        (d / name).write_bytes(data)
    peft = d / "peft"
    peft.mkdir()
    for name, data in peft_files(make_lora({"layers.0.q_proj": (16, 24), "layers.0.o_proj": (24, 16)}, rank=4,
                                           seed=3, dtype=torch.bfloat16)).items():
        (peft / name).write_bytes(data)
    return {"mixed": str(d / "mixed.safetensors"), "diffusers": str(d / "pytorch_lora_weights.safetensors"),
            "peft": str(peft)}


def without_seconds(report):
    return dataclasses.replace(report, seconds={})


@pytest.mark.parametrize("which", ["mixed", "diffusers"])
def test_reader_process_equals_in_process(files, which):
    here, rep_here = load_adapters(files[which], cache=None, name="a")
    there, rep_there = load_adapters(files[which], cache=None, name="a", in_process=False)
    assert without_seconds(rep_there) == without_seconds(rep_here)
    assert rep_there.groups == rep_here.groups
    assert here.keys() == there.keys()
    for comp in here:
        a, b = here[comp], there[comp]
        assert (a.use_rslora, a.name, a.provenance) == (b.use_rslora, b.name, b.provenance)
        assert a.modules.keys() == b.modules.keys()
        for path, m in a.modules.items():
            n = b.modules[path]
            for f in worker.TENSOR_FIELDS:
                x, y = getattr(m, f), getattr(n, f)
                assert (x is None) == (y is None), (path, f)
                if x is not None:
                    assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (path, f)
            assert {k: v for k, v in vars(m).items() if k not in worker.TENSOR_FIELDS} == \
                   {k: v for k, v in vars(n).items() if k not in worker.TENSOR_FIELDS}, path
    tensors = [t for a in there.values() for m in a.modules.values()
               for t in (getattr(m, f) for f in worker.TENSOR_FIELDS) if t is not None]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one buffer: one device transfer later
    for a in there.values():  # each component's span (given, not searched) holds all its bytes
        start, lo, hi = span_of(a)
        assert start == tensors[0].untyped_storage().data_ptr()
        assert all(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for m in a.modules.values()
                   for t in (getattr(m, f) for f in worker.TENSOR_FIELDS) if t is not None)
    assert arena_files()  # the block lives as long as a tensor views it
    del there, rep_there, tensors, a, b, m, n, x, y  # (the report keeps the modules too)
    gc.collect()
    assert not arena_files()


def test_any_result_comes_back_with_its_loose_tensors(files):
    """A result that is not adapters (a Transformers prefetch's read: LoraConfig, PEFT's state dict, provenance)
    comes back equal, its tensors in one buffer, in the dict's own order."""
    from fdlora.integrations.transformers.read import read_peft

    config, tensors, prov = read_peft(files["peft"])
    config2, tensors2, prov2 = worker.run(read_peft, files["peft"], page_locked=False)
    assert (config2.to_dict(), prov2) == (config.to_dict(), prov)
    assert list(tensors2) == list(tensors)
    assert all(t.dtype == tensors[k].dtype and torch.equal(t, tensors[k]) for k, t in tensors2.items())
    assert len({t.untyped_storage().data_ptr() for t in tensors2.values()}) == 1


def test_the_loads_own_error_comes_back_as_itself(files, tmp_path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(open(files["diffusers"], "rb").read()[:-100])
    with pytest.raises(errors.UnsafeFileError) as here:
        load_adapters(str(cut), cache=None)
    with pytest.raises(errors.UnsafeFileError) as there:
        load_adapters(str(cut), cache=None, in_process=False)
    assert str(there.value) == str(here.value)
    gc.collect()
    assert not arena_files()


class _Exit:
    """A request whose unpickling ends the reader process (a crash in the middle of a read)."""

    def __reduce__(self):
        return os._exit, (7,)


def test_a_reader_that_dies_is_an_error_and_the_next_load_starts_another(files):
    load_adapters(files["diffusers"], cache=None, in_process=False)  # a reader is running and idle
    w = worker._take()
    with pytest.raises(errors.FdLoraError, match="reader process ended while reading .exit code 7.*Load again"):
        w.call({"boom": _Exit()})
    w.close()
    adapters, _ = load_adapters(files["diffusers"], cache=None, in_process=False)
    assert set(adapters) == {"unet", "text_encoder"}
    for w in list(worker._idle):  # an idle reader killed from outside is skipped, not used
        w.proc.kill()
        w.proc.wait()
    adapters, _ = load_adapters(files["diffusers"], cache=None, in_process=False)
    assert set(adapters) == {"unet", "text_encoder"}
    assert all(w.proc.poll() is None for w in worker._idle)


def test_arena_blocks_come_back_merge_and_overflow():
    arena, P = worker.HostArena(), worker.PAGE
    try:
        arena.reserve(8 * P)  # (not page-locked without CUDA: the same carving)
        a, b, c = (arena.alloc(2 * P - 7) for _ in range(3))  # (rounded up to pages)
        assert [x.offset for x in (a, b, c)] == [0, 2 * P, 4 * P]
        assert a.path == b.path == c.path and a.tensor.numel() == 2 * P - 7
        view = b.tensor[5:9]  # a view keeps the block
        b.tensor.fill_(3)
        del b
        gc.collect()
        d = arena.alloc(P)
        assert d.offset == 6 * P and view.tolist() == [3] * 4
        del view
        gc.collect()
        e = arena.alloc(2 * P)
        assert e.offset == 2 * P  # b's range, reused
        big = arena.alloc(3 * P)  # one page free: a file of its own
        assert big.path != c.path and big.offset == 0 and arena.stats()["overflow_blocks"] == 1
        path = big.path
        del big
        gc.collect()
        assert not os.path.exists(path) and arena.stats()["overflow_blocks"] == 0
        del a, e
        gc.collect()  # a's and e's ranges merge: room for 4 pages at the front
        assert arena.alloc(4 * P).offset == 0 and d.offset == 6 * P and c.offset == 4 * P
    finally:
        arena.close()


def python_calls(fn) -> int:
    """Python and C calls made on this thread while `fn()` runs (what would hold the GIL in a serving process)."""
    count = [0]

    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def test_a_deferred_read_costs_the_same_here_whatever_the_size(tmp_path):
    """load_adapters(..., deferred=True) with the reader process: the same number of calls in this process for
    16 and 256 modules (what a prefetch's reading thread does); `materialize` gives what an in-process load does."""
    files = {}
    for n in (16, 256):
        lora = make_lora({f"blocks.{i}.to_q": (32, 24) for i in range(n)}, rank=4, seed=n, dtype=torch.float16)
        for name, data in diffusers_files({"unet": lora}).items():
            (tmp_path / f"{n}").mkdir()
            (tmp_path / f"{n}" / name).write_bytes(data)
        files[n] = str(tmp_path / f"{n}")
    load_adapters(files[16], cache=None, in_process=False, deferred=True)  # a reader is running, imports done
    got, calls = {}, {}
    for n, path in files.items():
        calls[n] = python_calls(lambda n=n, path=path: got.__setitem__(
            n, load_adapters(path, cache=None, name="x", in_process=False, deferred=True)))
    assert abs(calls[256] - calls[16]) <= 0.05 * calls[16], calls
    parts, pending = got[256]
    assert isinstance(pending, PendingLoad) and list(parts) == ["unet"] and isinstance(parts["unet"], PendingPart)
    assert pending.packed.groups == [("float16", 0, 256 * 4 * (32 + 24) * 2)]
    adapters, report = materialize({"den": parts["unet"]}, pending)  # (renamed as _fd_read may)
    here, rep_here = load_adapters(files[256], cache=None, name="x")
    assert without_seconds(report) == without_seconds(rep_here) and adapters["den"].name == "x"
    for path, m in here["unet"].modules.items():
        assert torch.equal(m.A, adapters["den"].modules[path].A) and torch.equal(m.B, adapters["den"].modules[path].B)
    assert not any(m.finite for m in adapters["den"].modules.values())
    again, _ = pending.result(finite=True)  # built once
    assert again["unet"] is adapters["den"]


def test_the_reserve_is_page_locked_once_and_only_page_locked_reads_use_it(monkeypatch):
    """cudaHostRegister (faked here) runs once per reserve, on a thread of its own; blocks that ask for page-locked
    memory come from there, others get pageable files of their own."""
    import types

    calls = []
    def register(ptr, n, flags):
        calls.append((n, flags, threading.current_thread().name))
        return 0

    fake = types.SimpleNamespace(cudaError=types.SimpleNamespace(success=0), cudaHostRegister=register)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    arena = worker.HostArena()
    try:
        assert arena.reserve(3 * worker.PAGE + 1) == 4 * worker.PAGE
        assert calls == [(4 * worker.PAGE, 1, "fdlora-register")]  # portable, off this thread
        locked, loose = arena.alloc(worker.PAGE, page_locked=True), arena.alloc(worker.PAGE, page_locked=False)
        assert locked.pinned and not loose.pinned and locked.path != loose.path
        assert arena.stats() == {"pinned": 4 * worker.PAGE, "pinned_free": 3 * worker.PAGE, "pageable": worker.PAGE,
                                 "overflow_blocks": 1}
        assert len(calls) == 1
    finally:
        arena.close()


def test_warmup_reserves_the_page_locked_arena_once(monkeypatch):
    """fdlora.integrations.warmup tops the reserve up to `pinned_bytes` (CUDA faked here), not again on a second call;
    without room for it, it warns and loads arrive in pageable memory."""
    from fdlora.integrations import warmup

    arena, sizes = worker.HostArena(), []
    monkeypatch.setattr(worker, "ARENA", arena)
    monkeypatch.setattr(worker, "_register", lambda view: sizes.append(len(view)) or True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        for _ in range(2):
            warmup._start_reader(8 * worker.PAGE)
        assert sizes == [8 * worker.PAGE] and arena.pinned_bytes == 8 * worker.PAGE
        monkeypatch.setattr(worker, "_shared_file", lambda size: (_ for _ in ()).throw(errors.FdLoraError("full")))
        warmup._start_reader(9 * worker.PAGE)  # (a warning, no error)
        assert arena.pinned_bytes == 8 * worker.PAGE
    finally:
        arena.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_read_lands_in_page_locked_memory_after_a_reserve(files):
    worker.reserve(64 << 20)
    _, pending = load_adapters(files["diffusers"], cache=None, in_process=False, deferred=True)
    packed = pending.packed
    assert packed.block.pinned and packed.tensor.is_pinned()
    dev = packed.tensor.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), packed.tensor)


def test_start_returns_once_the_reader_has_imported_its_preloads(tmp_path, monkeypatch):
    """`start` (fdlora.integrations.warmup calls it) returns after the new reader's preload imports, so a load right
    after it does not run beside them; the reader then serves loads as before."""
    import types

    for w in list(worker._started):
        w.close()
    worker._idle.clear()
    mark = tmp_path / "ready"
    monkeypatch.setenv("FDLORA_TEST_READY_MARK", str(mark))
    monkeypatch.setitem(sys.modules, "support.reader_ready", types.ModuleType("support.reader_ready"))
    monkeypatch.setattr(worker, "PRELOAD", ("support.reader_ready",))  # (imported there: slow, then marks)
    worker.start()
    assert mark.read_text() == "imported" and len(worker._idle) == 1 and worker._idle[0].proc.poll() is None
    monkeypatch.setattr(worker, "PRELOAD", ())
    worker.start()  # one is running: nothing more starts
    assert len(worker._started) == 1
