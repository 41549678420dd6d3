"""Headline benchmark (issue 22): full-size SDXL UNet, Flux-dev transformer and Llama-3-8B with LoRA, fd-lora vs base.

Models come from fdlora.fixtures.fullsize (real configs, random weights built on the GPU in fp16 / bf16). Four r16
adapters a0..a3 are made as a user would, with PEFT (init_lora_weights=False, B scaled by 0.1 so that half-precision
comparisons mean something); diffusers+PEFT (or PEFT) is timed first as a reference (rows peft_*, target null) and
gives every oracle; then the model is converted in place with `fdlora.from_peft`. The base model is a second module
tree over the same weight tensors, so base and fd-lora run interleaved in one process without a second copy.

Per case: verification first (max |y - ref| / max |ref| within the dtype's tolerance and below half the LoRA's own
effect |ref - base|; per-prompt oracles are one PEFT call per adapter, the slider's is PEFT at the final weight;
generate16_mixed4 compares every step's logits with a float32 PEFT oracle teacher-forced on the generated tokens:
`verify_generation`), then interleaved rounds, each running base and the case once in rotated order, timed with CUDA
events around the whole step: host time included, eager LoRA steps are host-bound and that is the point. ms and
base_ms are medians,
x_base the median of the per-round ratios. peak_gib: max_memory_allocated during the case; cache_gib: merged-weight
copies held after it. A wrong case makes the exit code 1 (after the JSON is written); a compile failure is recorded
with ms null.

    python3 benchmarks/bench_fullsize.py --model sdxl --out $OUT/fullsize.json   # then --model flux / llama: merged
    python3 benchmarks/bench_fullsize.py --model flux --cases nocache_1 --profile nocache_1
    python3 benchmarks/bench_fullsize.py --model llama --smoke --out /tmp/f.json  # toy widths on CPU, seconds
    python3 benchmarks/bench_fullsize.py --model llama --swap-check  # exit 0: generate16_mixed4's check fails a swap
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fdlora  # noqa: E402
from fdlora.fixtures import fullsize  # noqa: E402
from fdlora.testing import step_ms  # noqa: E402  (the suite's one step timer)

warnings.filterwarnings("ignore")
TARGETS = {  # x_base targets; *_nocopy: the same step under set_merge_cache(0) (no merged copy of any weight)
    "sdxl": {"cache_1": 1.03, "cache_blend4": 1.05, "per_prompt_2": 1.10, "per_prompt_cfg": 1.15,
             "slider_every_step": 1.10, "nocache_1": 1.35, "per_prompt_2_nocopy": 1.20, "per_prompt_cfg_nocopy": 1.20},
    "flux": {"cache_1": 1.01, "cache_blend4": 1.02, "per_prompt_2": 1.05, "per_prompt_2_cache50": None,
             "slider_every_step": 1.08, "nocache_1": 1.20, "per_prompt_2_nocopy": 1.08, "compiled_regional_1": 1.05,
             "compiled_regional_slider": 1.10, "compile_time_x": 1.5},
    "llama": {"decode32_mixed4": 1.15, "generate16_mixed4": 1.30, "prefill2048_1": 1.03, "decode32_nocache_1": 1.25,
              "decode32_mixed4_nocopy": 1.15, "generate16_mixed4_nocopy": 1.20, "prefill2048_nocopy": 1.05},
}
# max |y - ref| / max |ref|: the two sides round differently at every layer (Llama widths, 2 layers, bf16, on a CPU:
# 0.012 per-call, 0.019 merged); the effect bound in Run.check is what tells a wrong adapter from a right one
TOL = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 1e-1}


class GC:
    """Time spent in Python's garbage collector (gc.callbacks), so a step's row says whether collections hit it."""
    ms, _t = 0.0, 0.0

    @classmethod
    def hook(cls, phase: str, info: dict) -> None:
        if phase == "start":
            cls._t = time.perf_counter()
        else:
            cls.ms += (time.perf_counter() - cls._t) * 1e3


gc.callbacks.append(GC.hook)
NAMES, BLEND, FINAL = ["a0", "a1", "a2", "a3"], [0.7, 0.5, 0.3, 0.2], 0.7


def cuda_step_ms(fn) -> tuple[float, float]:
    """(ms between CUDA events around fn, host ms until fn returned: its last launch)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t = time.perf_counter()
    fn()
    host = (time.perf_counter() - t) * 1e3
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host


