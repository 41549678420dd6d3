# Measures: a per-prompt step without merged copies: the extension's bound per-sample forms vs percall's torch forms.
# Showed: GPU time x base 1.26 vs 1.29 (SDXL 2 prompts), 1.21 vs 1.28 (CFG), 1.06 vs 1.08 (Flux). per_prompt_forms.json
"""Where an eager per-prompt step without merged copies spends its time, in two forms of its LoRA layers:

- bound: the CUDA extension's per-sample forms (fdlora.layers.fastpath.percall: BoundSamples, where each blend is
  merged by one cuBLASLt matmul reading W in place, then the batch's GEMMs; its lora_linear for few rows);
- torch: the same layers with the extension's `prepare_samples` hidden, so percall's torch forms run (baddbmm and
  bmm, one addmm per blend, or the delta in four ops).

Per form: the step against the base (interleaved, CUDA events, host time included: eager steps are host-bound),
the host time to enqueue one step, and the GPU time of its kernels (torch.profiler); both checked against the first
form's output. One process, the forms in turn: an explanation, not a headline (bench_fullsize.py has those).

    PYTHONPATH=. python benchmarks/probes/probe_per_prompt_forms.py --model sdxl --out /tmp/forms.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from probe_per_prompt import kernels  # noqa: E402  (this folder: the script's own)

import fdlora  # noqa: E402
from fdlora.fixtures import fullsize  # noqa: E402
from fdlora.testing import step_ms  # noqa: E402


def build(model_name: str, tiny: bool):
    from peft import LoraConfig

    dev = "cpu" if tiny else "cuda"
    if model_name == "flux":
        model = fullsize.flux_transformer(dev, torch.float32 if tiny else torch.bfloat16, tiny=tiny)
        targets, tokens = fullsize.FLUX_TARGETS, fullsize.FLUX_TOKENS_TINY if tiny else fullsize.FLUX_TOKENS
    else:
        model = fullsize.sdxl_unet(dev, torch.float32 if tiny else torch.float16, tiny=tiny)
        targets, tokens = fullsize.SDXL_TARGETS, fullsize.SDXL_TOKENS_TINY if tiny else fullsize.SDXL_TOKENS
    with torch.device(dev):
        for i, n in enumerate(("a0", "a1")):
            torch.manual_seed(i + 1)
            model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets, init_lora_weights=False), n)
    if model_name == "flux":  # guidance-distilled: no CFG batch
        specs = {"per_prompt_2": ["a0", "a1"]}
        inputs = {2: fullsize.flux_inputs(model, 2, tokens)}
    else:
        specs = {"per_prompt_2": ["a0", "a1"], "per_prompt_cfg": ["a0", "a1", "a0", "a1"]}
        inputs = {b: fullsize.sdxl_inputs(model, b, tokens) for b in (2, 4)}
    return fdlora.from_peft(model), specs, inputs, dev


def forget_kept(model) -> None:
    """Every layer's kept hot path dropped: the next call takes the full decision (and records its path)."""
    for lay in fdlora.handle(model).layers.values():
        lay.merged.hot = None


@contextlib.contextmanager
def torch_forms(model):
    """The extension's per-sample forms hidden from every layer's ops module (percall checks for them when it
    decides), the kept calls dropped on the way in and out."""
    forget_kept(model)
    mods = {id(m._ops): m._ops for m in fdlora.handle(model).layers.values()}
    kept = {k: mod.__dict__.pop("prepare_samples") for k, mod in mods.items() if "prepare_samples" in mod.__dict__}
    try:
        yield
    finally:
        for k, fn in kept.items():
            mods[k].prepare_samples = fn
        forget_kept(model)


def host_ms(fn, dev: str, n: int = 5) -> float:
    """Host time to enqueue one step (the GPU idle at its start), median."""
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    ts = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    sync()
    return statistics.median(ts)


def out_of(y) -> torch.Tensor:
    y = y[0] if isinstance(y, tuple) else y
    return getattr(y, "sample", y).float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("sdxl", "flux"), default="sdxl")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU: checks the script only")
    args = ap.parse_args()
    fd, specs, inputs, dev = build(args.model, args.tiny)
    fdlora.set_merge_cache(0)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "model": args.model, "cases": {}}
    with torch.inference_mode():
        fdlora.set_adapters(fd, ["a0"])
        for case, sp in specs.items():
            x = inputs[len(sp)]

            def base(x=x):
                return fd(**x)

            def prompts(x=x, sp=sp):
                with fdlora.per_sample(fd, sp):
                    return fd(**x)

            fdlora.disable(fd)
            y_base = out_of(base())
            fdlora.enable(fd)
            first, rows = None, {}
            for form, scope in (("bound", contextlib.nullcontext), ("torch", lambda: torch_forms(fd))):
                with scope():
                    forget_kept(fd)
                    y = out_of(prompts())
                    first = y if first is None else first
                    paths = fdlora.dispatch_counts(fd)
                    rb, rp = [], []
                    for _ in range(args.rounds):
                        fdlora.disable(fd)
                        rb.append(step_ms(base, dev))
                        fdlora.enable(fd)
                        rp.append(step_ms(prompts, dev))
                    fdlora.disable(fd)
                    hb, gb = host_ms(base, dev), kernels(base)["kernels_ms"]
                    fdlora.enable(fd)
                    hp, gp = host_ms(prompts, dev), kernels(prompts)["kernels_ms"]
                    rows[form] = {
                        "x_base": statistics.median(p / b for p, b in zip(rp, rb)), "ms": statistics.median(rp),
                        "base_ms": statistics.median(rb), "host_ms": hp, "host_base_ms": hb, "gpu_ms": gp,
                        "gpu_base_ms": gb, "gpu_x": gp / gb if gb else None,
                        "err_vs_first": ((y - first).abs().max() / first.abs().max()).item(),
                        "effect": ((first - y_base).abs().max() / first.abs().max()).item(),
                        "dispatch": paths}
                r = rows[form]
                print(f"{args.model} {case} {form:5s}: x{r['x_base']:.3f} ({r['ms']:.1f} / {r['base_ms']:.1f} ms), "
                      f"host {r['host_ms']:.1f} / {r['host_base_ms']:.1f} ms, GPU {r['gpu_ms']:.1f} / "
                      f"{r['gpu_base_ms']:.1f} ms, err {r['err_vs_first']:.1e}, {r['dispatch']}", flush=True)
            res["cases"][case] = rows
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
