# Measures: which piece of a background adapter load slows the serving steps (SDXL, GIL included).
"""Which part of a background adapter load slows the serving steps (issue 26: 1.87x on an H100 with the reader
process, target 1.05x): step times of the full-size SDXL UNet (bench_prefetch's setup) while one background thread
repeats one piece of what a prefetch does in the serving process, each piece alone:

    none           nothing (the idle steps)
    gil            pure Python in a thread (the GIL switching cost a busy Python thread puts on the steps)
    pin_alloc      torch.empty(adapter bytes, pin_memory=True), every buffer kept (a fresh cudaHostAlloc each time,
                   as the reader process's result buffer is: the RAM cache keeps every adapter)
    read_pageable  safefile.read_into of the adapter-sized file in /dev/shm into a pageable buffer
    read_pinned    the same into one page-locked buffer allocated once
    h2d            page-locked buffer -> GPU on a side stream, waited for with an event (bench's staging copy)
    stage          a reader-process result (its block of the host arena) copied to the GPU on a side stream and
                   NaN-checked there in one pass (fdlora.runtime.background._stage_block, the end of a prefetch's
                   reading stage), waited for
    reader         load_adapters(in_process=False, deferred=True): the file read and converted in the reader process
                   into a block of the host arena, nothing unpacked here (what a prefetch's reading stage does
                   first); the block is freed before the next run, so with a reserve no page-locking happens
    h2d_chunked    h2d in CHUNK-byte copies, each waited for before the next is issued
    spin_proc      another process spinning in pure Python (a busy core: no memory traffic, no GIL of ours)
    stream_proc    another process copying adapter-sized buffers in a loop (memory bandwidth and last-level cache)
    *_far, *_near  (hosts whose cores do not all share one L3) the serving process pinned to the L3 domain of the
                   core it runs on, the other process (the reader for reader_*) pinned to another domain (far) or to
                   the same one (near)

Steps are timed as bench_prefetch times them: `--sync stream` (default) waits for the serving stream only, as a server
reading its results does; `--sync device` waits for every stream, side-stream copies included (session 20's rows).

    python benchmarks/probes/probe_prefetch_stall.py --out $OUT/results/prefetch_stall.json     # GPU
    python benchmarks/probes/probe_prefetch_stall.py --smoke                                   # CPU, toy widths
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_prefetch as bp  # noqa: E402

from fdlora.hub import safefile, worker  # noqa: E402

CHUNK = 8 << 20
SPIN = "while True: pass"
STREAM = ("import numpy as np\na = np.ones({n}, np.uint8)\nb = np.empty_like(a)\n"
          "while True: np.copyto(b, a); np.copyto(a, b)")


def _cpus(text: str) -> set[int]:
    out = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def l3_domains() -> list[set[int]]:
    """The L3 domains of the cores this process may run on (one set when the host does not say)."""
    mine, doms = os.sched_getaffinity(0), []
    for c in sorted(mine):
        f = Path(f"/sys/devices/system/cpu/cpu{c}/cache/index3/shared_cpu_list")
        if not f.exists():
            return [set(mine)]
        d = _cpus(f.read_text()) & mine
        if d not in doms:
            doms.append(d)
    return doms


def pieces(path: str, nbytes: int, cuda: bool) -> dict:
    kept: list[torch.Tensor] = []
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    side = torch.cuda.Stream() if cuda else None
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda") if cuda else None

    def gil():
        s = 0
        for i in range(200_000):
            s += i

    def pin_alloc():
        if len(kept) < 24:
            kept.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda))
        else:
            time.sleep(0.01)

    def h2d():
        with torch.inference_mode(), torch.cuda.stream(side):  # (dev is an inference tensor; threads start outside)
            dev.copy_(pinned, non_blocking=True)
            ev = torch.cuda.Event(blocking=True)
            ev.record(side)
        ev.synchronize()

    def h2d_chunked():
        with torch.inference_mode(), torch.cuda.stream(side):
            for o in range(0, nbytes, CHUNK):
                dev[o:o + CHUNK].copy_(pinned[o:o + CHUNK], non_blocking=True)
                ev = torch.cuda.Event(blocking=True)
                ev.record(side)
                ev.synchronize()

    def reader():
        from fdlora.hub import load_adapters

        load_adapters(path, cache=None, in_process=False, deferred=True)

    staged_from = []

    def stage():  # a prefetch's side-stream copy of a reader-process result: one H2D, one NaN pass on the device
        from fdlora.hub import load_adapters
        from fdlora.runtime.background import _stage_block

        if not staged_from:
            staged_from.append(load_adapters(path, cache=None, in_process=False, deferred=True))
        parts, pending = staged_from[0]
        with torch.inference_mode():
            _stage_block(pending.packed, {c: torch.device("cuda") for c in parts}, True)

    out = {"none": None, "pin_alloc": pin_alloc, "read_pageable": lambda: safefile.read_into(path, pageable),
           "read_pinned": lambda: safefile.read_into(path, pinned)}
    if cuda:
        out["h2d"] = h2d
        out["h2d_chunked"] = h2d_chunked
        out["stage"] = stage
    out["reader"] = reader
    out["gil"] = gil  # last: a busy Python thread can slow the steps by far more than the others (session 20's run
    return out        # stalled here for minutes), and each piece is capped in time anyway


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--cap-s", type=float, default=20.0, help="at most this long per piece (then fewer steps)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sync", choices=["stream", "device"], default="stream")
    ap.add_argument("--rows", nargs="*", help="only these rows (none always runs)")
    a = ap.parse_args()
    pipe, unet, inputs, device, sync = bp.setup(a.smoke)
    folder = tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    nbytes = bp.write_adapter(unet, 4 if a.smoke else 32, folder)
    path = str(Path(folder) / bp.WEIGHTS)
    worker.start()
    if device == "cuda":
        worker.reserve(4 * nbytes)  # (as fdlora.warmup does: the reader's blocks land in page-locked memory)
    if device == "cuda" and a.sync == "stream":
        sync = torch.cuda.current_stream().synchronize
    doms = l3_domains()
    table = dict(pieces(path, nbytes, device == "cuda"))
    procs = {"spin_proc": SPIN, "stream_proc": STREAM.format(n=nbytes)}
    table.update(dict.fromkeys(procs))
    if len(doms) > 1:
        table.update(dict.fromkeys(f"{k}_{w}" for k in ("stream_proc", "reader") for w in ("far", "near")))
    rows, mine = {}, os.sched_getaffinity(0)
    with torch.inference_mode():
        for _ in range(3):
            unet(**inputs)
        for name, fn in table.items():
            if a.rows and name != "none" and name not in a.rows:
                continue
            helper, where = None, name.rpartition("_")[2]
            if name.endswith(("_far", "_near")):  # this process on its core's L3 domain, the other on one of two
                cpu = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])  # (field 39: the CPU)
                home = next((d for d in doms if cpu in d), doms[0])
                other = home if where == "near" else next(d for d in doms if d is not home)
                os.sched_setaffinity(0, home)
                if where == "near" and len(home) > 1:
                    other = home - {cpu}
            if name.startswith(("spin_proc", "stream_proc")):
                helper = subprocess.Popen([sys.executable, "-c", procs[name.replace("_far", "").replace("_near", "")]])
                if name.endswith(("_far", "_near")):
                    os.sched_setaffinity(helper.pid, other)
                time.sleep(0.3)
            elif name.startswith("reader_"):
                fn = table["reader"]
                for w in worker._idle + worker._started:
                    os.sched_setaffinity(w.proc.pid, other)
            stop = threading.Event()
            runs = [0]

            def loop(fn=fn, stop=stop, runs=runs):
                while not stop.is_set():
                    fn()
                    runs[0] += 1

            t = None
            if fn is not None:
                fn()  # once untimed: first-use costs (the reader's imports, the stream)
                t = threading.Thread(target=loop, daemon=True)
                t.start()
                time.sleep(0.05)
            ms, t0 = [], time.perf_counter()
            while len(ms) < a.steps and (not ms or time.perf_counter() - t0 < a.cap_s):
                ms.append(bp.timed(lambda: unet(**inputs), sync) * 1e3)
            stop.set()
            if t is not None:
                t.join()
            if helper is not None:
                helper.kill()
                helper.wait()
            os.sched_setaffinity(0, mine)
            for w in worker._idle + worker._started:
                os.sched_setaffinity(w.proc.pid, mine)
            rows[name] = {"step_ms": statistics.median(ms), "max_ms": max(ms), "runs": runs[0], "steps": len(ms)}
            rows[name]["ratio"] = rows[name]["step_ms"] / rows["none"]["step_ms"]
            print(f"{name:14} {rows[name]['step_ms']:8.1f} ms  x{rows[name]['ratio']:.2f}  (max {max(ms):.1f}, "
                  f"{runs[0]} runs, {len(ms)} steps)", flush=True)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
              "adapter_bytes": nbytes, "steps": a.steps, "sync": a.sync, "l3_domains": [sorted(d) for d in doms],
              "arena": worker.ARENA.stats(), "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