class Run:
    """One invocation: device, dtype, rounds, which cases run, and the rows and failures recorded."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.model, self.smoke, self.profile, self.out_path = a.model, a.smoke, a.profile, a.out
        self.swap_check = a.swap_check
        self.dev = torch.device("cpu" if a.smoke else "cuda")
        self.dtype = torch.float32 if a.smoke else {"sdxl": torch.float16}.get(a.model, torch.bfloat16)
        self.rounds = a.rounds or (2 if a.smoke else 10)
        self.selected = set(a.cases.split(",")) if a.cases else None
        self.layers = 0  # fused LoRA layers of the converted model
        self.converted = None  # the converted model: each row records the path its layers took (dispatch_counts)
        self.rows: list[dict] = []
        from fdlora.kernels import registry  # the backend auto (or FDLORA_BACKEND) gives the models' linear layers

        self.backend = registry.select(registry.Problem(self.dev.type, self.dtype, "linear", 16, 4)).name
        self.failed: list[str] = []
        self.timing = ""  # the last interleaved timing's host / GC medians (notes)

    def wants(self, case: str) -> bool:
        return self.selected is None or case in self.selected or case.removeprefix("peft_") in self.selected

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def once_ms(self, fn) -> tuple[float, float, float]:
        """(step ms: CUDA events around it as fdlora.testing.step_ms, host ms until the step returned (its last
        launch), ms spent in Python's garbage collector during it)."""
        gc_before = GC.ms
        if self.dev.type != "cuda":
            ms = step_ms(fn, self.dev)
            return ms, ms, GC.ms - gc_before
        return (*cuda_step_ms(fn), GC.ms - gc_before)

    def interleaved(self, base, fn) -> tuple[float, float, float]:
        """(median ms, median base ms, median of per-round ratios); the order alternates so neither always follows
        the other (a step after a heavy one can run slower: clocks, allocator). The host side (time until the step's
        last launch returned) and GC time go to self.timing for the row's notes."""
        for f in (base, fn) * (1 if self.smoke else 2):
            f()
        t = {"base": [], "fn": []}
        for r in range(self.rounds):
            for k in (("base", "fn") if r % 2 else ("fn", "base")):
                t[k].append(self.once_ms(base if k == "base" else fn))
        med = {k: [statistics.median(v[i] for v in t[k]) for i in range(3)] for k in t}
        self.timing = (f"host ms {med['fn'][1]:.1f} (base {med['base'][1]:.1f}), gc ms {med['fn'][2]:.2f} "
                       f"(base {med['base'][2]:.2f})")
        print(f"    {self.timing}", flush=True)
        return (med["fn"][0], med["base"][0],
                statistics.median(x[0] / b[0] for x, b in zip(t["fn"], t["base"])))

    def check(self, case: str, y, ref, effect: float) -> tuple[float, str]:
        """Max error relative to max |ref|; a case fails outside the dtype's tolerance or when its error is not
        well below the LoRA's effect (then the check could not tell a wrong adapter from the right one)."""
        y, ref = out_of(y).double(), out_of(ref).double()
        err, scale = float((y - ref).abs().max()), float(ref.abs().max())
        rel = err / scale
        ok = bool(torch.isfinite(y).all()) and rel <= TOL[self.dtype] and err <= 0.5 * effect
        if not ok:
            self.failed.append(case)
        print(f"  verify {self.model} {case}: rel err {rel:.3g} (tol {TOL[self.dtype]:g}), LoRA effect "
              f"{effect / scale:.3g} of max|ref|  {'OK' if ok else 'WRONG'}", flush=True)
        return rel, f"effect {effect / scale:.3g}" + ("" if ok else "; WRONG: fails the check")

    def verdict(self, case: str, v: dict) -> tuple[float, str]:
        """A check made elsewhere (verify_generation's dict): recorded and printed like `check`'s."""
        if not v["ok"]:
            self.failed.append(case)
        print(f"  verify {self.model} {case}: {v['note']}  {'OK' if v['ok'] else 'WRONG'}", flush=True)
        return v["rel"], v["note"] + ("" if v["ok"] else "; WRONG: fails the check")

    def case(self, case: str, step, base, verify, notes: str = "") -> None:
        """verify() -> (y, ref, LoRA effect), or a verdict dict, first; then time `step` against `base` and record
        the row."""
        if not self.wants(case):
            return
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        got = verify()
        self.dispatch = fdlora.dispatch_counts(self.converted) if self.converted is not None else {}
        rel, note = self.verdict(case, got) if isinstance(got, dict) else self.check(case, *got)
        if self.profile == case:
            profile(self, step, base)
        ms, base_ms, x = self.interleaved(base, step)
        self.record(case, ms, base_ms, x, rel, "; ".join(n for n in (notes, note, self.timing) if n))

    def reference(self, case: str, step, base) -> None:
        """A diffusers+PEFT / PEFT row: timed like a case, no target; it is the oracle, so nothing is checked."""
        if self.wants(case):
            if self.dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            self.record(case, *self.interleaved(base, step), None, "reference: PEFT unmerged")

    def record(self, case, ms, base_ms, x, checked, notes) -> None:
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.dev.type == "cuda" else None
        self.rows.append({"model": self.model, "case": case, "ms": ms, "base_ms": base_ms, "x_base": x,
                          "target": TARGETS[self.model].get(case), "peak_gib": peak,
                          "cache_gib": fdlora.merge_cache_bytes() / 2**30, "checked": checked, "notes": notes,
                          "backend": self.backend, "dispatch": getattr(self, "dispatch", {})})
        print(f"  row {self.model} {case}: {ms} ms, base {base_ms} ms, x {x} (target {TARGETS[self.model].get(case)})",
              flush=True)


def out_of(y) -> torch.Tensor:
    y = y[0] if isinstance(y, tuple) else y
    return getattr(y, "sample", getattr(y, "logits", y))


def effect(ref, y_base) -> float:
    return float((out_of(ref).double() - out_of(y_base).double()).abs().max())


def shared_copy(model):
    """A second module tree over the same parameter and buffer tensors (no weight memory)."""
    return copy.deepcopy(model, memo={id(t): t for t in itertools.chain(model.parameters(), model.buffers())})


def scale_b(model, factor: float = 0.1) -> None:
    """PEFT's init_lora_weights=False draws B like A, far larger than a trained B. Measured (Llama widths, bf16, 2-4
    layers): error / LoRA effect 0.09-0.13 at 0.1, 0.17-0.28 at 0.05; Run.check fails a case above 0.5."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(factor)


def profile(r: Run, step, base) -> None:
    """torch.profiler over 3 steps (ops by self CPU time), then host time per step and per fused LoRA layer."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if r.dev.type == "cuda" else [])
    cpu_us = {}
    for name, fn in (("base", base), ("fd-lora", step)):
        fn()
        r.sync()
        with profile(activities=acts) as prof:
            for _ in range(3):
                fn()
            r.sync()
        cpu_us[name] = sum(e.self_cpu_time_total for e in prof.key_averages()) / 3
        if name == "fd-lora":
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    trace = os.environ.get("FDLORA_TRACE_DIR")  # one step of each as a Chrome trace (GPU idle gaps, syncs)
    for name, fn in (("base", base), ("fd-lora", step)) if trace else ():
        r.sync()
        with profile(activities=acts) as prof:
            fn()
            r.sync()
        prof.export_chrome_trace(str(Path(trace) / f"trace_{r.model}_{r.profile}_{name}.json"))
    wall = {}
    for name, fn in (("base", base), ("fd-lora", step)):  # host wall time up to the last launch (no sync inside)
        ts = []
        for _ in range(5):
            r.sync()
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e6)
        wall[name] = statistics.median(ts)
    layers, n = r.layers, max(r.layers, 1)
    python_profile(r, step, layers)
    print(f"host us per step: profiler CPU total fd-lora {cpu_us['fd-lora']:.0f} / base {cpu_us['base']:.0f}; "
          f"wall fd-lora {wall['fd-lora']:.0f} / base {wall['base']:.0f}\nhost us per LoRA layer ({layers} fused "
          f"layers): {(cpu_us['fd-lora'] - cpu_us['base']) / n:.2f} (profiler CPU), "
          f"{(wall['fd-lora'] - wall['base']) / n:.2f} (wall)", flush=True)


