"""Breadth benchmark (issue 27): one denoiser step per diffusers family, base vs fd-lora vs diffusers+PEFT.

Per family: the full-size transformer config (random weights, built on the GPU in bf16), inside its
pipeline class with every other component None; four r16 LoRAs on every Linear of the blocks, written
with the pipeline's own `save_lora_weights`. Rows: base; diffusers+PEFT (`load_lora_weights`) with 1
adapter and a 4-blend (these also give the oracles); then, after `unload_lora_weights`, fd-lora
(`load_fd_lora`) with 1 adapter and the 4-blend, each verified against PEFT's output (max |y - ref| /
max |ref| within TOL and below half the LoRA's own effect) before it is timed. ms are medians over
rounds of CUDA-event-timed steps (`fdlora.testing.step_ms`), x_base the ratio to the base median.

    python3 benchmarks/bench_breadth.py --out $OUT/breadth.json                 # every family in FULL, GPU
    python3 benchmarks/bench_breadth.py --family flux wan21 --out $OUT/b.json
    python3 benchmarks/bench_breadth.py --smoke --out /tmp/breadth.json         # tiny configs on CPU, ~1 min

Smoke mode builds the tiny configs of tests/integrations/diffusers/families.py (every family the tests cover).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fdlora  # noqa: E402,F401  (attaches pipe.load_fd_lora)
from fdlora.fixtures.fullsize import built_on  # noqa: E402
from fdlora.testing import step_ms  # noqa: E402

warnings.filterwarnings("ignore")
TOL = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 1e-1}
NAMES, BLEND = ["a0", "a1", "a2", "a3"], [0.7, 0.5, 0.3, 0.2]


def _tiny():
    if "fdlora_bench_families" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fdlora_bench_families",
                                                      ROOT / "tests/integrations/diffusers/families.py")
        mod = sys.modules["fdlora_bench_families"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules["fdlora_bench_families"]


# --- full-size configs (published model configs) and one step's inputs -------------------------------------
def _flux_in(B, dev, dt):
    side, txt = 64, 512
    r, c = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    ids = torch.stack([torch.zeros_like(r), r, c], -1).reshape(-1, 3).to(dev, dt)
    return dict(hidden_states=torch.randn(B, side * side, 64, device=dev, dtype=dt),
                encoder_hidden_states=torch.randn(B, txt, 4096, device=dev, dtype=dt),
                pooled_projections=torch.randn(B, 768, device=dev, dtype=dt),
                timestep=torch.full((B,), .5, device=dev), img_ids=ids,
                txt_ids=torch.zeros(txt, 3, device=dev, dtype=dt),
                guidance=torch.full((B,), 3.5, device=dev))


def _wan_in(B, dev, dt):  # 480x832, 33 frames: latents 16 x 9 x 60 x 104 -> 14040 tokens
    return dict(hidden_states=torch.randn(B, 16, 9, 60, 104, device=dev, dtype=dt),
                encoder_hidden_states=torch.randn(B, 512, 4096, device=dev, dtype=dt),
                timestep=torch.full((B,), 500, device=dev, dtype=torch.long))


def _qwen_in(B, dev, dt):  # 1024^2: 4096 packed tokens
    return dict(hidden_states=torch.randn(B, 4096, 64, device=dev, dtype=dt),
                encoder_hidden_states=torch.randn(B, 256, 3584, device=dev, dtype=dt),
                encoder_hidden_states_mask=torch.ones(B, 256, device=dev, dtype=torch.long),
                timestep=torch.full((B,), 1.0, device=dev), img_shapes=[(1, 64, 64)] * B)


def _sd3_in(B, dev, dt):  # 1024^2: 128x128 latents, patch 2
    return dict(hidden_states=torch.randn(B, 16, 128, 128, device=dev, dtype=dt),
                encoder_hidden_states=torch.randn(B, 333, 4096, device=dev, dtype=dt),
                pooled_projections=torch.randn(B, 2048, device=dev, dtype=dt),
                timestep=torch.full((B,), 500, device=dev, dtype=torch.long))


def _hunyuan_in(B, dev, dt):  # 320x512, 33 frames: 16 x 9 x 40 x 64 latents, patch 2 -> 5760 tokens
    return dict(hidden_states=torch.randn(B, 16, 9, 40, 64, device=dev, dtype=dt),
                timestep=torch.full((B,), 500.0, device=dev), guidance=torch.full((B,), 6000.0, device=dev),
                encoder_hidden_states=torch.randn(B, 256, 4096, device=dev, dtype=dt),
                encoder_attention_mask=torch.ones(B, 256, device=dev), pooled_projections=torch.randn(
                    B, 768, device=dev, dtype=dt))


def _ltx_in(B, dev, dt):  # 512x768, 97 frames: 13 x 16 x 24 latent tokens
    return dict(hidden_states=torch.randn(B, 13 * 16 * 24, 128, device=dev, dtype=dt),
                encoder_hidden_states=torch.randn(B, 128, 4096, device=dev, dtype=dt),
                timestep=torch.full((B,), 500, device=dev, dtype=torch.long),
                encoder_attention_mask=torch.ones(B, 128, device=dev).bool(), num_frames=13, height=16, width=24)


FULL = {  # family: (pipeline, model class, config, inputs)
    "flux": ("FluxPipeline", "FluxTransformer2DModel",
             dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                  axes_dims_rope=(16, 56, 56)), _flux_in),
    "wan21": ("WanPipeline", "WanTransformer3DModel",
              dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                   out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6), _wan_in),
    "qwenimage": ("QwenImagePipeline", "QwenImageTransformer2DModel",
                  dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                       num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                       axes_dims_rope=(16, 56, 56)), _qwen_in),
    "sd35": ("StableDiffusion3Pipeline", "SD3Transformer2DModel",
             dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                  num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm"), _sd3_in),
    "hunyuanvideo": ("HunyuanVideoPipeline", "HunyuanVideoTransformer3DModel",
                     dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
                          num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2,
                          patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096,
                          pooled_projection_dim=768, rope_axes_dim=(16, 56, 56)), _hunyuan_in),
    "ltxvideo": ("LTXPipeline", "LTXVideoTransformer3DModel",
                 dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                      attention_head_dim=64, cross_attention_dim=2048, num_layers=28,
                      qk_norm="rms_norm_across_heads", caption_channels=4096), _ltx_in),
}


def build(family: str, smoke: bool, dev: torch.device, dt: torch.dtype):
    import inspect

    import diffusers

    if smoke:
        F = _tiny()
        pipe = F.build(family)
        return pipe, lambda B: F.SPECS[family].inputs(B)
    pipe_name, model_name, cfg, inputs = FULL[family]
    cls = getattr(diffusers, pipe_name)
    torch.manual_seed(0)
    with built_on(dev, dt):
        model = getattr(diffusers, model_name)(**cfg).eval()
    params = inspect.signature(cls.__init__).parameters
    comps = {p: None for p in list(params)[1:] if params[p].default is inspect.Parameter.empty}
    comps["transformer"] = model
    pipe = cls(**comps)
    pipe.set_progress_bar_config(disable=True)
    return pipe, lambda B: inputs(B, dev, dt)


def lora_dirs(pipe, rank: int, n: int = 4) -> list[str]:
    """n random r-`rank` LoRAs on every Linear inside the blocks, saved with the pipeline's save_lora_weights."""
    import re

    tr, dirs = pipe.transformer, []
    for i in range(n):
        g = torch.Generator(next(tr.parameters()).device).manual_seed(i + 1)
        sd = {}
        for path, m in tr.named_modules():
            if isinstance(m, nn.Linear) and re.search(r"\.\d+\.", path):
                p = m.weight
                sd[f"{path}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g, device=p.device,
                                                          dtype=p.dtype) / m.in_features ** .5
                sd[f"{path}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g, device=p.device,
                                                          dtype=p.dtype) * 0.1
        d = tempfile.mkdtemp(prefix=f"fdlora-breadth-{i}-")
        type(pipe).save_lora_weights(d, transformer_lora_layers={k: v.cpu() for k, v in sd.items()})
        dirs.append(d)
    return dirs


