"""breadth.json rows for LoHa / LoKr / DoRA: one full-size SDXL UNet step, each against plain LoRA of equal size.

Adapters (random, on every module of fd-lora's SDXL target table, built from the formats' own tensors through
fdlora.hub.formats.lycoris, so they load exactly as a file would):

    lora-r16     A [16, K], B [N, 16]                                          16 (N + K) parameters
    loha-r8      hada_w1_a/b, hada_w2_a/b of rank 8 (same parameter count)    served as its exact rank-64 product
    lokr-f8-r16  lokr_w1 [8, 8] full, lokr_w2_a [N/8, 16] @ lokr_w2_b [16, K/8] served as its exact rank-128 kron

Every ΔW has entries of about the same size (std ~0.01, a strong LoRA beside SDXL's ~0.02 weights): an adapter
several times stronger than the base (a first try gave LoKr 5x this) drives the fp16 UNet into values where its
own rounding (merged reference and fd-lora alike) no longer agrees with itself within the bound below.
    dora-r16     lora-r16 plus a magnitude [N] (PEFT's DoRA)                   eager per-layer path (fdlora.layers.modules.dora)

Each row is verified first (fd-lora's step against the same UNet with W + ΔW merged, DoRA by its formula; fp16 bound
derived from eager PyTorch's own error: 5x the base step's fp16-vs-fp32 difference), then timed: median of
`--steps` single steps (CUDA events), with the base step and the lora-r16 step for the ratios.

    python benchmarks/bench_breadth_lycoris.py --out benchmarks/results/<gpu>/breadth.json   # GPU, ~3 min
    python benchmarks/bench_breadth_lycoris.py --smoke                                      # tiny UNet, CPU

Rows go under the "lycoris" key of the output file (other keys of an existing file are kept).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fdlora  # noqa: E402
from fdlora.fixtures import fullsize  # noqa: E402
from fdlora.hub.adapter import LoraAdapter, ModuleLora  # noqa: E402
from fdlora.hub.formats.lycoris import exact_module  # noqa: E402
from fdlora.testing import step_ms  # noqa: E402

KINDS = ("lora-r16", "loha-r8", "lokr-f8-r16", "dora-r16")


def module_shapes(model, targets) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """path -> (N, K flat, A's row shape) of every Linear / Conv2d matching `targets`."""
    from fdlora.layers.model.targets import match_targets

    out = {}
    for path in match_targets(model, targets, None, None, None):
        m = model.get_submodule(path)
        if isinstance(m, torch.nn.Conv2d):
            row = (m.in_channels, *m.kernel_size)
            out[path] = (m.out_channels, m.in_channels * m.kernel_size[0] * m.kernel_size[1], row)
        elif isinstance(m, torch.nn.Linear):
            out[path] = (m.out_features, m.in_features, (m.in_features,))
    return out


def make_adapter(kind: str, model, shapes, dtype, seed: int = 0) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std

    mods = {}
    for path, (N, K, row) in shapes.items():
        if kind in ("lora-r16", "dora-r16"):
            A, B = rnd(16, *row), rnd(N, 16, *([1, 1] if len(row) == 3 else []))
            m = ModuleLora(A.to(dtype), B.to(dtype), alpha=16.0)
            if kind == "dora-r16":
                W = model.get_submodule(path).weight.detach().float().reshape(N, -1).cpu()
                m.magnitude = W.norm(dim=1) * (1 + rnd(N, std=0.1))
        elif kind == "loha-r8":
            m = exact_module(path, {"hada_w1_a": rnd(N, 8, std=0.2), "hada_w1_b": rnd(8, K, std=0.2),
                                    "hada_w2_a": rnd(N, 8, std=0.2), "hada_w2_b": rnd(8, K, std=0.2),
                                    "alpha": torch.tensor(8.0)}, dtype=dtype)
        else:
            if N % 8 or K % 8:
                continue
            m = exact_module(path, {"lokr_w1": rnd(8, 8, std=0.06), "lokr_w2_a": rnd(N // 8, 16, std=0.2),
                                    "lokr_w2_b": rnd(16, K // 8, std=0.2), "alpha": torch.tensor(16.0)}, dtype=dtype)
        mods[path] = m
    return LoraAdapter(mods, name=kind)


def merged_reference(model, adapter: LoraAdapter):
    """`model` with every module's weight replaced by W + ΔW (DoRA: m / ‖W + ΔW‖_row ⊙ (W + ΔW)), in fp32 math."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for path, m in adapter.modules.items():
            layer = ref.get_submodule(path)
            W = layer.weight.float()
            d = (m.B.float().reshape(m.B.shape[0], -1) @ m.A.float().reshape(m.rank, -1)).to(W.device) * m.scaling()
            new = W.reshape(W.shape[0], -1) + d
            if m.magnitude is not None:
                new = new * (m.magnitude.to(W.device) / new.norm(dim=1))[:, None]
            layer.weight.copy_(new.reshape(W.shape).to(layer.weight.dtype))
    return ref


def as_float(v):
    """Floating tensors (also inside a dict, as added_cond_kwargs) in fp32; the rest unchanged."""
    if isinstance(v, dict):
        return {k: as_float(t) for k, t in v.items()}
    return v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def timed(fn, device, steps: int) -> float:
    for _ in range(2):
        fn()
    return statistics.median(step_ms(fn, device) for _ in range(steps))


def run(smoke: bool, steps: int) -> dict:
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.float16
    unet = fullsize.sdxl_unet(device, dtype, tiny=smoke)
    kw = fullsize.sdxl_inputs(unet, batch=2) if not smoke else fullsize.sdxl_inputs(unet, batch=1, tokens=8)
    shapes = module_shapes(unet, fullsize.SDXL_TARGETS)

    def step(model):
        with torch.no_grad():
            return model(**kw).sample

    base_out = step(unet)
    exact = base_out
    if not smoke:  # the same step in fp32, inputs too (diffusers casts the embeddings to the input dtype)
        kw32 = {k: as_float(v) for k, v in kw.items()}
        with torch.no_grad():
            exact = copy.deepcopy(unet).float()(**kw32).sample
    bound = max(5 * float((base_out.float() - exact.float()).abs().max()), 1e-4)
    base_ms = timed(lambda: step(unet), device, steps)
    rows, lora_ms = [], None
    for kind in KINDS:
        adapter = make_adapter(kind, unet, shapes, dtype)
        model = copy.deepcopy(unet)
        rank = max(m.rank for m in adapter.modules.values())
        h = fdlora.inject(model, list(adapter.modules), max_rank=rank)
        h.add_adapter(adapter, kind)
        got, want = step(model), step(merged_reference(unet, adapter))
        err = float((got.float() - want.float()).abs().max())
        if not err <= bound * max(1.0, float(want.abs().max())):
            raise SystemExit(f"{kind}: fd-lora differs from the merged reference by {err:.3g} (bound {bound:.3g})")
        ms = timed(lambda model=model: step(model), device, steps)
        lora_ms = ms if kind == "lora-r16" else lora_ms
        params = sum(sum(t.numel() for t in (m.A, m.B) if t is not None) for m in adapter.modules.values())
        rows.append({"family": "sdxl", "adapter": kind, "modules": len(adapter.modules), "bank_rank": h.max_rank,
                     "stored_params": params, "ms": round(ms, 3), "base_ms": round(base_ms, 3),
                     "ratio_to_base": round(ms / base_ms, 3), "ratio_to_lora_r16": round(ms / lora_ms, 3),
                     "max_abs_err": err})
        print(json.dumps(rows[-1]))
        del model, h
        if device == "cuda":
            torch.cuda.empty_cache()
    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    return {"device": gpu, "torch": torch.__version__, "git": sha, "dtype": str(dtype), "steps": steps, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny UNet on CPU: checks the harness in seconds")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", help="breadth.json to write the rows into (under 'lycoris')")
    args = ap.parse_args()
    result = run(args.smoke, 2 if args.smoke else args.steps)
    if args.out:
        path = Path(args.out)
        data = json.loads(path.read_text()) if path.exists() else {}
        data["lycoris"] = result
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