def python_profile(r: Run, step, layers: int, top: int = 20) -> None:
    """cProfile over 3 fd-lora steps: the Python functions by own time, per step and per fused layer (what
    torch.profiler does not see: the Python between ops, Triton's launcher)."""
    import cProfile
    import pstats

    r.sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        step()
    prof.disable()
    r.sync()
    stats = pstats.Stats(prof).stats  # {(file, line, fn): (cc, nc, tottime, cumtime, callers)}
    rows = sorted(((v[2], v[1], k) for k, v in stats.items()), reverse=True)[:top]
    print(f"python own time per step (cProfile, 3 steps; {layers} fused layers):")
    for tot, calls, (file, line, fn) in rows:
        where = f"{Path(file).name}:{line}" if line else file
        print(f"  {tot / 3 * 1e3:8.2f} ms/step  {calls / 3:8.0f} calls/step  {calls / 3 / max(layers, 1):6.2f}/layer"
              f"  {fn} ({where})")


# --- SDXL / Flux ---------------------------------------------------------------------------------------------------
def denoiser(r: Run) -> None:
    from peft import LoraConfig

    sdxl = r.model == "sdxl"
    if sdxl:
        model, targets = fullsize.sdxl_unet(r.dev, r.dtype, r.smoke), fullsize.SDXL_TARGETS
        tokens = fullsize.SDXL_TOKENS_TINY if r.smoke else fullsize.SDXL_TOKENS
        inp = {b: fullsize.sdxl_inputs(model, b, tokens) for b in (2, 4)}  # 2 = one prompt with CFG
    else:
        model, targets = fullsize.flux_transformer(r.dev, r.dtype, r.smoke), fullsize.FLUX_TARGETS
        tokens = fullsize.FLUX_TOKENS_TINY if r.smoke else fullsize.FLUX_TOKENS
        inp = {b: fullsize.flux_inputs(model, b, tokens) for b in (1, 2)}  # Flux-dev: guidance-distilled, no CFG
    xb = 2 if sdxl else 1
    x = inp[xb]
    base = shared_copy(model)
    with torch.device(r.dev):  # LoRA weights drawn on the device
        for i, n in enumerate(NAMES):
            torch.manual_seed(i + 1)
            model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets, init_lora_weights=False), n)
    scale_b(model)

    def per_prompt_ref(specs):  # one PEFT call per adapter, sample i from the call with its adapter
        ys = {}
        for n in dict.fromkeys(specs):
            model.set_adapters([n])
            ys[n] = out_of(model(**inp[len(specs)]))
        return torch.stack([ys[n][i] for i, n in enumerate(specs)])

    specs = {"per_prompt_2": ["a0", "a1"], "per_prompt_cfg": ["a0", "a1", "a0", "a1"]}  # CFG: uncond0, uncond1, ..
    with torch.inference_mode():
        y_base = {b: out_of(base(**kw)) for b, kw in inp.items()}
        ref = {}
        for key, names, ws in (("one", ["a0"], [1.0]), ("blend", NAMES, BLEND), ("slider", ["a0"], [FINAL])):
            model.set_adapters(names, ws)
            ref[key] = out_of(model(**x))
        ref |= {case: per_prompt_ref(sp) for case, sp in specs.items()
                if len(sp) in inp and (r.wants(case) or r.wants(f"{case}_nocopy"))}
        model.set_adapters(["a0"])
        r.reference("peft_cache_1", functools.partial(model, **x), functools.partial(base, **x))
        model.set_adapters(NAMES, BLEND)
        r.reference("peft_cache_blend4", functools.partial(model, **x), functools.partial(base, **x))

    # in place: PEFT's layers out, fused layers over the same nn.Linear objects in
    fd = r.converted = fdlora.from_peft(model)
    r.layers = len(fdlora.handle(fd).layers)
    print(f"  {r.layers} fused LoRA layers", flush=True)

    def checked(step, key, b=xb):
        return lambda: (step(), ref[key], effect(ref[key], y_base[b]))

    def per_prompt(sp):
        def step():
            with fdlora.per_sample(fd, sp):
                return fd(**inp[len(sp)])
        return step

    slide, slide_then_final = slider(fd, x)
    run, run_base = functools.partial(fd, **x), functools.partial(base, **x)
    with torch.inference_mode():
        fdlora.set_adapters(fd, ["a0"])
        r.case("cache_1", run, run_base, checked(run, "one"))
        fdlora.set_adapters(fd, NAMES, BLEND)
        r.case("cache_blend4", run, run_base, checked(run, "blend"), f"weights {BLEND}")
        fdlora.set_adapters(fd, ["a0"])
        for case, sp in specs.items():
            if len(sp) in inp:
                step = per_prompt(sp)
                r.case(case, step, functools.partial(base, **inp[len(sp)]), checked(step, case, len(sp)),
                       f"per_sample({sp})")
        if not sdxl and r.wants("per_prompt_2_cache50"):  # two 16 GiB blend copies do not fit the default 25%
            fdlora.set_merge_cache("50%")
            try:
                step = per_prompt(specs["per_prompt_2"])
                r.case("per_prompt_2_cache50", step, functools.partial(base, **inp[2]),
                       checked(step, "per_prompt_2", 2), "per_prompt_2 with set_merge_cache('50%'): room for a "
                       "merged copy per prompt's blend")
            finally:
                fdlora.set_merge_cache("auto")
        r.case("slider_every_step", slide, run_base, checked(slide_then_final, "slider"),
               "set_adapters(['a0'], [w]) inside the timed step, w cycling 0.1..1.0")
        fdlora.set_adapters(fd, ["a0"])
        fdlora.set_merge_cache(0)
        try:
            r.case("nocache_1", run, run_base, checked(run, "one"), "set_merge_cache(0)")
            for case, sp in specs.items():
                if len(sp) in inp:
                    step = per_prompt(sp)
                    r.case(f"{case}_nocopy", step, functools.partial(base, **inp[len(sp)]),
                           checked(step, case, len(sp)), f"per_sample({sp}), set_merge_cache(0)")
        finally:
            fdlora.set_merge_cache("auto")
        captured(r, fd, base, x, ref, effect(ref["one"], y_base[xb]))
        if not sdxl and any(r.wants(c) for c in COMPILED):
            compiled(r, fd, base, x, ref, effect(ref["one"], y_base[xb]))


