"""One pass over a component's module tree for what a load must know of it: PEFT layers in it, fused attention.

A load into a pipeline refuses a component that holds diffusers' PEFT LoRA layers and moves q/k/v LoRA onto
projections fused by `fuse_qkv_projections` (fdlora.pipelines.diffusers.fused_qkv); both depend on the module tree
as the user may have changed it since the last load, so they are looked up on every load. `named_modules` did it in
two walks of ~4k modules on a wrapped SDXL UNet (building every path string: ~15 ms of a prefetch's publication on
our CPU box); this walk builds no names, asks each module two dictionary questions and does not descend into
fd-lora's own layers (their base and bank hold neither).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ...layers.fused import _FusedLora


@dataclass(frozen=True)
class Tree:
    peft: bool  # a PEFT tuner layer (diffusers' load_lora_weights) is in the tree
    fused: bool  # some attention module has fused projections (fuse_qkv_projections)


def scan(model: nn.Module) -> Tree:
    from peft.tuners.tuners_utils import BaseTunerLayer

    peft = fused = False
    stack = [model]
    while stack:
        m = stack.pop()
        if isinstance(m, BaseTunerLayer):
            peft = True
        d = m.__dict__
        if d["fused_projections"] if "fused_projections" in d else getattr(type(m), "fused_projections", False):
            fused = True
        if not isinstance(m, _FusedLora):
            stack.extend(d["_modules"].values())
    return Tree(peft, fused)
