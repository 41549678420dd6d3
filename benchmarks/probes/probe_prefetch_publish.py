"""What a prefetch of a full-size SDXL LoRA runs in the serving process, by stage, profiled on CPU (issue 26).

Model and adapter as bench_prefetch (full-size SDXL UNet, random fp16 weights, here on the CPU; rank 32 on every
attention, feed-forward and proj_in/proj_out linear, diffusers layout, ~170 MB). A pipeline that already serves an
adapter prefetches the file a few times (RAM cache off); for each, the prefetch thread's Python and C calls and
its CPU seconds in the "reading" stage (what competes with a serving thread for the GIL) and in "publishing"
(run while no step runs, under the pipeline's lock), and cProfile's top functions of the last publication.

    python benchmarks/probes/probe_prefetch_publish.py [--top 25] [--out publish.json]
    python benchmarks/probes/probe_prefetch_publish.py --narrow --as-cuda --rounds 8 --no-profile

--narrow: the SDXL UNet's structure (722 LoRA layers, ~1.9k modules) at 1/10 widths: the publication's host cost
depends on the layer count, not the widths, and the model builds in seconds. --as-cuda: the CUDA publication path
on the CPU (what the GPU runs: the block "staged" as itself, the bulk writer marked ready, its kernel a stub that
launches nothing, no stream calls), so the host work under the lock is the GPU host's, less the launches;
without it the CPU path runs (finite checks over the bytes, torch copies: per-byte costs). --no-profile: the
publication's CPU seconds without cProfile (which inflates Python time about 2x).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--narrow", action="store_true", help="SDXL structure at 1/10 widths")
    ap.add_argument("--as-cuda", action="store_true", help="the CUDA publication path, emulated on the CPU")
    ap.add_argument("--no-profile", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    import bench_prefetch as bp
    from probe_prefetch_cold import _cpu_setup

    import fdlora  # noqa: F401
    from fdlora.runtime import background

    pipe, unet = _cpu_setup(narrow=a.narrow)
    if a.as_cuda:
        _as_cuda()
    folder = tempfile.mkdtemp(prefix="fdlora-publish-")
    bp.write_adapter(unet, 32, folder)
    calls: dict[tuple[str, str], list] = {}
    step = background.Prefetch._step

    def counting(job, stage):  # on the job's thread: count calls per stage, profile the publication
        sys.setprofile(None)
        step(job, stage)
        if stage in ("reading", "publishing"):
            count = calls.setdefault((job.name, stage), [0, None])
            if stage == "publishing":
                count[1] = cProfile.Profile()
                if not a.no_profile:
                    count[1].enable()  # (replaces the call counter below for this stage; counted from its stats)
                return

            def prof(frame, event, arg):
                if event in ("call", "c_call"):
                    count[0] += 1

            sys.setprofile(prof)
        for (name, st), (_, p) in calls.items():
            if name == job.name and st == "publishing" and p is not None and stage != "publishing":
                p.disable()

    background.Prefetch._step = counting
    pipe.load_fd_lora(folder, "serving")
    with torch.inference_mode():
        rows = []
        for i in range(a.rounds + 1):
            job = pipe.prefetch_fd_lora(folder, adapter_name=f"p{i}", cache=None)
            job.result()
            pipe.delete_adapters(f"p{i}")
            if i:  # (the first starts the reader process)
                pub = calls[(job.name, "publishing")][1]
                pub.disable()
                st = None if a.no_profile else pstats.Stats(pub)
                rows.append({"reading_calls": calls[(job.name, "reading")][0],
                             "publishing_calls": st and sum(v[1] for v in st.stats.values()),
                             "seconds": {k: round(v, 4) for k, v in job.seconds.items()},
                             "cpu_seconds": {k: round(v, 4) for k, v in job.cpu_seconds.items()},
                             "lock_holds_ms": [round(x * 1e3, 3) for x in job.slices]})
                print(json.dumps(rows[-1]), flush=True)
    if st is not None:
        print(f"\n--- last publication: top {a.top} by cumulative time (calls, own s, cumulative s)")
        for (file, line, fn), (_, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:a.top]:
            print(f"{ct:8.4f} {tt:8.4f} {nc:8d}  {Path(file).name}:{line}:{fn}")
    res = {"narrow": a.narrow, "as_cuda": a.as_cuda, "profiled": not a.no_profile, "rows": rows,
           "median_publishing_s": statistics.median(r["seconds"]["publishing"] for r in rows),
           "median_publishing_cpu_s": statistics.median(r["cpu_seconds"]["publishing"] for r in rows),
           "median_reading_cpu_s": statistics.median(r["cpu_seconds"].get("reading", 0) for r in rows)}
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


def _as_cuda() -> None:
    """The CUDA publication path on the CPU (see the module docstring)."""
    import types

    from fdlora.hub.cache import Staged
    from fdlora.hub.pool import mark_bulk_ready
    from fdlora.layers.storage import bulk
    from fdlora.runtime import background

    def stage_block(packed, devices, check_finite):  # the block as its own device copy, checked in one pass
        host = packed.tensor
        finite = bool(background._all_finite(host, packed.groups)) if check_finite else False
        return {c: Staged(host, host.data_ptr()) for c in devices}, finite

    class Kernel:
        @staticmethod
        def scatter(table, src, dst):  # (launches nothing: the banks keep their bytes)
            pass

    background._stage_block = stage_block
    torch.cuda.current_stream = lambda device=None: None
    torch.Tensor.record_stream = lambda self, stream: None
    mark_bulk_ready("cpu", torch.float16)
    bulk._scatter = lambda: Kernel
    bulk.env = types.SimpleNamespace(triton_interpret=lambda: True)


if __name__ == "__main__":
    main()