def slider(fd, x):
    """(slide, slide_then_final): a step after moving a0's weight (cycling 0.1..1.0: every layer's merged weight is
    stale each time), and the check's form, which ends on FINAL after two other moves."""
    weights = itertools.cycle([i / 10 for i in range(1, 11)])

    def slide():
        fdlora.set_adapters(fd, ["a0"], [next(weights)])
        return fd(**x)

    def slide_then_final():
        for w in (0.3, 1.0, FINAL):
            fdlora.set_adapters(fd, ["a0"], [w])
            y = fd(**x)
        return y

    return slide, slide_then_final


CAPTURED = ("captured_1", "captured_vs_captured_base", "captured_slider")


def captured(r: Run, fd, base, x, ref, eff) -> None:
    """Steps as CUDA graphs (fdlora.capture_steps): fd-lora replays vs the eager base (what a user gains), vs the base
    captured the same way, and with the slider moved before every replay. No targets in the issue's table: rows
    for the README's captured-steps section."""
    if not any(r.wants(c) for c in CAPTURED):
        return
    if r.dev.type != "cuda":
        print("  captured steps: CUDA graphs need a GPU (smoke run: skipped)", flush=True)
        return
    run, run_base = functools.partial(fd, **x), functools.partial(base, **x)
    slide, slide_then_final = slider(fd, x)
    fdlora.set_adapters(fd, ["a0"])
    steps = fdlora.capture_steps(fd)
    try:
        r.case("captured_1", run, run_base, lambda: (run(), ref["one"], eff),
               "fdlora.capture_steps(model): CUDA-graph replays vs the eager base")
        fdlora.capture_steps(base)  # a module without fd-lora layers is captured the same way
        r.case("captured_vs_captured_base", run, run_base, lambda: (run(), ref["one"], eff),
               "both captured with fdlora.capture_steps")
        r.case("captured_slider", slide, run_base, lambda: (slide_then_final(), ref["slider"], eff),
               "set_adapters(['a0'], [w]) before every replay, w cycling 0.1..1.0; base captured")
        if r.rows and r.rows[-1]["case"] in CAPTURED:
            r.rows[-1]["notes"] += f"; graphs captured: fd-lora {steps.captures} (switches re-captured nothing)"
    finally:
        fdlora.release_steps(fd)
        fdlora.release_steps(base)


COMPILED = ("compile_time_x", "compiled_regional_1", "compiled_regional_slider")


