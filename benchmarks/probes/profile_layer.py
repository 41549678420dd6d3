# Measures: host time of one fused layer's eager forward per mode (the per-call microseconds).
# Showed: an eager per-call fused layer costs 0.11-0.21 ms of host time (README known gap). layer_host.json
"""Host time of one fused layer's eager forward, per mode (GPU): where the per-call microseconds go.

    python benchmarks/probes/profile_layer.py --out layer_host.json     # prints cProfile tables, writes JSON

Small row counts keep the GPU ahead of the host, so wall time per call is host time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fdlora  # noqa: E402
from fdlora.integrations.transformers import adapter_from_peft  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run (torch backend)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e6


def build(K: int, N: int, dtype: torch.dtype, adapters: int = 4):
    from peft import LoraConfig, get_peft_model

    with torch.device(DEVICE):
        base = nn.Sequential(nn.Linear(K, N)).to(dtype)
        peft_m = get_peft_model(nn.Sequential(nn.Linear(K, N)).to(dtype),
                                LoraConfig(r=16, lora_alpha=16, target_modules=["0"], init_lora_weights=False))
    ads = []
    for i in range(adapters):
        if i:
            peft_m.add_adapter(f"a{i}", LoraConfig(r=16, lora_alpha=16, target_modules=["0"], init_lora_weights=False))
        ads.append(adapter_from_peft(peft_m, "default" if i == 0 else f"a{i}"))
    h = fdlora.inject(base, ["0"], max_slots=4, max_rank=16)
    for i, ad in enumerate(ads):
        h.add_adapter(ad, f"a{i}")
    h.set_adapters("a0")
    return base, h


def primitives() -> dict[str, float]:
    """Host microseconds of bare launches: what any Triton kernel costs here, whatever fd-lora does."""
    import triton
    import triton.language as tl

    @triton.jit
    def one(p):
        tl.store(p + tl.arange(0, 16), tl.zeros([16], tl.float32))

    @triton.jit
    def many(p, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
             q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, X: tl.constexpr, Y: tl.constexpr):
        tl.store(p + tl.arange(0, 16), tl.zeros([16], tl.float32))

    t = torch.zeros(64, device=DEVICE)
    ints = list(range(1, 21))
    ptrs = [t] * 10
    return {
        "torch.empty": host_us(lambda: torch.empty(32, 4096, device=DEVICE)),
        "triton 1-arg launch": host_us(lambda: one[(1,)](t)),
        "triton 31-arg launch": host_us(lambda: many[(1,)](t, *ints, *ptrs, X=16, Y=True)),
        "triton autotuned 1-arg launch": host_us(lambda: tuned[(1,)](t)) if (tuned := triton.autotune(
            [triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)], key=[])(one)) else 0.0,
    }


def profile(fn, n: int = 300) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    sync()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(30)
    return s.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    fdlora.set_merge_cache(0)
    res: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}
    cases = {
        "sdxl-like blend 1 adapter": (640, 640, torch.float16, 2, 32, None),
        "sdxl-like per-sample": (640, 640, torch.float16, 2, 32, "samples"),
        "llm decode blend 1 adapter": (4096, 4096, torch.bfloat16, 32, 1, None),
        "llm decode 4 mixed rows": (4096, 4096, torch.bfloat16, 32, 1, "rows"),
    }
    times: dict = {"primitives": primitives() if DEVICE == "cuda" else {}}
    print(times)
    res["profiles"] = {}
    for label, (K, N, dtype, batch, seq, mode) in cases.items():
        model, h = build(K, N, dtype)
        lin = model[0]
        x = torch.randn(batch, seq, K, device=DEVICE, dtype=dtype)
        ctx = {None: contextlib.nullcontext(),
               "samples": h.per_sample(["a0", "a1"] * (batch // 2)),
               "rows": h.per_row([f"a{i % 4}" for i in range(batch * seq)])}[mode]
        with torch.inference_mode(), ctx:
            t = {"nn.Linear": host_us(lambda x=x, lin=lin: F.linear(x, lin.base.weight, lin.base.bias)),
                 "fused layer": host_us(lambda x=x, lin=lin: lin(x))}
            times[label] = t
            print(f"== {label}: " + ", ".join(f"{k} {v:.1f} us" for k, v in t.items()))
            res["profiles"][label] = profile(lambda x=x, lin=lin: lin(x))
            print(res["profiles"][label][:3000])
    res["host_us"] = times
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
