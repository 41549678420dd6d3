"""Where a prefetch's longest lock holds go, on the GPU host (issue 26): the adapter objects built over the block (here
in one piece, profiled as one) and the last piece (from COMMIT: banks written, name registered, hot entries
re-armed), profiled while steps run.

Model, adapter and steps as bench_prefetch (full-size SDXL UNet, fp16, r32 on its attention/ff/proj layers, a step
holding the pipeline's lock, `warmup` first, the serving adapter active). `--loads` prefetches run next to steps; for
each, the wall time of every lock hold, and cProfile's top functions over all first and last pieces (cProfile about
doubles Python's time: compare functions with each other, not with the holds).

    python benchmarks/probes/probe_prefetch_pieces.py [--loads 6] [--top 30] [--out pieces.json]    # GPU
    python benchmarks/probes/probe_prefetch_pieces.py --smoke                                       # CPU check
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def top(prof: cProfile.Profile, n: int) -> list[str]:
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:n]
    return [f"{ct * 1e3:8.2f} {tt * 1e3:8.2f} {nc:7d}  {Path(f).name}:{line}:{fn}"
            for (f, line, fn), (_, nc, tt, ct, _) in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=int, default=6)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import bench_prefetch as bp
    import torch

    from fdlora.integrations.warmup import warmup
    from fdlora.runtime import background
    from fdlora.runtime.scope import lock_of

    pipe, unet, inputs, device, sync = bp.setup(a.smoke)
    folder = tempfile.mkdtemp(prefix="fdlora-pieces-")
    bp.write_adapter(unet, 4 if a.smoke else 32, folder)
    pipe.load_fd_lora(folder, "serving")
    lock = lock_of(pipe)
    if device == "cuda":
        sync = torch.cuda.current_stream().synchronize
    first, last = cProfile.Profile(), cProfile.Profile()
    materialize, drain = background.materialize_steps, background.drain

    def profiled(prof, fn):
        def run(*args, **kw):
            prof.enable()
            try:
                return fn(*args, **kw)
            finally:
                prof.disable()
        return run

    def built(prof):  # the adapter objects, here in one piece (profiled as one: its pieces are timed in holds_ms)
        def steps(*args, **kw):
            return profiled(prof, drain)(materialize(*args, **{**kw, "every": 0}))
            yield  # (a generator, as materialize_steps)
        return steps

    background.materialize_steps = built(first)
    background.drain = profiled(last, drain)  # everything from COMMIT on
    warmup(pipe, tokens=())
    holds = []
    with torch.inference_mode():
        for i in range(a.loads + 1):
            job = pipe.prefetch_fd_lora(folder, adapter_name=f"p{i}", cache=None)
            while not job.done():
                sync()
                with lock:
                    unet(**inputs)
                sync()
            job.result()
            pipe.delete_adapters(f"p{i}")
            if i:  # (the first one's profile is reset below: it started the reader process)
                holds.append([round(x * 1e3, 3) for x in job.slices])
            else:
                first, last = cProfile.Profile(), cProfile.Profile()
                background.materialize_steps, background.drain = built(first), profiled(last, drain)
            time.sleep(0.01)
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)", "holds_ms": holds,
           "first_piece_top": top(first, a.top), "last_piece_top": top(last, a.top)}
    for h in holds:
        print(h)
    for k in ("first_piece_top", "last_piece_top"):
        print(f"--- {k} over {a.loads} loads: cumulative ms, own ms, calls, function")
        print("\n".join(res[k]))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
