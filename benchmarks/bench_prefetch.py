"""Adapters that arrive while serving, and cold starts: step time during a background load, first loads.

Model: the full-size SDXL UNet (fdlora.fixtures.fullsize: real config, random fp16 weights built on the GPU)
in a UNet-only SDXL pipeline. Adapter: rank 32 on every attention, feed-forward and proj_in/proj_out linear
(~225 MB in fp16), a diffusers-layout file on local disk, read once first so it sits in the OS page cache.

Verified first: an adapter loaded by `prefetch_fd_lora` has bank contents equal, bit for bit, to the same file
loaded by `load_fd_lora`.

Rows (written to benchmarks/results/<gpu>/prefetch.json):
  steps   median UNet step (batch 2, 1024^2 latents) idle, and while `prefetch_fd_lora` loads the adapter from
          disk (RAM cache off) in the background, in alternating rounds (idle steps, then one load's steps); ratio
          (target <= 1.05); a step is timed until the serving stream is done (as a server reading its results waits:
          a prefetch's copy on its side stream is not waited for; it was, through torch.cuda.synchronize, until
          session 26). Each step holds the pipeline's lock as
          a generation does, so every prefetch publishes between two steps. `fdlora.integrations.warmup.warmup` runs
          first, as in a server: it starts the reader process (fdlora.hub.worker), page-locks the host arena the
          reader writes into and builds the bulk bank writer; `arena` says whether the blocks came from the
          page-locked reserve. `mean_ratio` counts the steps a publication lands on (the adapter objects are built
          and the banks written there), which the median may skip. Since session 27 a publication holds the lock in
          pieces of ~1.5 ms (fdlora.runtime.background._publish): `lock_hold_max_ms` is the longest hold over
          every load, `lock_hold_sum_ms_median` a load's total. `round_ratio_median`: the median over rounds of each
          round's own ratio (its loading steps against the idle steps just before them), which a host whose step
          time drifts between rounds (idle medians of 66 and 100 ms in one process, session 27) moves less.
          FDLORA_PREFETCH_READER=thread measures reads on the prefetch's own thread (what it did before).
  cold    fresh processes (subprocess), file in the page cache: fd-lora's first `load_fd_lora` (target <= 0.5 s)
          and the first step after it; the same with `fdlora.integrations.warmup.warmup` before the load (the UNet's
          layers wrapped as the load would, the bank writer, the kernel backends imported) and between load and
          first step (the layers' kernels);
          diffusers' first `load_lora_weights` and its first step.
  warm    in the fd-lora process after its first load: a later load from disk, a re-load from the RAM cache,
          `delete_adapters`.

    python benchmarks/bench_prefetch.py                                  # GPU
    python benchmarks/bench_prefetch.py --smoke --out /tmp/prefetch.json # CPU, toy widths, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's fdlora, also in the cold-start subprocesses
WEIGHTS = "pytorch_lora_weights.safetensors"
IDLE_PER_ROUND = 4  # idle steps before each prefetch: about the steps one load spans on an H100


def args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="default: benchmarks/results/<gpu>/prefetch.json")
    ap.add_argument("--smoke", action="store_true", help="toy widths on CPU: checks the script, timings meaningless")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="idle steps timed, and at least as many during prefetches")
    ap.add_argument("--steps-only", action="store_true", help="the steps rows only (no cold-start processes)")
    ap.add_argument("--cold-only", action="store_true", help="the cold-start rows only (no steps rows)")
    ap.add_argument("--cold-runs", type=int, help="fresh processes per fd-lora cold row, median first load (3; "
                    "--smoke: 1)")
    ap.add_argument("--child", choices=["fd", "fd-warmup", "diffusers"], help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def setup(smoke: bool):
    """(pipe, unet, step inputs, device, sync): the UNet-only SDXL pipeline."""
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    from fdlora.fixtures import fullsize

    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.float16
    unet = fullsize.sdxl_unet(device, dtype, tiny=smoke).requires_grad_(False)
    pipe = StableDiffusionXLPipeline(vae=None, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                     tokenizer_2=None, unet=unet, scheduler=EulerDiscreteScheduler())
    tokens = fullsize.SDXL_TOKENS_TINY if smoke else fullsize.SDXL_TOKENS
    inputs = fullsize.sdxl_inputs(unet, batch=2, tokens=tokens)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return pipe, unet, inputs, device, sync


def write_adapter(unet, rank: int, folder: str) -> int:
    """The diffusers-layout LoRA file (metadata header as save_lora_weights writes it); returns its bytes."""
    import torch
    from safetensors.torch import save_file

    from fdlora.fixtures import fullsize
    from fdlora.layers import match_targets

    g = torch.Generator().manual_seed(1)
    sd = {}
    dtype = next(unet.parameters()).dtype
    for p in match_targets(unet, fullsize.SDXL_TARGETS):
        lin = unet.get_submodule(p)
        A = torch.randn(rank, lin.in_features, generator=g) / lin.in_features ** 0.5
        sd[f"unet.{p}.lora_A.weight"] = A.to(dtype)
        sd[f"unet.{p}.lora_B.weight"] = (torch.randn(lin.out_features, rank, generator=g) * 0.02).to(dtype)
    meta = {"unet.r": rank, "unet.lora_alpha": rank, "unet.target_modules": list(fullsize.SDXL_TARGETS)}
    path = os.path.join(folder, WEIGHTS)
    save_file(sd, path, {"format": "pt", "lora_adapter_metadata": json.dumps(meta)})
    Path(path).read_bytes()  # into the OS page cache, as in the issue
    return os.path.getsize(path)


class GcClock:
    """Seconds Python's garbage collector ran, by generation, while installed (a full collection over a process
    holding diffusers and a model takes a few tenths of a second, and lands in whatever call triggers it)."""

    def __init__(self) -> None:
        import gc

        self.seconds: dict[int, float] = {}
        self._t = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            g = info["generation"]
            self.seconds[g] = self.seconds.get(g, 0.0) + time.perf_counter() - self._t

    def take(self) -> dict[str, float]:
        out, self.seconds = {f"gen{g}": round(v, 4) for g, v in sorted(self.seconds.items())}, {}
        return out


def timed(fn, sync) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def child(a: argparse.Namespace) -> None:
    """One fresh process: its first load (and first steps), printed as one JSON line."""
    import torch

    pipe, unet, inputs, device, sync = setup(a.smoke)
    step = lambda: unet(**inputs)  # noqa: E731
    out = {}
    with torch.inference_mode():
        if a.child == "diffusers":
            clock = GcClock()
            out["first_load_s"] = timed(lambda: pipe.load_lora_weights(a.dir, weight_name=WEIGHTS, adapter_name="a"),
                                        sync)
            out["first_load_gc_s"] = clock.take()
        else:
            import fdlora  # noqa: F401  (attaches load_fd_lora; its import is not part of the load)
            from fdlora.integrations.warmup import warmup

            if a.child == "fd-warmup":  # before the first load: its layers, bank writer and kernel imports
                out["warmup_before_load_s"] = timed(lambda: warmup(pipe), sync)
            clock = GcClock()
            out["first_load_s"] = timed(lambda: pipe.load_fd_lora(a.dir, "a"), sync)
            out["first_load_gc_s"] = clock.take()
            if a.child == "fd-warmup":
                tokens = (8, 64, 256) if a.smoke else (77, 1024, 4096)  # text, 32^2 and 64^2 latents (per sample)
                out["warmup_s"] = timed(lambda: warmup(pipe, tokens=tokens), sync)
        out["first_step_s"] = timed(step, sync)
        out["step_s"] = statistics.median(timed(step, sync) for _ in range(1 if a.smoke else 3))
        if a.child == "fd":
            out["later_load_s"] = timed(lambda: pipe.load_fd_lora(a.dir, "b", cache=None), sync)
            out["reload_from_ram_s"] = timed(lambda: pipe.load_fd_lora(a.dir, "c"), sync)  # the first load cached it
            out["delete_s"] = timed(lambda: pipe.delete_adapters("b"), sync)
    print("RESULT " + json.dumps(out), flush=True)


def fresh(kind: str, folder: str, smoke: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--dir", folder] + (["--smoke"] if smoke else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"the {kind} cold-start process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def cold_rows(folder: str, smoke: bool, runs: int) -> dict:
    """fd-lora's cold processes `runs` times each, interleaved (fd, fd-warmup, fd, ...: drift on the host touches
    both alike), each kind's row the run with the median first load, with every run's first load beside it; one
    diffusers process (the reference). One run each was too noisy to rank fd against fd-warmup (0.48 vs 0.55 s)."""
    import statistics

    samples: dict[str, list[dict]] = {"fd": [], "fd-warmup": []}
    for _ in range(max(1, runs)):
        for kind in samples:
            samples[kind].append(fresh(kind, folder, smoke))
            print(f"cold {kind} run: {json.dumps(samples[kind][-1])}", flush=True)  # (a cut call keeps these)
    rows = {}
    for kind, got in samples.items():
        loads = [r["first_load_s"] for r in got]
        mid = statistics.median_low(loads)
        rows[kind] = {**next(r for r in got if r["first_load_s"] == mid), "first_load_s_runs": loads}
    rows["diffusers"] = fresh("diffusers", folder, smoke)
    return rows


def verify(pipe, folder: str) -> None:
    """A prefetched adapter's banks equal load_fd_lora's, bit for bit."""
    import torch

    pipe.load_fd_lora(folder, "loaded")
    pipe.prefetch_fd_lora(folder, adapter_name="fetched", cache=None).result()
    h = pipe.fd_lora_handles()["unet"]
    a, b = h.state.slots.by_name["loaded"], h.state.slots.by_name["fetched"]
    for path, layer in h.layers.items():
        bank = layer.bank
        if not (torch.equal(bank.A[a], bank.A[b]) and torch.equal(bank.B[:, a], bank.B[:, b])
                and torch.equal(h.state.table.scaling[layer.index, a], h.state.table.scaling[layer.index, b])):
            raise AssertionError(f"{path}: the prefetched adapter differs from the loaded one")
    pipe.delete_adapters(["loaded", "fetched"])


def serving(pipe, unet, inputs, folder: str, sync, n: int) -> dict:
    """Step times in rounds, each `IDLE_PER_ROUND` idle steps and then steps while a prefetch of the adapter (from
    disk) runs, until n steps of each kind: idle and loading steps alternate within seconds of each other, so a host
    whose speed drifts over a call (SDXL base steps 60-107 ms within one call in session 23) moves both alike.
    Each round then deletes its adapter and runs one untimed step (what the delete leaves for the next step to
    redo is the delete's cost, not the load's: `after_delete_ms` reports it). Then the same rounds again after
    `gc.freeze()` (a server's usual move: the collector stops walking the model's and the libraries' objects).
    Each loading step is filed under the prefetch stage it started and ended in."""
    import gc

    import torch

    from fdlora import env
    from fdlora.hub import worker
    from fdlora.integrations.warmup import warmup
    from fdlora.runtime.scope import lock_of

    lock = lock_of(pipe)
    if torch.cuda.is_available() and next(unet.parameters()).is_cuda:
        sync = torch.cuda.current_stream().synchronize  # the serving stream: a prefetch's side-stream copy is not in it

    def step():
        with lock:  # what a generation holds: a prefetch publishes only between steps
            unet(**inputs)

    def rounds_of(tag: str) -> tuple[list[float], list[float], dict]:
        idle, during, loads, rounds, by_stage, clock, pageable, after = [], [], [], 0, {}, GcClock(), 0, []
        paired = []  # per round: median loading step / median of the idle steps just before it
        while (len(during) < n or len(idle) < n) and rounds < 50:
            idle.extend(timed(step, sync) for _ in range(IDLE_PER_ROUND))
            job = pipe.prefetch_fd_lora(folder, adapter_name=f"bg{tag}{rounds}", cache=None)
            t, first = time.perf_counter(), len(during)
            while not job.done():
                seen = job.stage
                during.append(timed(step, sync))
                by_stage.setdefault(f"{seen} -> {job.stage}", []).append(during[-1] * 1e3)
                pageable = max(pageable, worker.ARENA.stats()["overflow_blocks"])  # blocks outside the reserve
            job.result()
            if len(during) > first:
                paired.append(statistics.median(during[first:]) / statistics.median(idle[-IDLE_PER_ROUND:]))
            loads.append({"seconds": time.perf_counter() - t, **{k: round(v, 4) for k, v in job.seconds.items()},
                          "cpu": {k: round(v, 4) for k, v in job.cpu_seconds.items()},
                          "lock_holds_ms": [round(x * 1e3, 3) for x in job.slices],  # in the order held
                          "lock_holds": len(job.slices), "lock_hold_max_ms": round(max(job.slices) * 1e3, 3),
                          "lock_hold_sum_ms": round(sum(job.slices) * 1e3, 3)})
            pipe.delete_adapters(f"bg{tag}{rounds}")
            after.append(timed(step, sync) * 1e3)
            rounds += 1
        gc.callbacks.remove(clock._tick)
        return idle, during, {
            "prefetches": len(loads), "prefetch_seconds": loads[:5], "gc_seconds": clock.take(),
            "lock_hold_max_ms": max(d["lock_hold_max_ms"] for d in loads),  # the publication's longest hold
            "round_ratios": [round(r, 4) for r in paired], "round_ratio_median": statistics.median(paired),
            "lock_hold_sum_ms_median": statistics.median(d["lock_hold_sum_ms"] for d in loads),
            "pageable_blocks_seen": pageable, "after_delete_ms": statistics.median(after),
            "steps_by_stage": {k: {"steps": len(v), "median_ms": statistics.median(v), "max_ms": max(v)}
                               for k, v in by_stage.items()}}

    def summary(idle: list[float], during: list[float]) -> dict:
        return {"idle_ms": statistics.median(idle) * 1e3, "during_prefetch_ms": statistics.median(during) * 1e3,
                "ratio": statistics.median(during) / statistics.median(idle),
                "mean_ratio": statistics.mean(during) / statistics.mean(idle),
                "during_prefetch_max_ms": max(during) * 1e3, "steps_idle": len(idle), "steps_during": len(during)}

    warmup(pipe, tokens=())  # what a server runs before serving (the steps below have built the layers' kernels)
    with torch.inference_mode():
        pipe.prefetch_fd_lora(folder, adapter_name="warm", cache=None).result()  # the reader's imports are done
        pipe.delete_adapters("warm")  # and its first conversion ran, so no window below is a start-up
        for _ in range(1 if n < 3 else 3):
            timed(step, sync)
        idle, during, detail = rounds_of("")
        gc.freeze()
        try:
            f_idle, frozen, frozen_detail = rounds_of("f")
        finally:
            gc.unfreeze()
    return {**summary(idle, during), "reader": env.prefetch_reader(), "arena": worker.ARENA.stats(), **detail,
            "gc_frozen": {**summary(f_idle, frozen), **frozen_detail}}


def environment(device: str) -> dict:
    import diffusers
    import torch

    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke: timings meaningless)",
            "torch": torch.__version__, "triton": triton_v, "diffusers": diffusers.__version__, "git_sha": sha or None}


def main(argv=None) -> int:
    a = args(argv)
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    if a.child:
        child(a)
        return 0
    import fdlora  # noqa: F401

    pipe, unet, inputs, device, sync = setup(a.smoke)
    folder = tempfile.mkdtemp(prefix="fdlora-bench-prefetch-")
    nbytes = write_adapter(unet, 4 if a.smoke and a.rank == 32 else a.rank, folder)
    steps = {}
    if not a.cold_only:
        verify(pipe, folder)
        pipe.load_fd_lora(folder, "serving")  # the adapter the steps run with
        steps = serving(pipe, unet, inputs, folder, sync, 2 if a.smoke else a.steps)
    del pipe, unet
    cold = {} if a.steps_only else cold_rows(folder, a.smoke, a.cold_runs or (1 if a.smoke else 3))
    env = environment(device)
    result = {**env, "adapter_mb": nbytes / 1e6, "rank": a.rank, "verified": "prefetch banks == load_fd_lora banks",
              "steps": steps, "cold": cold,
              "targets": {"steps_ratio_max": 1.05, "cold_first_load_s_max": 0.5}}
    out = a.out or ROOT / "benchmarks" / "results" / env["device"].lower().replace(" ", "-") / "prefetch.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if steps:
        print(f"steps: idle {steps['idle_ms']:.1f} ms, during prefetch {steps['during_prefetch_ms']:.1f} ms "
              f"(x{steps['ratio']:.3f}, by round x{steps['round_ratio_median']:.3f}, {steps['steps_during']} steps, "
              f"{steps['prefetches']} prefetches); after gc.freeze x{steps['gc_frozen']['ratio']:.3f} (by round "
              f"x{steps['gc_frozen']['round_ratio_median']:.3f}); gc during: {steps['gc_seconds']}")
    for stage, row in steps.get("steps_by_stage", {}).items():
        print(f"  {stage:45} {row['steps']:3} steps  median {row['median_ms']:.1f} ms  max {row['max_ms']:.1f} ms")
    for kind, row in cold.items():
        print(f"cold {kind}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" if isinstance(v, float)
                                           else f"{k} {[round(x * 1e3) for x in v]} ms" if k.endswith("_runs")
                                           else f"{k} {v}"
                                           for k, v in row.items()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
