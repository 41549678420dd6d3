"""Soak: load -> blend -> call -> delete, many times, on a tiny model (CPU). At the end host RSS has not grown
(beyond allocator noise), no tensor is left alive, and the outputs are bit-identical to the first cycle's.

The model is a three-layer MLP rather than the tiny CLIP: on a shared 2-core CI machine a fused-layer call costs
milliseconds, and what this test checks (files, banks, slots, tables) does not depend on the architecture."""

from __future__ import annotations

import gc
import os

import torch
from safetensors.torch import save
from support import loras, tiny

import fdlora
from fdlora.hub import load_adapters

from .conftest import scaled

N_CYCLES = 1000
RSS_SLACK = 24 << 20  # allocator noise on a process that already holds torch, diffusers and transformers


def rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensors() -> int:
    gc.collect()
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def test_soak(figures, tmp_path):
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 32),
                                torch.nn.Linear(32, 16)).eval()
    shapes = tiny.shapes(model, ("0", "2", "3"))
    files = []
    for seed, rank in ((1, 4), (2, 8), (3, 16)):
        p = tmp_path / f"a{seed}.safetensors"
        p.write_bytes(save(loras.peft_state(loras.make_lora(shapes, rank=rank, seed=seed))))
        files.append(p)
    h = fdlora.inject(model, ["0", "2", "3"], max_rank=16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: intra-op threads only spin against the other jobs of a shared CI box
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    try:
        h.add_adapter(load_adapters(files[0], cache=None)[0]["model"], "keeper")
        with torch.no_grad():
            ref_keep = model(x).clone()
            h.disable()
            ref_base = model(x).clone()
            h.enable()
        n = scaled(N_CYCLES)
        blends = {}
        warm = min(50, n // 4)
        for i in range(n):
            if i == warm:
                rss0, tensors0 = rss(), live_tensors()
            f = files[1 + i % 2]
            adapter = load_adapters(f, cache=None)[0]["model"]
            h.add_adapter(adapter, f"cycle{i}", activate=False)
            h.set_adapters(["keeper", f"cycle{i}"], [0.5, 0.7])
            with torch.no_grad():
                y = model(x)
            got = blends.setdefault(f.name, y.clone())
            assert torch.equal(y, got), f"cycle {i}: the blend of keeper + {f.name} changed"
            h.delete_adapter(f"cycle{i}")
        growth, tensors = rss() - rss0, live_tensors() - tensors0
        h.set_adapters(["keeper"])
        with torch.no_grad():
            assert torch.equal(model(x), ref_keep)
            h.disable()
            assert torch.equal(model(x), ref_base)
        assert tensors <= 0, f"{tensors} more live tensors after {n} cycles"
        assert growth < RSS_SLACK, f"RSS grew {growth / 1e6:.1f} MB over {n - warm} cycles"
    finally:
        torch.set_num_threads(threads)
        h.restore()
    figures["soak_cycles"] += n
    figures["rss_growth_bytes"] = growth
    figures["soak_live_tensor_growth"] = tensors
