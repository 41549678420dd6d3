"""set_adapters latency: fd-lora's one table write vs diffusers+PEFT's walk over every layer.

A model of `--layers` Linear layers (700 ~ an SDXL UNet's LoRA targets) with `--adapters` adapters
loaded in fd-lora, against the same model with 4 PEFT adapters switched by diffusers' own
`set_weights_and_activate_adapters` (what `pipe.set_adapters` runs). CPU is fine; `--device cuda`
times the host-to-device write too. Verifies the weights took effect before timing.

    python benchmarks/bench_set_adapters.py --out benchmarks/results/cpu/set_adapters.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

import fdlora
from fdlora.hub.adapter import LoraAdapter, ModuleLora


def median_ms(fn, n, sync):
    for _ in range(5):
        fn()
    out = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=700)
    ap.add_argument("--adapters", type=int, default=50)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    W, L = a.width, a.layers
    base = nn.Sequential(*[nn.Linear(W, W) for _ in range(L)]).to(dev)
    paths = [str(i) for i in range(L)]

    model = copy.deepcopy(base)
    h = fdlora.inject(model, paths, max_slots=a.adapters, max_rank=16)
    g = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    for i in range(a.adapters):
        ad = LoraAdapter({p: ModuleLora(torch.randn(8, W, generator=g) * 0.01, torch.randn(W, 8, generator=g) * 0.01)
                          for p in paths})
        h.add_adapter(ad, f"ad{i}", activate=False)
    load_s = time.perf_counter() - t
    names = [f"ad{i}" for i in range(4)]
    h.set_adapters(names, [0.1, 0.2, 0.3, 0.4])
    x = torch.randn(2, W, device=dev)
    with torch.no_grad():
        y1 = model(x)
        h.set_adapters(names, [0.9, 0.2, 0.3, 0.4])
        assert not torch.equal(y1, model(x)), "a weight change must change the output"
    step = iter(range(10**9))
    fd_weight = median_ms(lambda: h.set_adapters(names, [next(step) % 10 / 10, 0.2, 0.3, 0.4]), a.repeats, sync)
    fd_switch = median_ms(lambda: h.set_adapters([f"ad{next(step) % a.adapters}", "ad1"], [0.5, 0.5]), a.repeats, sync)

    from diffusers.utils.peft_utils import set_weights_and_activate_adapters
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, target_modules=paths), adapter_name="ad0")
    for n in names[1:]:
        peft_model.add_adapter(n, LoraConfig(r=8, target_modules=paths))
    pm = peft_model.base_model.model
    peft_weight = median_ms(
        lambda: set_weights_and_activate_adapters(pm, names, [next(step) % 10 / 10, 0.2, 0.3, 0.4]),
        max(10, a.repeats // 10), sync)

    result = {
        "benchmark": "set_adapters",
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "git_sha": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "layers": L, "adapters_loaded": a.adapters, "fused_layers": len(h.layers),
        "fdlora_weight_change_ms": fd_weight, "fdlora_switch_active_set_ms": fd_switch,
        "diffusers_peft_weight_change_ms_4_loaded": peft_weight, "fdlora_load_all_adapters_s": load_s,
        "targets": {"weight_change_ms": 1.0, "switch_ms": 5.0},
        "met": {"weight_change": fd_weight <= 1.0, "switch": fd_switch <= 5.0},
    }
    print(f"{L} fused layers, {a.adapters} adapters loaded on {result['device']}")
    print(f"  fd-lora set_adapters weight change : {fd_weight:8.3f} ms  (target <= 1 ms)")
    print(f"  fd-lora switch active set          : {fd_switch:8.3f} ms  (target <= 5 ms)")
    print(f"  diffusers+PEFT weight change (4)   : {peft_weight:8.3f} ms")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
