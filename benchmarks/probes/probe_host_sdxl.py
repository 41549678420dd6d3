# Measures: host time of a full-size SDXL cache_1 step vs the base, and of each per-layer piece.
# Showed (H100, session 16; probe_host_sdxl.json): SDXL cache_1 at 1.075x base, the same merged weights in plain
# nn.Linears 0.96x, kept callables as instance forwards 1.035x; per call nn.Linear 32 us, F.linear 26 us, hot.get 4.6.
"""Full-size SDXL UNet (batch 2, fp16, r16 on attn+ff+proj), eager, merged-weight cache on: base vs fd-lora vs the
same fd-lora model with each fused layer's kept callable installed as its instance `forward` (no check at all) vs a
plain module tree whose Linears hold the merged weights (no fd-lora code in the step). Interleaved rounds, host ms
until the step returns and CUDA-event ms. Then per-call host microseconds of the hot path's parts on this host.

    python3 benchmarks/probes/probe_host_sdxl.py --out $OUT/results/probe_host_sdxl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_fullsize as bf  # noqa: E402

import fdlora  # noqa: E402
from fdlora.fixtures import fullsize  # noqa: E402
from fdlora.layers.fastpath import hot  # noqa: E402


def rounds(named: dict, n: int) -> dict:
    for f in named.values():
        f(), f()
    t = {k: [] for k in named}
    keys = list(named)
    for r in range(n):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            t[k].append(bf.cuda_step_ms(named[k]))
    return {k: {"ms": statistics.median(a for a, _ in v), "host_ms": statistics.median(h for _, h in v)}
            for k, v in t.items()}


def host_us(fn, n=3000) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def micro() -> dict:
    from fdlora.hub.adapter import LoraAdapter, ModuleLora

    d, K = "cuda", 640
    x = torch.randn(64, K, device=d, dtype=torch.float16)
    lin = nn.Linear(K, K, device=d, dtype=torch.float16)
    model = nn.Sequential(nn.Linear(K, K, device=d, dtype=torch.float16))
    h = fdlora.inject(model, ["0"], max_slots=4, max_rank=16)
    h.add_adapter(LoraAdapter({"0": ModuleLora(torch.randn(16, K) / 40, torch.randn(K, 16) / 40, None)}), "a")
    L = h.layers["0"]
    out = {}
    with torch.inference_mode():
        L(x), L(x)
        fn = hot.get(L, x)
        out["hot_taken"] = fn is not None
        w, b = lin.weight, lin.bias
        parts = {
            "nn.Linear": lambda: lin(x), "F.linear": lambda: F.linear(x, w, b), "fused_hot": lambda: L(x),
            "kept_fn": lambda: fn(x), "hot.get": lambda: hot.get(L, x),
            "is_compiling": torch.compiler.is_compiling, "is_grad_enabled": torch.is_grad_enabled,
            "isCurrentStreamCapturing": torch._C._cuda_isCurrentStreamCapturing,
            "getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0), "x.get_device": x.get_device,
            "w._version": lambda: w._version, "L.bank": lambda: L.bank, "L.base": lambda: L.base,
        }
        for k, f in parts.items():
            out[k] = min(host_us(f) for _ in range(3))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out")
    a = ap.parse_args()
    res = {"micro_us": micro()}
    print(json.dumps(res["micro_us"], indent=1), flush=True)

    from peft import LoraConfig

    dev, dt = torch.device("cuda"), torch.float16
    model = fullsize.sdxl_unet(dev, dt)
    x = fullsize.sdxl_inputs(model, 2)
    base = bf.shared_copy(model)
    with torch.device(dev):
        for i, n in enumerate(("a0", "a1")):
            torch.manual_seed(i + 1)
            model.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=fullsize.SDXL_TARGETS,
                                         init_lora_weights=False), n)
    bf.scale_b(model)
    fd = fdlora.from_peft(model)
    layers = fdlora.handle(fd).layers
    with torch.inference_mode():
        fdlora.set_adapters(fd, ["a0"])
        fd(**x), fd(**x)
        kept = {p: L.merged.hot for p, L in layers.items()}
        print(f"{len(layers)} layers, {sum(h is not None for h in kept.values())} with a hot entry", flush=True)
        plain = bf.shared_copy(base)
        for p, L in layers.items():  # the same tree with each target Linear holding W' (merged buffer)
            parent, name = (plain.get_submodule(p.rsplit(".", 1)[0]), p.rsplit(".", 1)[1]) if "." in p else (plain, p)
            lin = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(lin)
            lin.in_features, lin.out_features = L.in_features, L.out_features
            lin.weight = nn.Parameter(L.merged.buf, requires_grad=False)
            lin.bias = L.base.bias
            setattr(parent, name, lin)

        def instance_forward(on: bool):
            for p, L in layers.items():
                if on:
                    L.forward = kept[p][12]
                else:
                    L.__dict__.pop("forward", None)

        y = {k: bf.out_of(f(**x)).float() for k, f in (("fd", fd), ("plain", plain))}
        instance_forward(True)
        y["inst"] = bf.out_of(fd(**x)).float()
        instance_forward(False)
        print("max|fd - plain|", float((y["fd"] - y["plain"]).abs().max()), "max|inst - fd|",
              float((y["inst"] - y["fd"]).abs().max()), flush=True)
        res["cache_1"] = rounds({"base": lambda: base(**x), "fd": lambda: fd(**x), "plain": lambda: plain(**x)},
                                a.rounds)
        instance_forward(True)
        res["cache_1_inst"] = rounds({"base": lambda: base(**x), "fd_inst": lambda: fd(**x)}, a.rounds)
        instance_forward(False)
        print(json.dumps({k: res[k] for k in ("cache_1", "cache_1_inst")}, indent=1), flush=True)

        def pp():
            with fdlora.per_sample(fd, ["a0", "a1"]):
                return fd(**x)

        pp(), pp()
        kept_pp = {p: L.merged.hot for p, L in layers.items()}
        print("per-prompt kept:", sum(h is not None for h in kept_pp.values()), flush=True)
        res["per_prompt_2"] = rounds({"base": lambda: base(**x), "fd_pp": pp}, a.rounds)
        # per-layer host cost of the kept per-prompt callables, one layer of each shape, inputs of the right size
        seen = {}
        for p, L in layers.items():
            h = kept_pp[p]
            if h is None or h[1] in seen:
                continue
            xx = torch.randn(h[1], device=dev, dtype=dt)
            w0 = L.merged.buf
            seen[h[1]] = {"path": p, "kept_us": host_us(lambda f=h[12], xx=xx: f(xx), 500),
                          "F.linear_us": host_us(lambda xx=xx, w0=w0, b=L.base.bias: F.linear(xx, w0, b), 500)}
        res["per_prompt_layer_us"] = {str(tuple(k)): v for k, v in seen.items()}
        print(json.dumps(res["per_prompt_2"], indent=1), json.dumps(res["per_prompt_layer_us"], indent=1), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
