"""Adapter load latency: an SDXL-size LoRA from the local Hub cache and from the RAM cache into GPU slot pools.

The adapter: rank 32 on every attention (to_q/k/v/out.0) and feed-forward (ff.net.0.proj, ff.net.2)
linear of an SDXL UNet at real widths (320/640/1280, cross-attention 2048; `--depth` scales the
transformer blocks per level, 1.0 = SDXL's 1/2/10), plus q/k/v/out_proj/fc1/fc2 of both text
encoders (CLIP-L 768 x 12 layers, bigG 1280 x 32 layers, scaled the same way). Models are built on
the device with random weights; nothing is downloaded. The file (diffusers layout with the
`lora_adapter_metadata` header, as `save_lora_weights` writes) is published into a fresh local HF
cache and everything runs with HF_HUB_OFFLINE=1.

Timed, each from call to synchronised device (median of --repeats):
  hub-cache  `load_adapters(repo)` with an empty RAM cache (resolve via refs, read, convert, pin)
             + loading into the three components' `AdapterPool`s            target <= 100 ms
  ram-cache  the same call answered by the RAM cache + the pool loads       target <= 20 ms
  diffusers  `pipe.load_lora_weights(repo, weight_name=..., adapter_name=...)` (diffusers + PEFT)
It verifies first: UNet and text-encoder outputs with the fd-lora load match diffusers+PEFT's.

    python benchmarks/bench_load.py --out benchmarks/results/<gpu>/load.json          # GPU, SDXL size
    python benchmarks/bench_load.py --tiny --device cpu --out /tmp/load.json          # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO = "bench/sdxl-lora"
WEIGHTS = "pytorch_lora_weights.safetensors"
UNET_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")
TE_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--tiny", action="store_true", help="toy widths (CPU smoke test of the script)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--depth", type=float, default=1.0, help="fraction of SDXL's transformer blocks / TE layers")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of each fd-lora load path")
    return ap.parse_args()


def configs(tiny: bool, depth: float) -> tuple[dict, dict, dict]:
    def n(x: int) -> int:
        return max(1, round(x * depth))

    if tiny:
        unet = dict(block_out_channels=(32, 64), layers_per_block=2, transformer_layers_per_block=(1, 2),
                    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
                    cross_attention_dim=64, addition_time_embed_dim=8, projection_class_embeddings_input_dim=80,
                    sample_size=16)
        te1 = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2)
        te2 = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, projection_dim=32)
    else:
        unet = dict(block_out_channels=(320, 640, 1280), layers_per_block=2,
                    transformer_layers_per_block=(1, n(2), n(10)),
                    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                    attention_head_dim=(5, 10, 20), cross_attention_dim=2048, addition_time_embed_dim=256,
                    projection_class_embeddings_input_dim=2816, sample_size=32)
        te1 = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=n(12))
        te2 = dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=20, num_hidden_layers=n(32),
                   projection_dim=1280)
    unet.update(in_channels=4, out_channels=4, use_linear_projection=True, addition_embed_type="text_time",
                norm_num_groups=32)
    for te in (te1, te2):
        te.update(vocab_size=1000, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return unet, te1, te2


def build(device, dtype, tiny: bool, depth: float, seed: int = 0) -> dict:
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    u, t1, t2 = configs(tiny, depth)
    torch.manual_seed(seed)
    with torch.device(device):  # random init on the device: seconds instead of minutes on the host
        models = {"unet": UNet2DConditionModel(**u), "text_encoder": CLIPTextModel(CLIPTextConfig(**t1)),
                  "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**t2))}
    return {k: m.to(dtype).eval().requires_grad_(False) for k, m in models.items()}


def adapter_file(models: dict, rank: int, dtype) -> tuple[bytes, int]:
    """The diffusers-layout file (with the metadata header) and the number of LoRA modules in it."""
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(1)
    sd, meta = {}, {}
    for comp, model in models.items():
        targets = UNET_TARGETS if comp == "unet" else TE_TARGETS
        paths = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(targets)]
        for p in paths:
            lin = model.get_submodule(p)
            sd[f"{comp}.{p}.lora_A.weight"] = (torch.randn(rank, lin.in_features, generator=g)
                                               / lin.in_features ** 0.5).to(dtype)
            sd[f"{comp}.{p}.lora_B.weight"] = (torch.randn(lin.out_features, rank, generator=g) * 0.02).to(dtype)
        meta.update({f"{comp}.r": rank, f"{comp}.lora_alpha": rank, f"{comp}.target_modules": list(targets)})
    return save(sd, {"format": "pt", "lora_adapter_metadata": json.dumps(meta)}), len(sd) // 2


def unet_inputs(unet, device, dtype) -> dict:
    import torch

    c = unet.config
    g = torch.Generator().manual_seed(0)
    text = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim

    def r(*s):
        return torch.randn(*s, generator=g).to(device, dtype)

    return {"sample": r(1, 4, 16, 16), "timestep": torch.tensor(10, device=device),
            "encoder_hidden_states": r(1, 8, c.cross_attention_dim),
            "added_cond_kwargs": {"text_embeds": r(1, text), "time_ids": r(1, 6)}}


def main() -> None:
    a = args()
    cache = tempfile.mkdtemp(prefix="fdlora-bench-hub-")
    os.environ.update(HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                      HF_HUB_DISABLE_TELEMETRY="1", TRANSFORMERS_VERBOSITY="error", DIFFUSERS_VERBOSITY="error")
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from support.hubcache import populate  # the same hand-made cache layout the tests use

    from fdlora.hub import AdapterCache, AdapterPool, add_to_pools, load_adapters
    from fdlora.layers import FdLoraHandle

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, a.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rank = 4 if a.tiny and a.rank == 32 else a.rank

    t = time.perf_counter()
    fd_models = build(device, dtype, a.tiny, a.depth)
    ref_models = build(device, dtype, a.tiny, a.depth)
    build_s = time.perf_counter() - t
    data, n_modules = adapter_file(fd_models, rank, dtype)
    commit, _ = populate(cache, REPO, {WEIGHTS: data})

    pools = {c: AdapterPool(FdLoraHandle(m, max_slots=2, max_rank=rank)) for c, m in fd_models.items()}

    phases: dict[str, list[dict[str, float]]] = {"hub_cache": [], "ram_cache": []}

    def fd_load(name: str, ram, record: str | None = None):
        adapters, report = load_adapters(REPO, cache=ram)
        t = time.perf_counter()
        add_to_pools(pools, adapters, name, activate=True)
        sync()
        if record:  # where the time goes: load_adapters' own phases, then the pools (check, stage, commit)
            phases[record].append({**{k: v * 1e3 for k, v in report.seconds.items()},
                                   "pools": (time.perf_counter() - t) * 1e3})
        return report

    # --- verify: fd-lora and diffusers+PEFT give the same outputs --------------------------------
    report = fd_load("check", None)
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline(vae=None, text_encoder=ref_models["text_encoder"],
                                     text_encoder_2=ref_models["text_encoder_2"], tokenizer=None, tokenizer_2=None,
                                     unet=ref_models["unet"], scheduler=EulerDiscreteScheduler())
    pipe.load_lora_weights(REPO, weight_name=WEIGHTS, adapter_name="check")
    errors = {}
    with torch.no_grad():
        x = unet_inputs(fd_models["unet"], device, dtype)
        ya, yb = fd_models["unet"](**x).sample.float(), ref_models["unet"](**x).sample.float()
        errors["unet"] = float((ya - yb).abs().max() / yb.abs().max())
        ids = torch.tensor([[0, 5, 7, 9, 1]], device=device)
        for c in ("text_encoder", "text_encoder_2"):
            za, zb = fd_models[c](ids).last_hidden_state.float(), ref_models[c](ids).last_hidden_state.float()
            errors[c] = float((za - zb).abs().max() / zb.abs().max())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert all(e < tol for e in errors.values()), f"fd-lora and diffusers+PEFT disagree: {errors}"
    for p in pools.values():
        p.delete("check")
    pipe.delete_adapters("check")

    # --- time: each run loads under a new name, then the adapter is deleted again ------------------
    step = iter(range(10**9))
    ram = AdapterCache()

    def fd_hub_cache() -> str:
        name = f"fd{next(step)}"
        fd_load(name, AdapterCache(), "hub_cache")  # an empty RAM cache: read + convert + pin
        return name

    def fd_ram_cache() -> str:
        name = f"fd{next(step)}"
        fd_load(name, ram, "ram_cache")
        return name

    def fd_delete(name: str) -> None:
        for p in pools.values():
            p.delete(name)

    def diffusers_load() -> str:
        name = f"d{next(step)}"
        pipe.load_lora_weights(REPO, weight_name=WEIGHTS, adapter_name=name)
        return name

    def timed(load, delete, repeats: int) -> tuple[float, list[float]]:
        delete(load())  # warm-up: imports, page cache, the RAM cache entry
        times = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            name = load()
            sync()
            times.append((time.perf_counter() - t) * 1e3)
            delete(name)
        return statistics.median(times), times

    if a.profile:
        import cProfile
        import pstats

        for load in (fd_hub_cache, fd_ram_cache):
            fd_delete(load())
            pr = cProfile.Profile()
            pr.enable()
            name = load()
            sync()
            pr.disable()
            fd_delete(name)
            print(f"== profile {load.__name__}")
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
            pstats.Stats(pr).sort_stats("cumulative").print_stats(40)
    hub_ms, hub_all = timed(fd_hub_cache, fd_delete, a.repeats)
    ram_ms, ram_all = timed(fd_ram_cache, fd_delete, a.repeats)
    diff_ms, diff_all = timed(diffusers_load, pipe.delete_adapters, max(3, a.repeats // 2))

    import diffusers
    import huggingface_hub
    import peft
    import transformers

    result = {
        "benchmark": "load", "tiny": a.tiny, "depth": a.depth, "dtype": a.dtype, "rank": rank,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        or platform.machine(),
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__,
                     "transformers": transformers.__version__, "huggingface_hub": huggingface_hub.__version__},
        "git_sha": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                  cwd=ROOT).stdout.strip(),
        "adapter": {"modules": n_modules, "file_mb": len(data) / 1e6, "components": report.components,
                    "commit": commit},
        "verify_max_rel_error": errors, "build_models_s": build_s,
        "fdlora_hub_cache_ms": hub_ms, "fdlora_ram_cache_ms": ram_ms, "diffusers_peft_load_lora_weights_ms": diff_ms,
        "all_ms": {"hub_cache": hub_all, "ram_cache": ram_all, "diffusers": diff_all},
        "phases_median_ms": {w: {k: statistics.median(p[k] for p in runs[1:]) for k in runs[-1]}
                             for w, runs in phases.items() if len(runs) > 1},  # (runs[0]: the warm-up)
        "hub_cache_GBps": len(data) / 1e9 / (hub_ms / 1e3),
        "speedup_vs_diffusers": {"hub_cache": diff_ms / hub_ms, "ram_cache": diff_ms / ram_ms},
        "targets_ms": {"hub_cache": 100.0, "ram_cache": 20.0},
        "met": {"hub_cache": hub_ms <= 100.0, "ram_cache": ram_ms <= 20.0},
    }
    print(f"{n_modules} LoRA modules, {len(data) / 1e6:.1f} MB, {a.dtype}, on {result['device']}")
    print(f"  fd-lora from the local Hub cache : {hub_ms:8.1f} ms  (target <= 100 ms)")
    print(f"  fd-lora from the RAM cache       : {ram_ms:8.1f} ms  (target <= 20 ms)")
    print(f"  diffusers+PEFT load_lora_weights : {diff_ms:8.1f} ms")
    for w, ph in result["phases_median_ms"].items():
        print(f"  {w} phases (median ms): " + ", ".join(f"{k} {v:.1f}" for k, v in ph.items()))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