def compiled(r: Run, fd, base, x, refs, eff) -> None:
    """Regional compilation (diffusers' compile_repeated_blocks, fullgraph) of the base and the frozen fd-lora trees:
    first-call wall times, steady-state steps (one adapter; the slider moved before every step), and whether adapter
    switches and slider moves recompile."""
    from torch._dynamo.utils import counters, guard_failures

    def graphs() -> tuple[int, int]:
        return counters["stats"]["unique_graphs"], sum(len(v) for v in guard_failures.values())

    backend = "eager" if r.smoke else "inductor"  # the smoke run checks the Dynamo path, not Inductor
    cases = [c for c in COMPILED if r.wants(c)]
    ref = refs["one"]
    try:
        fdlora.set_adapters(fd, ["a0"])
        fdlora.handle(fd).freeze()
        torch._inductor.config.force_disable_caches = True  # both first calls compile from scratch, run after run
        torch.compile(lambda t: t * 2 + 1, backend=backend)(torch.ones(8, device=r.dev))  # neither pays the import
        first, made = {}, {}
        for name, m in (("base", base), ("fd", fd)):
            m.compile_repeated_blocks(fullgraph=True, backend=backend)
            r.sync()
            g = graphs()[0]
            t = time.perf_counter()
            y = m(**x)
            r.sync()
            first[name], made[name] = time.perf_counter() - t, graphs()[0] - g
        rel, note = r.check("compile_time_x", y, ref, eff)
        if r.wants("compile_time_x"):
            r.record("compile_time_x", first["fd"] * 1e3, first["base"] * 1e3, first["fd"] / first["base"], rel,
                     f"first call with compilation: fd-lora {first['fd']:.1f} s, base {first['base']:.1f} s (Inductor "
                     f"caches off; base compiled first); Dynamo graphs made: base {made['base']}, fd-lora "
                     f"{made['fd']}; {note}")
        g0, f0 = graphs()
        r.case("compiled_regional_1", functools.partial(fd, **x), functools.partial(base, **x),
               lambda: (fd(**x), ref, eff), f"compile_repeated_blocks(fullgraph=True), backend {backend}")
        g1, f1 = graphs()
        for names, ws in ((["a0"], [0.3]), (["a0"], [0.9]), (["a1"], [1.0]), (NAMES, BLEND), (["a0"], [1.0])):
            fdlora.set_adapters(fd, names, ws)  # slider moves and switches after warm-up must not recompile
            fd(**x)
        g2, f2 = graphs()
        rel, _ = r.check("compiled_regional_1 after switches", fd(**x), ref, eff)  # back on a0: every switch seen
        if r.wants("compiled_regional_1"):
            r.rows[-1]["notes"] += (f"; recompiles in warm-up+timing: {g1 - g0} graphs, {f1 - f0} guard failures; "
                                    f"after 5 switches/slider moves: {g2 - g1} graphs, {f2 - f1} guard failures "
                                    f"(rel err after them {rel:.3g})")
        if r.wants("compiled_regional_slider"):
            slide, slide_then_final = slider(fd, x)
            g3, f3 = graphs()
            r.case("compiled_regional_slider", slide, functools.partial(base, **x),
                   lambda: (slide_then_final(), refs["slider"], eff),
                   f"compile_repeated_blocks(fullgraph=True), backend {backend}; set_adapters(['a0'], [w]) before "
                   "every step, w cycling 0.1..1.0")
            g4, f4 = graphs()
            r.rows[-1]["notes"] += f"; recompiles: {g4 - g3} graphs, {f4 - f3} guard failures"
    except Exception as e:  # recorded: the lead makes compilation work; the eager numbers stand
        msg = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:300]
        print(f"  compile failed: {msg}", flush=True)
        done = {c["case"] for c in r.rows}
        for case in cases:
            if case not in done:
                r.record(case, None, None, None, None, f"compile failed: {msg}")
    finally:
        fdlora.handle(fd).unfreeze()


# --- Llama ---------------------------------------------------------------------------------------------------------
class Decoder:
    """One decode step of `batch` rows over a static KV cache holding a `context`-token prompt. The cache advances its
    write position every call, but the mask follows the fixed cache_position: every step computes the same thing."""

    def __init__(self, model, batch: int, context: int, room: int, names=None) -> None:
        from transformers import StaticCache

        dev = next(model.parameters()).device
        g = torch.Generator(dev).manual_seed(2)
        vocab = model.config.vocab_size
        self.model, self.kw = model, ({} if names is None else {"adapter_names": names})
        self.cache = StaticCache(config=model.config, max_cache_len=context + room)
        prompt = torch.randint(0, vocab, (batch, context), generator=g, device=dev)
        model(input_ids=prompt, past_key_values=self.cache, use_cache=True, logits_to_keep=1,
              cache_position=torch.arange(context, device=dev), **self.kw)
        self.ids = torch.randint(0, vocab, (batch, 1), generator=g, device=dev)
        self.pos = torch.full((1,), context, device=dev, dtype=torch.long)
        self.position_ids = torch.full((batch, 1), context, device=dev, dtype=torch.long)

    def step(self):
        return self.model(input_ids=self.ids, past_key_values=self.cache, cache_position=self.pos,
                          position_ids=self.position_ids, use_cache=True, **self.kw).logits


EPS = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}  # one ulp at 1.0


