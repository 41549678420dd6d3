"""Memory pressure on the full-size SDXL UNet (issue 28): wherever diffusers+PEFT runs a step, fd-lora must too.

Each side gets the same UNet (fp16, real config, random weights built on the GPU) with two PEFT r16 adapters on
attn+ff+proj, then, for each free-memory level (after the model and its adapters are on the GPU), a filler tensor
takes the rest and the side runs: a step on one adapter, a switch to the other, a 2-blend, and for fd-lora a
per-prompt batch. A step passes when it returns finite outputs equal (within the dtype's tolerance, and well below
the LoRA's effect) to the same step with memory to spare; an out-of-memory is recorded as such. At the lowest level a
32-image batch then runs out of memory inside the step (the error must reach the caller), and every step runs again
("<step>_after_oom": the adapters must still give the same outputs). Rows go to
benchmarks/results/reliability.json under "gpu" -> the device name -> "pressure".

    python3 benchmarks/bench_pressure.py --out benchmarks/results/reliability.json   # GPU, ~3 min
    python3 benchmarks/bench_pressure.py --smoke                                     # toy widths on CPU, no filler
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_fullsize import scale_b  # noqa: E402  (B scaled as a trained B is: the headline bench's adapters)

import fdlora  # noqa: E402
from fdlora.fixtures import fullsize  # noqa: E402

warnings.filterwarnings("ignore")
GIB = 1 << 30
LEVELS = (3.0, 2.0, 1.5, 1.0)  # GiB free once the model and its adapters are on the GPU
TOL = 3e-2  # fp16, relative to max |y| (the fullsize bench's bound)


def build(dev: torch.device, smoke: bool):
    """The UNet with PEFT adapters a0, a1 (B scaled down as a trained B is), and its inputs (batch 2: one CFG
    prompt; batch 4: per-prompt with CFG)."""
    from peft import LoraConfig

    dtype = torch.float32 if smoke else torch.float16
    unet = fullsize.sdxl_unet(dev, dtype, smoke)
    tokens = fullsize.SDXL_TOKENS_TINY if smoke else fullsize.SDXL_TOKENS
    with torch.device(dev):
        for i, name in enumerate(("a0", "a1")):
            torch.manual_seed(i + 1)
            unet.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=fullsize.SDXL_TARGETS,
                                        init_lora_weights=False), name)
    scale_b(unet)
    return unet, {b: fullsize.sdxl_inputs(unet, b, tokens) for b in (2, 4)}


def steps(side: str, unet, inp: dict) -> dict:
    """name -> a step returning the UNet's output, on `side`'s API."""
    if side == "diffusers+peft":
        def on(names, weights=None):
            def run():
                unet.set_adapters(names, weights)
                return unet(**inp[2]).sample
            return run
        return {"one": on(["a0"]), "switch": on(["a1"]), "blend": on(["a0", "a1"], [0.7, 0.5])}

    def fd(names, weights=None):
        def run():
            fdlora.set_adapters(unet, names, weights)
            return unet(**inp[2]).sample
        return run

    def per_prompt():
        with fdlora.per_sample(unet, ["a0", "a1", "a0", "a1"]):
            return unet(**inp[4]).sample
    return {"one": fd(["a0"]), "switch": fd(["a1"]), "blend": fd(["a0", "a1"], [0.7, 0.5]), "per_prompt": per_prompt}


def fill(dev: torch.device, free_gib: float) -> torch.Tensor | None:
    """A tensor that leaves `free_gib` of device memory free (None on the CPU)."""
    if dev.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    take = int(free - free_gib * GIB)
    return torch.empty(max(take, 0), dtype=torch.uint8, device=dev) if take > 0 else None


def run_side(side: str, dev: torch.device, smoke: bool) -> list[dict]:
    unet, inp = build(dev, smoke)
    if side == "fd-lora":
        unet = fdlora.from_peft(unet)
    base_in = inp[2]
    calls = steps(side, unet, inp)
    rows = []
    oversized = fullsize.sdxl_inputs(unet, 32, fullsize.SDXL_TOKENS_TINY if smoke else fullsize.SDXL_TOKENS)
    with torch.inference_mode():
        want = {name: fn().float().cpu() for name, fn in calls.items()}  # memory to spare
        effect = float((want["one"] - _base(side, unet, base_in).float().cpu()).abs().max())

        def check(level, free, name, fn) -> dict:
            row = {"side": side, "free_gib": level, "free_measured_gib": free, "step": name}
            try:
                got, ref = fn().float().cpu(), want[name.removesuffix("_after_oom")]
                err = float((got - ref).abs().max()) / float(ref.abs().max())
                ok = bool(torch.isfinite(got).all()) and err <= TOL and err * float(ref.abs().max()) <= 0.5 * effect
                row.update(outcome="ok" if ok else "wrong", rel_err=err)
            except torch.OutOfMemoryError as e:
                row.update(outcome="oom", error=str(e).splitlines()[0][:160])
            if dev.type == "cuda":
                torch.cuda.synchronize()
            print(f"  {side:15} free {level} GiB  {name:18} {row['outcome']}", flush=True)
            return row

        for level in (LEVELS if dev.type == "cuda" else (None,)):
            filler = fill(dev, level)
            free = torch.cuda.mem_get_info()[0] / GIB if dev.type == "cuda" else None
            rows += [check(level, free, name, fn) for name, fn in calls.items()]
            if level == LEVELS[-1]:  # a real out-of-memory inside a step (a 32-image batch), then every step again
                try:
                    unet(**oversized)
                    outcome = "no oom"
                except torch.OutOfMemoryError:
                    outcome = "oom raised"
                rows.append({"side": side, "free_gib": level, "step": "oversized_batch", "outcome": outcome})
                print(f"  {side:15} free {level} GiB  oversized_batch    {outcome}", flush=True)
                rows += [check(level, free, f"{name}_after_oom", fn) for name, fn in calls.items()]
            del filler
    del unet, calls
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _base(side: str, unet, kw: dict) -> torch.Tensor:
    """The step without adapters (the LoRA's effect is measured against it)."""
    if side == "diffusers+peft":
        unet.disable_adapters()
        try:
            return unet(**kw).sample
        finally:
            unet.enable_adapters()
    fdlora.disable(unet)
    try:
        return unet(**kw).sample
    finally:
        fdlora.enable(unet)


def write(path: Path, device: str, rows: list[dict]) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("gpu", {}).setdefault(device, {})["pressure"] = rows
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="reliability.json to merge the rows into")
    ap.add_argument("--smoke", action="store_true", help="toy widths on CPU, no filler: the code paths only")
    a = ap.parse_args()
    dev = torch.device("cpu" if a.smoke else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (use --smoke for a CPU run of the code paths)")
    rows = run_side("diffusers+peft", dev, a.smoke) + run_side("fd-lora", dev, a.smoke)
    missed = [(r["free_gib"], r["step"]) for r in rows if r["side"] == "fd-lora" and r["outcome"] != "ok"
              and any(p["side"] == "diffusers+peft" and p["free_gib"] == r["free_gib"] and p["step"] == r["step"]
                      and p["outcome"] == "ok" for p in rows)]
    print("fd-lora fails where diffusers+PEFT runs: " + (", ".join(f"{s} at {f} GiB" for f, s in missed) or "none"))
    if a.out:
        write(a.out, torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)", rows)
    return 1 if missed or any(r["outcome"] == "wrong" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
