"""One pass over a component's module tree for what a load must know of it: PEFT layers in it, fused attention.

A load into a pipeline refuses a component that holds diffusers' PEFT LoRA layers and moves q/k/v LoRA onto
projections fused by `fuse_qkv_projections` (fdlora.integrations.diffusers.fused_qkv); both depend on the module tree
as the user may have changed it since the last load, so they are looked up on every load. `named_modules` did it in
two walks of ~4k modules on a wrapped SDXL UNet (building every path string: ~15 ms of a prefetch's publication on
our CPU box); this walk builds no names, asks each module two dictionary questions (what its class says is asked
once per class) and does not descend into fd-lora's own layers (their base and bank hold neither).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fdlora.layers.modules.fused import _FusedLora
from fdlora.steps import Steps, drain


@dataclass(frozen=True)
class Tree:
    peft: bool  # a PEFT tuner layer (diffusers' load_lora_weights) is in the tree
    fused: bool  # some attention module has fused projections (fuse_qkv_projections)


def scan(model: nn.Module) -> Tree:
    return drain(scan_steps(model))


def scan_steps(model: nn.Module, every: int = 0) -> Steps[Tree]:
    """`scan`, stopping every `every` modules (fdlora.steps; 0: never)."""
    peft = fused = False
    kinds = _kinds
    stack, n = [model], 0
    while stack:
        n += 1
        if every and not n % every:
            yield
        m = stack.pop()
        d = m.__dict__
        kind = kinds.get(type(m))
        if kind is None:
            kind = _kind(type(m))
        if kind[0]:
            peft = True
        if d["fused_projections"] if "fused_projections" in d else kind[2]:
            fused = True
        if not kind[1]:
            stack.extend(d["_modules"].values())
    return Tree(peft, fused)


_kinds: dict[type, tuple[bool, bool, bool]] = {}


def _kind(cls: type) -> tuple[bool, bool, bool]:
    """(a PEFT tuner layer, an fd-lora layer, the class's `fused_projections` default) for modules of class `cls`,
    asked once per class: isinstance against PEFT's abstract base class runs Python on every call, and a missed
    class attribute costs an exception inside getattr (diffusers sets `fused_projections` on instances)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    kind = _kinds[cls] = (issubclass(cls, BaseTunerLayer), issubclass(cls, _FusedLora),
                          bool(getattr(cls, "fused_projections", False)))
    return kind