def teacher_forced(model, prompts: torch.Tensor, tokens: torch.Tensor, names: list[str]) -> torch.Tensor:
    """[new, B, V] logits that predicted each of `tokens` [B, new] after `prompts` [B, T]: one forward over the whole
    sequence (no KV cache), row i with adapter names[i] (PEFT's adapter_names)."""
    seq = torch.cat([prompts, tokens[:, :-1]], 1)
    out = model(input_ids=seq, attention_mask=torch.ones_like(seq), use_cache=False, logits_to_keep=tokens.shape[1],
                adapter_names=list(names))
    return out.logits.transpose(0, 1)


def rotated(names: list[str]) -> list[str]:
    """Each row's adapter moved one row down (with 4 adapters over the rows, every row gets another one)."""
    return names[-1:] + names[:-1]


def verify_generation(generated: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor],
                      oracle, prompts: torch.Tensor, names: list[str]) -> dict:
    """Check mixed-adapter greedy generation against a higher-precision oracle, step by step on its own tokens.

    generated / reference: (tokens [B, new], per-step logits [new, B, V]) of the model under test and of the
    reference (PEFT in the same dtype), each from its own generate(adapter_names=names). `oracle` is the reference
    model in a wider dtype (float32 for a bf16 run, float64 for float32). Each side's logits are compared with the
    oracle's teacher-forced logits of that side's own tokens, at every step, so a greedy token that flips on a
    near-tie changes what is compared, never whether it compares. Rules:
    - err (max |logits - oracle|) <= 4 x the reference's own error + 4 ulps of max |oracle| (the dtype's error as
      the reference implementation makes it on the same path: KV cache, same adapters);
    - err <= 0.5 x what moving each row's adapter to the next row changes in the oracle's logits (`swap`), or the
      check could not tell a swapped adapter from the right one;
    - every logit finite.
    Returns ok, rel (err / max |oracle|), err, limit, swap, ref_err, flips (steps whose token is not the oracle's
    argmax) and a one-line note."""
    tokens, logits = generated
    want = teacher_forced(oracle, prompts, tokens, names)
    wide, want = str(want.dtype).removeprefix("torch."), want.double()
    ref_want = teacher_forced(oracle, prompts, reference[0], names).double()
    swapped = teacher_forced(oracle, prompts, tokens, rotated(names)).double()
    err = float((logits.double() - want).abs().max())
    ref_err = float((reference[1].double() - ref_want).abs().max())
    scale = float(want.abs().max())
    limit = 4 * ref_err + 4 * EPS[logits.dtype] * scale
    swap = float((swapped - want).abs().max())
    ok = bool(torch.isfinite(logits).all()) and err <= limit and err <= 0.5 * swap
    flips = int((want.argmax(-1) != tokens.t()).any(1).sum())
    note = (f"teacher-forced vs {wide} oracle over {tokens.shape[1]} steps: "
            f"err {err:.3g} (limit {limit:.3g} = 4 x PEFT's {ref_err:.3g} + 4 ulps), adapters moved one row: "
            f"{swap:.3g}; {flips} step(s) off the oracle's argmax")
    return {"ok": ok, "rel": err / scale, "err": err, "limit": limit, "swap": swap, "ref_err": ref_err,
            "flips": flips, "note": note}