def step(model, x):
    with torch.no_grad():
        out = model(**x, return_dict=False)[0]
    return torch.stack(list(out)) if isinstance(out, (list, tuple)) else out


def timed(fn, dev, rounds: int) -> float:
    fn()
    return statistics.median(step_ms(fn, dev) for _ in range(rounds))


def bench_family(family: str, a) -> tuple[list[dict], list[str]]:
    dev = torch.device("cpu" if a.smoke else "cuda")
    dt = torch.float32 if a.smoke else torch.bfloat16
    pipe, inputs = build(family, a.smoke, dev, dt)
    x = inputs(1)
    tr = pipe.transformer
    rows, bad = [], []
    base_y = step(tr, x)
    base_ms = timed(lambda: step(tr, x), dev, a.rounds)
    rows.append(dict(family=family, case="base", ms=base_ms, x_base=1.0))
    dirs = lora_dirs(pipe, a.rank)
    refs = {}
    for name, d in zip(NAMES, dirs):
        pipe.load_lora_weights(d, adapter_name=name)
    for case, names, w in (("1", NAMES[:1], [1.0]), ("blend4", NAMES, BLEND)):
        pipe.set_adapters(names, w)
        refs[case] = step(pipe.transformer, x)
        ms = timed(lambda: step(pipe.transformer, x), dev, a.rounds)
        rows.append(dict(family=family, case=f"peft_{case}", ms=ms, x_base=ms / base_ms))
    pipe.unload_lora_weights()
    for name, d in zip(NAMES, dirs):
        pipe.load_fd_lora(d, adapter_name=name, max_rank=a.rank)
    for case, names, w in (("1", NAMES[:1], [1.0]), ("blend4", NAMES, BLEND)):
        pipe.set_adapters(names, w)
        y, ref = step(pipe.transformer, x), refs[case]
        err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
        effect = float((ref.float() - base_y.float()).abs().max() / ref.float().abs().max())
        ok = err < TOL[dt] and err < effect / 2
        ms = timed(lambda: step(pipe.transformer, x), dev, a.rounds)
        rows.append(dict(family=family, case=f"fdlora_{case}", ms=ms, x_base=ms / base_ms, rel_err=err,
                         lora_effect=effect, ok=ok))
        if not ok:
            bad.append(f"{family} fdlora_{case}: rel err {err:.3g} (effect {effect:.3g})")
    pipe.unload_lora_weights()
    if not torch.equal(step(pipe.transformer, x), base_y):
        bad.append(f"{family}: unload_lora_weights did not restore the base output bit-exactly")
    pipe.transformer = None  # (the pipe is dropped with this frame; free the weights before the next family)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows, bad


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", nargs="*", help="families (default: all of FULL, or every tiny one with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny configs on CPU (fp32)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    a.rounds = a.rounds or (2 if a.smoke else 10)
    fams = a.family or (list(_tiny().SPECS) if a.smoke else list(FULL))
    rows, bad = [], []
    for f in fams:
        r, b = bench_family(f, a)
        rows += r
        bad += b
        for row in r:
            print(f"{row['family']:<14} {row['case']:<14} {row['ms']:9.2f} ms  x{row['x_base']:.3f}"
                  + ("" if row.get("ok", True) else "  WRONG"), flush=True)
    import diffusers
    import peft

    meta = {"device": "cpu (smoke)" if a.smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
            "diffusers": diffusers.__version__, "peft": peft.__version__, "python": platform.python_version(),
            "rank": a.rank, "rounds": a.rounds,
            "git_sha": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                      cwd=ROOT).stdout.strip()}
    if a.out:
        path = Path(a.out)  # other keys of an existing file (quantized, lycoris rows) are kept
        data = json.loads(path.read_text()) if path.exists() else {}
        data.update(meta=meta, rows=rows, failures=bad)
        path.write_text(json.dumps(data, indent=1) + "\n")
    for b in bad:
        print("WRONG:", b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
