# Measures: where a cold first load_fd_lora spends host time beyond a later load (CPU profile).
"""Where a cold first `load_fd_lora` spends its host time beyond a later load (issue 26: 1.41 s on an H100 host,
0.75 s after the shipped warmup, later loads 0.34 s; target <= 0.5 s), profiled on CPU.

Model: the full-size SDXL UNet (fdlora.fixtures.fullsize: real config, random fp16 weights on the CPU) in a
UNet-only SDXL pipeline. Adapter: rank 32 on every attention, feed-forward and proj_in/proj_out linear, written
in the diffusers layout (bench_prefetch's file) or kohya's (`lora_unet_..._lora_down.weight` with alphas). In a
fresh process: the first load under cProfile, then a later load of the same file under a new name (RAM cache off,
so both read and convert), then each load's time by fd-lora stage. Prints the top functions by cumulative time
of both, and the first-minus-later difference per function, the host cost only a first load pays.

    python benchmarks/probes/probe_prefetch_cold.py [--format kohya] [--warmup] [--cpu-clock] [--out cold.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WEIGHTS = "pytorch_lora_weights.safetensors"


def write_kohya(unet, rank: int, folder: str) -> None:
    from safetensors.torch import save_file

    from fdlora.fixtures import fullsize
    from fdlora.layers import match_targets

    g = torch.Generator().manual_seed(1)
    dtype = next(unet.parameters()).dtype
    sd = {}
    for p in match_targets(unet, fullsize.SDXL_TARGETS):
        lin = unet.get_submodule(p)
        key = "lora_unet_" + p.replace(".", "_")
        sd[f"{key}.lora_down.weight"] = (torch.randn(rank, lin.in_features, generator=g)
                                         / lin.in_features ** 0.5).to(dtype)
        sd[f"{key}.lora_up.weight"] = (torch.randn(lin.out_features, rank, generator=g) * 0.02).to(dtype)
        sd[f"{key}.alpha"] = torch.tensor(float(rank))
    save_file(sd, os.path.join(folder, WEIGHTS))


def top(prof: cProfile.Profile) -> dict[str, tuple[int, float, float]]:
    st = pstats.Stats(prof)
    out = {}
    for (file, line, fn), (_, nc, tt, ct, _) in st.stats.items():
        where = f"{Path(file).name}:{line}:{fn}" if line else fn
        out[where] = (nc, tt, ct)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", choices=["diffusers", "kohya"], default="diffusers")
    ap.add_argument("--warmup", action="store_true", help="fdlora.integrations.warmup.warmup(pipe) before the load")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--no-profile", action="store_true", help="wall times only (cProfile inflates Python time)")
    ap.add_argument("--cpu-clock", action="store_true", help="time by this process's CPU clock, one torch thread "
                    "(steadier than the wall clock on a shared box; excludes waiting for the disk)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--narrow", action="store_true", help="SDXL's structure at 1/10 widths (_cpu_setup)")
    ap.add_argument("--ram-cache", action="store_true", help="the first load through the default RAM cache, as "
                    "bench_prefetch's cold rows load (its file read page-locked); the later one still without")
    a = ap.parse_args()
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    clock = time.process_time if a.cpu_clock else time.perf_counter
    if a.cpu_clock:
        torch.set_num_threads(1)
    import bench_prefetch as bp

    t0 = time.perf_counter()
    pipe, unet, *_ = bp.setup(False) if torch.cuda.is_available() else _cpu_setup(narrow=a.narrow)
    folder = tempfile.mkdtemp(prefix="fdlora-cold-")
    if a.format == "kohya":
        write_kohya(unet, 32, folder)
    else:
        bp.write_adapter(unet, 32, folder)
    Path(folder, WEIGHTS).read_bytes()
    print(f"model + file: {time.perf_counter() - t0:.1f} s", flush=True)
    import fdlora  # noqa: F401
    from fdlora.integrations.warmup import warmup

    res: dict = {"format": a.format, "warmup": a.warmup, "clock": "cpu" if a.cpu_clock else "wall"}
    phases = _phase_clock(clock)
    if a.warmup:
        t = clock()
        warmup(pipe)
        res["warmup_s"] = clock() - t
    profs = {}
    with torch.inference_mode():
        for key, name in (("first", "a"), ("later", "b")):
            prof = None if a.no_profile else cProfile.Profile(clock)
            t = clock()
            if prof:
                prof.enable()
            kw = {} if a.ram_cache and key == "first" else {"cache": None}
            report = pipe.load_fd_lora(folder, name, **kw)
            if prof:
                prof.disable()
                profs[key] = top(prof)
            res[f"{key}_load_s"] = clock() - t
            res[f"{key}_stages_s"] = {k: round(v, 4) for k, v in (report.seconds or {}).items()}
            res[f"{key}_phases_s"] = {k: round(v, 4) for k, v in phases.items()}  # (nested: wrap is in attach)
            phases.clear()
    print(json.dumps(res, indent=1))
    if profs:
        first, later = profs["first"], profs["later"]
        for key, prof in profs.items():
            print(f"\n--- {key} load: top {a.top} by cumulative time (calls, own s, cumulative s)")
            for where, (nc, tt, ct) in sorted(prof.items(), key=lambda kv: -kv[1][2])[:a.top]:
                print(f"{ct:8.3f} {tt:8.3f} {nc:8d}  {where}")
        print(f"\n--- first minus later, by own time: top {a.top}")
        diff = {w: (v[0] - later.get(w, (0, 0, 0))[0], v[1] - later.get(w, (0, 0, 0))[1]) for w, v in first.items()}
        for where, (dn, dt) in sorted(diff.items(), key=lambda kv: -kv[1][1])[:a.top]:
            print(f"{dt:8.3f} {dn:8d}  {where}")
        res["first_minus_later_own_s"] = {w: round(d[1], 4) for w, d in
                                          sorted(diff.items(), key=lambda kv: -kv[1][1])[:a.top]}
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


def _phase_clock(clock) -> dict[str, float]:
    """Seconds spent in the load's phases (reading, attaching, and inside attaching: wrapping, the pool's check and
    commit), summed per phase while a load runs: the methods are wrapped in place, for this probe only."""
    from fdlora.hub.pool import AdapterPool
    from fdlora.integrations.diffusers.pipeline import FdLoraPipelineMixin
    from fdlora.layers.model.handle import FdLoraHandle

    spent: dict[str, float] = {}
    for cls, name in ((FdLoraPipelineMixin, "_fd_read"), (FdLoraPipelineMixin, "_fd_attach"),
                      (FdLoraHandle, "wrap"), (AdapterPool, "check"), (AdapterPool, "make_room"),
                      (AdapterPool, "commit")):
        def timed(*args, _f=getattr(cls, name), _k=f"{cls.__name__}.{name}", **kwargs):
            t = clock()
            try:
                return _f(*args, **kwargs)
            finally:
                spent[_k] = spent.get(_k, 0.0) + clock() - t
        setattr(cls, name, timed)
    return spent


NARROW = dict(block_out_channels=(32, 64, 128), attention_head_dim=(1, 2, 4), cross_attention_dim=64,
              addition_time_embed_dim=8, projection_class_embeddings_input_dim=80)  # SDXL's structure, 1/10 widths


def _cpu_setup(narrow: bool = False):
    """bench_prefetch's setup at full size on the CPU (fp16 weights; nothing is run); `narrow`: the same structure
    (722 LoRA layers) at 1/10 widths (NARROW)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    from fdlora.fixtures import fullsize

    if narrow:
        with fullsize.built_on("cpu", torch.float16):
            unet = UNet2DConditionModel(**{**fullsize.SDXL_UNET, **NARROW}).eval().requires_grad_(False)
    else:
        unet = fullsize.sdxl_unet("cpu", torch.float16).requires_grad_(False)
    pipe = StableDiffusionXLPipeline(vae=None, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                     tokenizer_2=None, unet=unet, scheduler=EulerDiscreteScheduler())
    return pipe, unet


if __name__ == "__main__":
    main()