def llm(r: Run) -> None:
    from peft import LoraConfig, get_peft_model

    tiny = r.smoke
    B, ctx, G, new, prefill = (4, 16, 4, 4, 32) if tiny else (32, 128, 16, 32, 2048)
    room = 2 * r.rounds + 24  # decode steps one Decoder runs (verify, warm-up, rounds, profile)
    model = fullsize.llama(r.dev, r.dtype, tiny)
    base = shared_copy(model)
    with torch.device(r.dev):
        cfg = LoraConfig(r=16, lora_alpha=16, target_modules=fullsize.LLAMA_TARGETS, init_lora_weights=False)
        torch.manual_seed(1)
        peft = get_peft_model(model, cfg, adapter_name="a0")
        for i in range(1, 4):
            torch.manual_seed(i + 1)
            peft.add_adapter(f"a{i}", cfg)
    scale_b(peft)
    peft.set_adapter("a0")
    peft.eval()
    mixed, gmixed = [NAMES[i % 4] for i in range(B)], [NAMES[i % 4] for i in range(G)]
    g = torch.Generator(r.dev).manual_seed(3)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prefill), generator=g, device=r.dev)
    prompts = torch.randint(0, vocab, (G, ctx), generator=g, device=r.dev)
    gen_kw = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  pad_token_id=0)

    def generate(m, names=None, logits=False):
        kw = {} if names is None else {"adapter_names": names}
        out = m.generate(prompts, **gen_kw, **kw, output_logits=logits, return_dict_in_generate=logits)
        return (out.sequences[:, ctx:], torch.stack(out.logits)) if logits else out

    def prefill_of(m):
        return lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    with torch.inference_mode():
        yb = {"dec": Decoder(base, B, ctx, room).step(), "pre": prefill_of(base)()}
        ref = {"dec": Decoder(peft, B, ctx, room).step(), "pre": prefill_of(peft)(),
               "mixed": Decoder(peft, B, ctx, room, mixed).step(), "gen": generate(peft, gmixed, True)}
        if r.wants("peft_decode32_mixed4") and not r.swap_check:
            r.reference("peft_decode32_mixed4", Decoder(peft, B, ctx, room, mixed).step,
                        Decoder(base, B, ctx, room).step)
    # generate16_mixed4's oracle: the PEFT model in float32 (float64 for a float32 run), before conversion
    oracle = (copy.deepcopy(peft).to(torch.float64 if r.dtype == torch.float32 else torch.float32)
              if r.wants("generate16_mixed4") or r.wants("generate16_mixed4_nocopy") else None)

    fd = r.converted = fdlora.from_peft(peft)
    r.layers = len(fdlora.handle(fd).layers)
    print(f"  {r.layers} fused LoRA layers", flush=True)

    def check_generate(names=gmixed):
        return verify_generation(generate(fd, names, True), ref["gen"], oracle, prompts, gmixed)

    if r.swap_check:  # the check itself, shown to fail on a generation whose rows' adapters were moved
        with torch.inference_mode():
            r.verdict("generate16_mixed4", check_generate(rotated(gmixed)))
        return
    with torch.inference_mode():
        d, db = Decoder(fd, B, ctx, room, mixed), Decoder(base, B, ctx, room)
        r.case("decode32_mixed4", d.step, db.step, lambda: (d.step(), ref["mixed"], effect(ref["mixed"], yb["dec"])),
               f"{B} rows x 1 token over a {ctx}-token KV cache, adapter_names mixing 4")
        r.case("generate16_mixed4", lambda: generate(fd, gmixed), lambda: generate(base), check_generate,
               f"{G} x {ctx}-token prompts, {new} new tokens, greedy, adapter_names mixing 4")
        if not r.wants("generate16_mixed4_nocopy"):
            del oracle  # (float32 Llama-3-8B: the memory the rows after it need)
        run = prefill_of(fd)
        r.case("prefill2048_1", run, prefill_of(base), lambda: (run(), ref["pre"], effect(ref["pre"], yb["pre"])),
               f"1 x {prefill} tokens, last position's logits")
        fdlora.set_merge_cache(0)
        try:
            d = Decoder(fd, B, ctx, room)
            r.case("decode32_nocache_1", d.step, db.step, lambda: (d.step(), ref["dec"], effect(ref["dec"], yb["dec"])),
                   "set_merge_cache(0)")
            d = Decoder(fd, B, ctx, room, mixed)
            r.case("decode32_mixed4_nocopy", d.step, db.step,
                   lambda: (d.step(), ref["mixed"], effect(ref["mixed"], yb["dec"])),
                   "decode32_mixed4, set_merge_cache(0)")
            r.case("generate16_mixed4_nocopy", lambda: generate(fd, gmixed), lambda: generate(base),
                   check_generate, "generate16_mixed4, set_merge_cache(0)")
            r.case("prefill2048_nocopy", run, prefill_of(base),
                   lambda: (run(), ref["pre"], effect(ref["pre"], yb["pre"])), "prefill2048_1, set_merge_cache(0)")
        finally:
            fdlora.set_merge_cache("auto")


# --- report --------------------------------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:  # the Llama rows need no diffusers
        return None


def environment(r: Run) -> dict:

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent).stdout.strip() or None
    from fdlora.kernels import registry

    linear = registry.select(registry.Problem(r.dev.type, r.dtype, "linear", 16, 4))
    return {"device": torch.cuda.get_device_name() if r.dev.type == "cuda" else "cpu (smoke: timings meaningless)",
            "backend": str(linear), "torch": torch.__version__, "triton": triton_v, "diffusers": _version("diffusers"),
            "peft": _version("peft"), "transformers": _version("transformers"), "git_sha": sha}


def write(path: Path, env: dict, rows: list[dict]) -> None:
    """Merge into an existing file: this run's (model, case) rows replace older ones, others stay."""
    data = json.loads(path.read_text()) if path.exists() else {}
    new = {(c["model"], c["case"]) for c in rows}
    cases = [c for c in data.get("cases", []) if (c["model"], c["case"]) not in new] + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**data, **env, "cases": cases}, indent=1))
    print(f"wrote {path}")


def table(rows: list[dict]) -> None:
    def f(v, spec):
        return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))

    print(f"\n{'model':6} {'case':22} {'ms':>9} {'base ms':>9} {'x base':>7} {'target':>6} {'checked':>8} "
          f"{'peak GiB':>8} {'cache GiB':>9}")
    for c in rows:
        over = c["x_base"] is not None and c["target"] is not None and c["x_base"] > c["target"]
        print(f"{c['model']:6} {c['case']:22} {f(c['ms'], '9.2f')} {f(c['base_ms'], '9.2f')} "
              f"{f(c['x_base'], '7.3f')} {f(c['target'], '6.2f')} {f(c['checked'], '8.2g')} "
              f"{f(c['peak_gib'], '8.1f')} {f(c['cache_gib'], '9.2f')}{'  over target' if over else ''}")


