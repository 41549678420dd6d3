"""Shared helpers of the training tests: a PEFT model and an fd-lora trainable model on the same weights."""

from __future__ import annotations

import copy

import torch
from peft import get_peft_model

import fdlora
from fdlora.fixtures import tiny_tasks as tiny

PREFIX = "base_model.model."


def peft_lora_modules(peft_model, name: str = "default") -> dict:
    return {n[len(PREFIX):]: m for n, m in peft_model.named_modules()
            if hasattr(m, "lora_A") and name in getattr(m, "lora_A", {})}


def pair(model_name: str, config, seed: int = 0, randomize_B: bool = True):
    """(peft_model, fdlora_model): the same base, the same initial A/B (B randomised so every grad matters)."""
    base = tiny.build(model_name, seed)
    pm = get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    fm = fdlora.add_trainable_adapter(copy.deepcopy(base), "default", copy.deepcopy(config))
    ours, theirs = fdlora.lora_parameters(fm, "default"), peft_lora_modules(pm)
    assert sorted(ours) == sorted(theirs)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for path, (A, B) in ours.items():
            pa, pb = theirs[path].lora_A["default"].weight, theirs[path].lora_B["default"].weight
            if randomize_B:
                pb.copy_(torch.randn(pb.shape, generator=g) * 0.1)
            A.copy_(pa)
            B.copy_(pb)
    return pm, fm


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def count_nodes(t: torch.Tensor, name: str) -> int:
    """Nodes of t's autograd graph whose type name starts with `name` (e.g. "ToCopyBackward", "MatMul4BitBackward")."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        f = todo.pop()
        if f is not None and f not in seen:
            seen.add(f)
            todo.extend(g for g, _ in f.next_functions)
    return sum(type(f).__name__.startswith(name) for f in seen)
