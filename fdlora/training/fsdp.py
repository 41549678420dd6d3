"""FSDP for `fdlora train`: the frozen base sharded over the processes with torch's FSDP2 `fully_shard`.

    model = shard(model, device, world)      # every process: the same model, each keeps 1/world of every weight
    full(p)                                  # a sharded tensor gathered whole (a collective: every process calls)
    load_into(p, full_tensor)                # a whole tensor back into p's shard

Why torch's `fully_shard` called here, not accelerate's FSDP plugin: accelerate (1.15) cannot run FSDP without
a GPU. `Accelerator()` under `accelerate launch --use_fsdp` builds a FullyShardedDataParallelPlugin whose
__post_init__ raises "There are currently no available devices found, must be one of 'XPU', 'CUDA', ..." on a
CPU-only host (utils/dataclasses.py, the sync_module_states branch), and AcceleratorState turns
DistributedType.FSDP on only for GPU-family process groups (MULTI_CPU is not among them). Its FSDP1 path also
flattens parameters (mixed frozen / trainable parameters in one unit then need use_orig_params). FSDP2 shards
each parameter on its own as a DTensor along dim 0: a unit may mix the frozen base and the trainable A / B,
only parameters with a gradient are reduce-scattered (averaged, as DDP does), and the same code runs on gloo (CPU)
and NCCL (GPU). So the trainer shards the model itself, one path on every device, and the CPU test covers it.

Units: every module whose class is in the model's `_no_split_modules` (transformers' decoder / encoder layers,
diffusers' blocks), innermost first, then the root for what is left (embeddings, head, modules_to_save copies).
Each process builds the whole model on the CPU, then fully_shard moves only its shards to the GPU. accelerate's
FSDP_* settings (fsdp_version, wrap policy, offload, state-dict type) are not read: units come from
_no_split_modules, checkpoints and the saved adapter are always whole tensors.
Parameter names do not change (FSDP2 adds no prefix), so checkpoints and the saved adapter are the same files a
one-process run writes, and a run can resume with another process count or without FSDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def accelerator(**kwargs):
    """An Accelerator for the process group, the device and autocast, never with accelerate's own FSDP plugin
    (the trainer shards the model itself; with ACCELERATE_USE_FSDP set, accelerate would build its plugin and
    raise on a CPU-only host): the flag is hidden while it is built, then put back."""
    import os

    from accelerate import Accelerator

    flag = os.environ.pop("ACCELERATE_USE_FSDP", None)
    try:
        return Accelerator(**kwargs)
    finally:
        if flag is not None:
            os.environ["ACCELERATE_USE_FSDP"] = flag


def units(model: nn.Module) -> list[nn.Module]:
    """The submodules that become their own FSDP unit, innermost first (fully_shard goes bottom-up)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for p, m in model.named_modules() if p and type(m).__name__ in names]
    return found[::-1]  # named_modules is pre-order: reversed, children come before their parents


def shard(model: nn.Module, device: torch.device, world: int) -> nn.Module:
    """Shard `model` (on CPU or already on `device`) over the `world` processes of the default process group;
    fully_shard moves each process's shards to `device`. Returns the same module (its class is swapped to an
    FSDPModule subclass)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for m in units(model):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def held(model: nn.Module) -> str:
    """What this process holds of the sharded model, for the log: units and the share of parameter elements."""
    from torch.distributed.fsdp import FSDPModule

    ps = list(model.parameters())
    local = sum(p.to_local().numel() if is_sharded(p) else p.numel() for p in ps)
    total = sum(p.numel() for p in ps)
    n = sum(1 for m in model.modules() if isinstance(m, FSDPModule))
    return f"{n} FSDP units; this process holds {local} of {total} parameter elements ({100 * local / total:.1f}%)"


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a DTensor is all-gathered (every process must call, in the same order), anything else as is."""
    return t.full_tensor() if is_sharded(t) else t


def load_into(p: torch.Tensor, value: torch.Tensor) -> None:
    """Copy whole tensor `value` into `p` (a plain tensor, or a DTensor shard: this process's rows of it)."""
    with torch.no_grad():
        if is_sharded(p):
            from torch.distributed.tensor import distribute_tensor

            part = distribute_tensor(value.to(p.device, p.dtype), p.device_mesh, p.placements)
            p.to_local().copy_(part.to_local())
        else:
            p.copy_(value)


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Whole tensor `value` sharded as `like` is (optimizer state of a sharded parameter); `value` when `like` is
    a plain tensor."""
    if not is_sharded(like):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements)


@contextlib.contextmanager
def no_sync(model: nn.Module, skip: bool) -> Iterator[None]:
    """Gradient accumulation under FSDP2: keep unsharded gradients local for all but the last micro-step."""
    if not skip:
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
