"""Showed: a background load read in a thread slows a host-bound serving thread ~2x through the GIL; read in the
reader process (fdlora.hub.worker) it does not. Numbers: benchmarks/results/cpu/prefetch_gil.json.

A CPU proxy of bench_prefetch's "steps during a prefetch" row, runnable without a GPU: the "step" is a loop of
small torch ops on the main thread (an eager full-size step is the same: a Python thread that releases the GIL at
every op), timed idle and while `load_adapters` reads and converts a full-size SDXL LoRA (rank 32 on every
attention, feed-forward and proj_in/proj_out linear, 170 MB fp16, module shapes from a UNet built on the meta
device) on a background thread, with the read step in that thread (`in_process=True`, what prefetch did first),
in the reader process with the adapter objects rebuilt on the thread (`in_process=False`, what it did next), or
deferred (`deferred=True`: the block and the skeleton only, what a prefetch's reading stage does now; the objects
are built at publication, between steps). Verified first: the modes give the same tensors.
With two or more cores the serving thread has core 0 to itself and everything else (the reading thread, its read
threads, the reader process) runs on the other cores, so what is measured is the GIL, not a shared core (on the
2-core CI box the two would mix; an H100 host has 16 cores).

    python benchmarks/probes/probe_prefetch_gil.py [--out benchmarks/results/cpu/prefetch_gil.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def write_adapter(path: str, rank: int = 32) -> None:
    from safetensors.torch import save_file

    from fdlora.fixtures import fullsize
    from fdlora.layers import match_targets

    unet = fullsize.sdxl_unet("meta", torch.float16)
    g = torch.Generator().manual_seed(1)
    sd = {}
    for p in match_targets(unet, fullsize.SDXL_TARGETS):
        lin = unet.get_submodule(p)
        sd[f"unet.{p}.lora_A.weight"] = (torch.randn(rank, lin.in_features, generator=g) / lin.in_features ** .5).half()
        sd[f"unet.{p}.lora_B.weight"] = (torch.randn(lin.out_features, rank, generator=g) * .02).half()
    meta = {"unet.r": rank, "unet.lora_alpha": rank, "unet.target_modules": list(fullsize.SDXL_TARGETS)}
    save_file(sd, path, {"format": "pt", "lora_adapter_metadata": json.dumps(meta)})


def step(x: torch.Tensor, w: torch.Tensor, ops: int) -> float:
    t = time.perf_counter()
    for _ in range(ops):
        F.linear(x, w)
    return time.perf_counter() - t


def _pin(others: bool = False) -> None:
    """Core 0 for the calling (serving) thread, or every other core (threads it starts inherit them)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= 2:
        os.sched_setaffinity(0, set(cores[1:]) if others else {cores[0]})  # (0: this thread, on Linux)


def during(path: str, in_process: bool, x, w, ops: int, deferred: bool = False) -> tuple[list[float], float]:
    """Proxy steps run while one background read of `path` runs; (their times, the read's seconds)."""
    from fdlora.hub import load_adapters

    times, read_s = [], []
    done = threading.Event()

    def read():
        _pin(others=True)
        t = time.perf_counter()
        load_adapters(path, cache=None, in_process=in_process, deferred=deferred)
        read_s.append(time.perf_counter() - t)
        done.set()

    threading.Thread(target=read).start()
    while not done.is_set():
        times.append(step(x, w, ops))
    return times, read_s[0]


def control(x, w, ops: int, idle: list[float]) -> float:
    """The step while another process copies memory on the other cores and takes no GIL of ours: what the machine
    itself costs a step when a second core is busy (caches, memory bandwidth; a VM's cores may share a host core)."""
    import subprocess

    code = ("import os, torch; torch.set_num_threads(1); a = torch.ones(128 << 20, dtype=torch.uint8); "
            "b = torch.empty_like(a)\nwhile True: b.copy_(a)")
    starter = threading.Thread(target=lambda: (_pin(others=True), setattr(control, "proc", subprocess.Popen(
        [sys.executable, "-c", code]))))
    starter.start()
    starter.join()
    try:
        time.sleep(2)
        busy = [step(x, w, ops) for _ in range(max(4, int(1.0 / statistics.median(idle))))]
    finally:
        control.proc.kill()
        control.proc.wait()
    return statistics.median(busy) / statistics.median(idle)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu" / "prefetch_gil.json")
    ap.add_argument("--ops", type=int, default=2000, help="torch ops per proxy step")
    ap.add_argument("--loads", type=int, default=10, help="background reads per mode")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # the proxy's ops are tiny; intra-op threads pinned to one core would spin on it
    from fdlora.hub import load_adapters, worker

    path = os.path.join(tempfile.mkdtemp(prefix="fdlora-probe-"), "pytorch_lora_weights.safetensors")
    write_adapter(path)
    here, _ = load_adapters(path, cache=None)
    starter = threading.Thread(target=lambda: (_pin(others=True), worker.start()))  # the reader process: other cores
    starter.start()
    starter.join()
    there, _ = load_adapters(path, cache=None, in_process=False)
    _pin()
    assert all(torch.equal(m.A, there[c].modules[p].A) and torch.equal(m.B, there[c].modules[p].B)
               for c in here for p, m in here[c].modules.items()), "the reader process gave other tensors"
    x, w = torch.randn(2, 64), torch.randn(64, 64)
    for _ in range(5):
        step(x, w, a.ops)
    idle, runs = [], {"thread": ([], []), "process": ([], []), "process_deferred": ([], [])}
    for _ in range(a.loads):  # interleaved, so the machine's drift falls on both alike
        idle += [step(x, w, a.ops) for _ in range(4)]
        for mode, in_process, deferred in (("thread", True, False), ("process", False, False),
                                           ("process_deferred", False, True)):
            times, read_s = during(path, in_process, x, w, a.ops, deferred)
            runs[mode][0].extend(times)
            runs[mode][1].append(round(read_s, 3))
    rows = {"idle_ms": statistics.median(idle) * 1e3, "control_other_core_copy": control(x, w, a.ops, idle)}
    for mode, (times, reads) in runs.items():
        rows[mode] = {"during_ms": statistics.median(times) * 1e3,
                      "ratio": statistics.median(times) / statistics.median(idle), "steps": len(times),
                      "read_s": reads}
    result = {"device": "cpu", "cores": os.cpu_count(), "pinned": "serving thread on core 0, the rest elsewhere",
              "torch": torch.__version__,
              "adapter_mb": os.path.getsize(path) / 1e6, "ops_per_step": a.ops, **rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"idle step {rows['idle_ms']:.1f} ms; during a read in a thread x{rows['thread']['ratio']:.2f}, "
          f"in the reader process x{rows['process']['ratio']:.2f} (objects built here), "
          f"x{rows['process_deferred']['ratio']:.2f} (deferred: what a prefetch's reading stage does); another "
          f"process copying memory on the other cores x{rows['control_other_core_copy']:.2f}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
