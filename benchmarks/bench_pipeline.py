"""Denoiser steps with LoRA: base vs diffusers+PEFT (unmerged) vs fd-lora, same weights, one process.

SDXL UNet (batch 2 = CFG, 1024x1024 -> 128x128 latents, fp16) and Flux transformer (4096 image +
512 text tokens, bf16) at real widths with fewer blocks (`--depth`), random weights built on the
device. LoRA r16 on to_q/k/v/out, ff and proj_in/out (Flux: its attention, ff, proj_mlp/proj_out).
Cases: 1 adapter, and a 4-adapter blend. Also: `set_adapters` latency with 4 and with 50 adapters
loaded (diffusers+PEFT with 4), switching the active set, and a 4-prompt batch with 4 different
adapters (per-sample) vs 4 separate calls. Every case is checked against diffusers+PEFT first.

    python benchmarks/bench_pipeline.py --out benchmarks/results/<gpu>/pipeline.json
    python benchmarks/bench_pipeline.py --tiny --device cpu          # smoke test of the script
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch

from fdlora.testing import step_ms

warnings.filterwarnings("ignore")

SDXL_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out"]
FLUX_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"]


def sdxl(tiny: bool, depth: int, dev, dtype):
    from diffusers import UNet2DConditionModel

    if tiny:
        cfg = dict(block_out_channels=(32, 64), layers_per_block=2, sample_size=16, down_block_types=(
            "DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
            addition_time_embed_dim=8, transformer_layers_per_block=(1, 2),
            projection_class_embeddings_input_dim=80, cross_attention_dim=64, norm_num_groups=32)
        B, lat, seq, ctx, pooled = 2, 16, 8, 64, 32
    else:
        cfg = dict(block_out_channels=(320, 640, 1280), layers_per_block=2, sample_size=128,
                   down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                   up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                   attention_head_dim=(5, 10, 20), use_linear_projection=True, addition_embed_type="text_time",
                   addition_time_embed_dim=256, transformer_layers_per_block=(1, 2, depth),
                   projection_class_embeddings_input_dim=2816, cross_attention_dim=2048)
        B, lat, seq, ctx, pooled = 2, 128, 77, 2048, 1280
    with torch.device(dev):
        model = UNet2DConditionModel(**cfg).to(dtype).eval()
    g = torch.Generator(dev).manual_seed(0)
    inputs = dict(sample=torch.randn(B, 4, lat, lat, device=dev, dtype=dtype, generator=g),
                  timestep=torch.tensor(500, device=dev),
                  encoder_hidden_states=torch.randn(B, seq, ctx, device=dev, dtype=dtype, generator=g),
                  added_cond_kwargs={"text_embeds": torch.randn(B, pooled, device=dev, dtype=dtype, generator=g),
                                     "time_ids": torch.randn(B, 6, device=dev, dtype=dtype, generator=g)})
    return model, inputs, SDXL_TARGETS


def flux(tiny: bool, depth: int, dev, dtype):
    from diffusers import FluxTransformer2DModel

    if tiny:
        cfg = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
        img, txt, cin, ctx, pooled = 64, 16, 16, 32, 32
    else:
        cfg = dict(patch_size=1, in_channels=64, num_layers=max(1, depth // 2), num_single_layers=depth,
                   attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                   pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56])
        img, txt, cin, ctx, pooled = 4096, 512, 64, 4096, 768
    with torch.device(dev):
        model = FluxTransformer2DModel(**cfg).to(dtype).eval()
    g = torch.Generator(dev).manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, img, cin, device=dev, dtype=dtype, generator=g),
                  encoder_hidden_states=torch.randn(1, txt, ctx, device=dev, dtype=dtype, generator=g),
                  pooled_projections=torch.randn(1, pooled, device=dev, dtype=dtype, generator=g),
                  timestep=torch.tensor([0.5], device=dev, dtype=dtype),
                  img_ids=torch.zeros(img, 3, device=dev, dtype=dtype),
                  txt_ids=torch.zeros(txt, 3, device=dev, dtype=dtype), return_dict=False)
    if cfg.get("guidance_embeds"):
        inputs["guidance"] = torch.tensor([3.5], device=dev, dtype=dtype)
    return model, inputs, FLUX_TARGETS


def out_of(y):
    y = y[0] if isinstance(y, tuple) else y
    return y.sample if hasattr(y, "sample") else y


def timer(dev, repeats):
    def ms(fn):
        with torch.inference_mode():
            fn()
            fn()
            if dev.type != "cuda":
                ts = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    fn()
                    ts.append((time.perf_counter() - t) * 1e3)
                return statistics.median(ts)
            ts = []
            for _ in range(repeats):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b))
            return statistics.median(ts)
    return ms


def interleaved(fns: dict, dev, rounds: int) -> dict[str, tuple[float, float]]:
    """{name: (median ms, median over rounds of ms / that round's "base" ms)}; each round runs every fn once,
    in an order rotated from round to round (a step that follows a heavy one can run slower: clocks, allocator)."""
    times = {k: [] for k in fns}
    names = list(fns)
    with torch.inference_mode():
        for fn in fns.values():
            fn()
            fn()
        for r in range(rounds):  # each round starts at the next variant: no variant always follows the same one
            for k in names[r % len(names):] + names[:r % len(names)]:
                times[k].append(step_ms(fns[k], dev))
    return {k: (statistics.median(v), statistics.median(x / b for x, b in zip(v, times["base"])))
            for k, v in times.items()}


def host_ms(fn, n=50):
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def fold(base, adapters):
    """A copy of `base` with the adapters folded into its weights (W + sum w * alpha/r * B A, fp32, one cast)."""
    m = copy.deepcopy(base)
    with torch.no_grad():
        for ad, w in adapters:
            for path, lora in ad.modules.items():
                W = m.get_submodule(path).weight
                delta = w * lora.scaling(ad.use_rslora) * (lora.B.float() @ lora.A.float())
                W.copy_((W.float() + delta).to(W.dtype))
    return m


def bench_model(name, build, a, dev, dtype):
    from peft import LoraConfig

    import fdlora
    from fdlora.integrations.transformers import adapter_from_peft

    base, inputs, targets = build(a.tiny, a.depth, dev, dtype)
    ms = timer(dev, a.repeats)
    res = {"model": name}
    res["base_ms"] = ms(lambda: base(**inputs))
    names = [f"style{i}" for i in range(4)]
    peft_m = copy.deepcopy(base)
    for i, n in enumerate(names):
        torch.manual_seed(i)
        peft_m.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets, init_lora_weights=False), n)
    adapters = {n: adapter_from_peft(peft_m, n) for n in names}
    for ad in adapters.values():
        for m in ad.modules.values():
            m.B.mul_(0.05)  # keep random LoRAs small enough for meaningful fp16 comparisons
    peft_m = copy.deepcopy(base)
    for n in names:
        peft_m.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets), n)
        for path, m in adapters[n].modules.items():
            layer = peft_m.get_submodule(path)
            layer.lora_A[n].weight.data.copy_(m.A)
            layer.lora_B[n].weight.data.copy_(m.B)
    fd_m = copy.deepcopy(base)
    handle = fdlora.inject(fd_m, targets, max_slots=4, max_rank=16)
    for n in names:
        handle.add_adapter(adapters[n], n, activate=False)
    res["layers"] = len(handle.layers)
    res["backend"] = str(next(iter(handle.layers.values())).selection.name)
    oracle = copy.deepcopy(peft_m).float()  # PEFT in fp32: eager's own fp16/bf16 error bounds the check
    inputs32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in inputs.items()}
    if "added_cond_kwargs" in inputs:
        inputs32["added_cond_kwargs"] = {k: v.float() for k, v in inputs["added_cond_kwargs"].items()}
    with torch.inference_mode():
        y_base = out_of(base(**inputs)).float()
        for case, ns, ws in (("1 adapter", names[:1], [1.0]), ("4-adapter blend", names, [0.7, 0.5, 0.3, 0.2])):
            peft_m.set_adapters(ns, ws)
            handle.set_adapters(ns, ws)
            oracle.set_adapters(ns, ws)
            y_o = out_of(oracle(**inputs32)).float()
            y_p = out_of(peft_m(**inputs)).float()
            peft_err, effect = float((y_p - y_o).abs().max()), float((y_p - y_base).abs().max())
            for limit, how in (("auto", "fd-lora"), (0, "fd-lora per-call")):
                fdlora.set_merge_cache(limit)
                fd_err = float((out_of(fd_m(**inputs)).float() - y_o).abs().max())
                res[f"check {case} {how}"] = {"fdlora_err_vs_fp32": fd_err, "peft_err_vs_fp32": peft_err,
                                               "lora_effect": effect}
                print(f"  verify {name} {case}: {how} err {fd_err:.3g}, PEFT err {peft_err:.3g}, "
                      f"LoRA effect {effect:.3g}")
                assert fd_err <= 3 * peft_err + 1e-3 * effect, f"{name} {case} {how}: err {fd_err} vs PEFT {peft_err}"
            fdlora.set_merge_cache("auto")
            folded = fold(base, [(adapters[n], w) for n, w in zip(ns, ws)])
            # interleaved rounds (each variant once per round, ratio to that round's base): a host-bound step
            # drifts with the machine's load, and interleaving keeps every ratio within one round
            rounds = interleaved({"base": lambda: base(**inputs), "merged": lambda f=folded: f(**inputs),
                                  "peft": lambda: peft_m(**inputs), "fdlora": lambda: fd_m(**inputs)}, dev, a.repeats)
            res[f"fdlora {case} merge cache MB"] = fdlora.merge_cache_bytes() / 2**20
            fdlora.set_merge_cache(0)  # the per-call paths (what compiled / captured models run)
            percall = interleaved({"base": lambda: base(**inputs), "fdlora per-call": lambda: fd_m(**inputs)},
                                  dev, a.repeats)
            fdlora.set_merge_cache("auto")
            del folded
            for k, (t_ms, ratio) in {**rounds, **percall}.items():
                res[f"{k} {case} ms"] = t_ms
                if k != "base":
                    res[f"{k} {case} x base"] = ratio
    del oracle
    # switching
    step = iter(range(10**9))
    res["fdlora set_adapters weight change ms (4 loaded)"] = host_ms(
        lambda: handle.set_adapters(names, [next(step) % 9 / 9, 0.5, 0.3, 0.2]))
    res["fdlora switch active set ms (4 loaded)"] = host_ms(lambda: handle.set_adapters([names[next(step) % 4]]))
    res["diffusers+peft set_adapters weight change ms (4 loaded)"] = host_ms(
        lambda: peft_m.set_adapters(names, [next(step) % 9 / 9, 0.5, 0.3, 0.2]), n=10)
    # per-sample: a batch whose samples each use another adapter vs one call per adapter (SDXL: CFG pairs)
    if name == "sdxl":
        big = {k: (torch.cat([v] * 4) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 2 else v)
               for k, v in inputs.items()}
        big["added_cond_kwargs"] = {k: torch.cat([v] * 4) for k, v in inputs["added_cond_kwargs"].items()}
        specs = [n for n in names for _ in range(2)]
        with handle.per_sample(specs):
            res["fdlora 4 prompts x 4 adapters, one batch ms"] = ms(lambda: fd_m(**big))

        def separate():
            for n in names:
                handle.set_adapters([n])
                fd_m(**inputs)

        res["fdlora 4 prompts x 4 adapters, 4 calls ms"] = ms(separate)
    # 50 adapters loaded
    peft_m = None  # free the PEFT copy before growing the banks
    handle.grow(max_slots=52)
    for i in range(46):
        handle.add_adapter(adapters[names[i % 4]], f"extra{i}", activate=False)
    res["fdlora set_adapters weight change ms (50 loaded)"] = host_ms(
        lambda: handle.set_adapters(names, [next(step) % 9 / 9, 0.5, 0.3, 0.2]))
    res["fdlora switch active set ms (50 loaded)"] = host_ms(lambda: handle.set_adapters([f"extra{next(step) % 46}"]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--depth", type=int, default=4, help="SDXL: transformer blocks at 1280 (10 real); Flux: single"
                    " blocks (38 real), double blocks = depth // 2 (19 real)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--models", default="sdxl,flux")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    dev = torch.device(a.device)
    results = {"benchmark": "pipeline denoiser steps", "device": torch.cuda.get_device_name() if dev.type == "cuda"
               else platform.machine(), "torch": torch.__version__, "depth": a.depth, "tiny": a.tiny,
               "git_sha": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()}
    import diffusers
    import peft

    results["diffusers"], results["peft"] = diffusers.__version__, peft.__version__
    builders = {"sdxl": (sdxl, torch.float16), "flux": (flux, torch.bfloat16)}
    for m in a.models.split(","):
        build, dtype = builders[m]
        r = bench_model(m, build, a, dev, torch.float32 if dev.type == "cpu" else dtype)
        results[m] = r
        print(f"\n== {m} ({r['layers']} fused layers, backend {r['backend']}), base {r['base_ms']:.2f} ms")
        for k, v in r.items():
            if isinstance(v, float):
                print(f"  {k:58s} {v:9.3f}")
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