def median_row(runs: list[dict]) -> dict:
    """One case's row from its fresh-process runs: the median run's, with every run's x_base, their min and max."""
    xs = sorted(c["x_base"] for c in runs if c["x_base"] is not None)
    row = dict(sorted(runs, key=lambda c: (c["x_base"] is None, c["x_base"] or 0))[len(runs) // 2] if xs else runs[0])
    row.update(runs_x_base=[c["x_base"] for c in runs], x_base_min=xs[0] if xs else None,
               x_base_max=xs[-1] if xs else None, fresh_runs=len(runs))
    return row


def combine(files: list[Path], out: Path, note: str | None, sha: str | None) -> int:
    """Rows from per-run JSON files (`--one-process --cases CASE --out FILE`, one fresh process each, as a device
    call that runs cases on several GPUs at once writes them), each case's median run, merged into `out`; `sha`: the
    code the runs measured, on each row (a device's copy of the tree may report another commit)."""
    by_case: dict[tuple[str, str], list[dict]] = {}
    env: dict = {}
    for f in files:
        data = json.loads(f.read_text())
        env = {k: v for k, v in data.items() if k != "cases"}
        for c in data["cases"]:
            by_case.setdefault((c["model"], c["case"]), []).append(c)
    rows = [median_row(runs) | ({"git_sha": sha} if sha else {}) for runs in by_case.values()]
    method = "each case alone in a fresh process, the median run's row"
    write(out, {**env, "method": method, **({"note": note} if note else {})}, rows)
    table(rows)
    return 0


def fresh(args: argparse.Namespace) -> int:
    """Each case alone in a fresh process, `args.runs` times: state an earlier case leaves (caches, autotuning,
    dispatch decisions, allocator pools) cannot decide a number. A case's row is its median run's, with every run's
    x_base and their min and max, written to --out as soon as its runs end (a timeout keeps the cases finished before
    it); the exit code is 1 if any run failed its verification."""
    cases = args.cases.split(",") if args.cases else [c for c in TARGETS[args.model] if c != "compile_time_x"]
    rows, failed, env = [], False, {}
    method = f"each case alone in a fresh process, {args.runs} runs, the median run's row"
    for case in cases:
        runs = []
        for i in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "row.json"
                cmd = [sys.executable, __file__, "--model", args.model, "--cases", case, "--one-process", "--out",
                       str(out)] + (["--rounds", str(args.rounds)] if args.rounds else [])
                print(f"== {args.model} {case}: fresh process {i + 1}/{args.runs}", flush=True)
                failed |= subprocess.run(cmd).returncode != 0
                if out.exists():
                    data = json.loads(out.read_text())
                    env = {k: v for k, v in data.items() if k != "cases"}
                    runs += [c for c in data["cases"] if c["case"] == case]
        if runs:
            rows.append(median_row(runs))
            if args.out:
                write(args.out, {**env, "method": method}, rows)
    table(rows)
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(TARGETS), required=True)
    ap.add_argument("--out", type=Path, help="JSON file; cases of other models (or not rerun) already in it are kept")
    ap.add_argument("--cases", help="comma-separated case names (a peft_ row runs with its fd-lora case)")
    ap.add_argument("--rounds", type=int, help="interleaved timing rounds (default 10; smoke 2)")
    ap.add_argument("--smoke", action="store_true", help="toy widths on CPU: every code path, meaningless timings")
    ap.add_argument("--profile", metavar="CASE", help="torch.profiler over 3 steps of CASE: host ops, host us/layer")
    ap.add_argument("--one-process", action="store_true",
                    help="run the cases one after another in this process (profiling); by default each case runs "
                         "alone in a fresh process, --runs times, and its row is the median run's")
    ap.add_argument("--runs", type=int, default=3, help="fresh-process runs per case (default 3)")
    ap.add_argument("--swap-check", action="store_true",
                    help="llama: run only generate16_mixed4's check, on a generation with each row's adapter moved to "
                         "the next row; exit 0 when the check fails as it must, 1 when it passes")
    ap.add_argument("--combine", nargs="+", type=Path, metavar="RUN_JSON",
                    help="write --out from per-run JSON files (each case's median run) and exit; with --note")
    ap.add_argument("--note", help="with --combine: the file's note (code, backend, how the runs were made)")
    ap.add_argument("--sha", help="with --combine: the commit the runs measured, stamped on each row")
    if "--combine" in sys.argv:  # (no --model needed)
        for a in ap._actions:
            a.required = False
    args = ap.parse_args()
    if args.combine:
        if not args.out:
            ap.error("--combine needs --out")
        return combine(args.combine, args.out, args.note, args.sha)
    if not (args.one_process or args.smoke or args.profile or args.swap_check):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: the running case's process is killed
        return fresh(args)
    r = Run(args)
    if r.swap_check and (r.model != "llama" or r.out_path):
        ap.error("--swap-check runs llama's generate16_mixed4 check only and writes no JSON: --model llama, no --out")
    if r.smoke:
        torch.set_num_threads(1)  # toy ops: threads only contend (CI runners, shared machines)
    if r.dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (use --smoke for a CPU run of the code paths)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: still write the cases measured so far
    t0 = time.time()
    print(f"bench_fullsize {r.model} on {r.dev} ({r.dtype}), {r.rounds} rounds", flush=True)
    try:
        (llm if r.model == "llama" else denoiser)(r)
    finally:  # a crash keeps the cases measured before it
        print(f"{r.model}: {time.time() - t0:.0f} s")
        if r.out_path:
            write(r.out_path, environment(r), r.rows)
    if r.swap_check:
        caught = "generate16_mixed4" in r.failed
        print("swap check: the generation check " + ("FAILED on swapped adapters, as it must" if caught else
                                                       "PASSED swapped adapters: it cannot tell them apart"))
        return 0 if caught else 1
    table(r.rows)
    if r.failed:
        print(f"WRONG (failed verification): {', '.join(r.failed)}", file=sys.stderr)
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
