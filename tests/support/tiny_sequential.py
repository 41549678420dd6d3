"""A two-Linear Sequential with LoRA adapters and its float64 oracle: the merged-weight cache's and the hot path's
tests (tests/layers/test_merged.py, test_hot.py) check against it."""

from __future__ import annotations

import torch
from torch import nn

from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.testing import EPS

PATHS = ["0", "2"]
SHAPES = {"0": (32, 48), "2": (48, 40)}


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 40))


def lora(seed, rank=4, alpha=None, paths=PATHS):
    g = torch.Generator().manual_seed(seed)
    return LoraAdapter({p: ModuleLora(torch.randn(rank, SHAPES[p][0], generator=g) / 4,
                                      torch.randn(SHAPES[p][1], rank, generator=g) / 4, alpha) for p in paths})


def oracle(model, x, adapters: dict[str, tuple[LoraAdapter, float]]):
    """Float64 forward of the base Sequential with every weight W + sum w * alpha/r * B A."""
    h = x.double()
    for i, mod in enumerate(model):
        base = mod.base if hasattr(mod, "base") else mod
        if not isinstance(base, nn.Linear):
            h = torch.tanh(h)
            continue
        W = base.weight.double().cpu()
        for ad, w in adapters.values():
            m = ad.modules.get(str(i))
            if m is not None:
                W += w * m.scaling() * (m.B.double() @ m.A.double())
        h = h @ W.t() + base.bias.double().cpu()
    return h


def close(y, ref):
    assert float((y.detach().double() - ref.detach()).abs().max()) <= 200 * EPS[torch.float32] * float(ref.abs().max())
