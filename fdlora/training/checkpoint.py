"""Checkpoints of `fdlora train`: what a resumed run needs, independent of the number of processes and of FSDP.

    <output>/checkpoints/step-N/
        trainable.safetensors   every trainable parameter by name, whole (FSDP shards gathered)
        optimizer.pt            the optimizer's state_dict, its tensors whole (indexed as trainable_parameters)
        state.json              {"step", "losses" (the curve so far), "processes" (of the run that wrote it)}

`gather` runs on every process (under FSDP it all-gathers the shards: a collective), `write` on the main process
only, so a checkpoint is written once; a directory is renamed into place complete or not at all. `load` runs on
every process and puts each process's part back (its shard under FSDP), so N processes resume what M wrote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from .fsdp import full, load_into, shard_like


def named_trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def gather(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """(trainable tensors by name, optimizer state_dict), whole and on the CPU. Every process calls it."""
    params = {n: full(p.detach()).cpu().contiguous() for n, p in named_trainable(model).items()}
    sd = opt.state_dict()
    sd["state"] = {i: {k: full(v).cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                   for i, s in sd["state"].items()}
    return params, sd


def write(path: Path, params: dict[str, torch.Tensor], opt_state: dict, step: int, losses: list[float],
          world: int) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(params, tmp / "trainable.safetensors")
    torch.save(opt_state, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "losses": losses, "processes": world}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)  # a checkpoint dir is complete or absent


def load(path: Path, model: nn.Module, opt: torch.optim.Optimizer, params: list[nn.Parameter]
         ) -> tuple[int, list[float]]:
    """Restore `path` into `model` and `opt` (built over `params`, trainable_parameters order); returns
    (step, losses). Every process calls it."""
    from safetensors.torch import load_file

    state = json.loads((path / "state.json").read_text())
    saved = load_file(path / "trainable.safetensors")
    named = named_trainable(model)
    if saved.keys() != named.keys():
        raise ConfigError(f"train.resume: {path} holds {len(saved)} trainable tensors, this model {len(named)}; "
                          "allowed: a checkpoint of the same config; fix: set `resume: false` or fix the config")
    for n, p in named.items():
        load_into(p, saved[n])
    sd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    for i, s in sd["state"].items():  # state shaped like its parameter goes back into that parameter's shard
        p = params[int(i)]
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape:
                s[k] = shard_like(v, p)
    opt.load_state_dict(sd)
    return int(state["step"]), list(state["losses"])
