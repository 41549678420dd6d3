"""A trained adapter out as a PEFT adapter directory: adapter_config.json + adapter_model.safetensors.

Keys are PEFT's (`base_model.model.<path>.lora_A.weight`, `.lora_B.weight`, modules_to_save copies as
`base_model.model.<path>.<param>`), the config is the LoraConfig the adapter was made from, so
`PeftModel.from_pretrained(base, dir)` and `fdlora.load_fd_lora(base, dir)` both load it unchanged.
Under FSDP (fdlora.training.fsdp) the tensors are sharded: every process calls `adapter_state_dict` (it gathers
them whole) and one writes it with `save_adapter(..., state_dict=...)`.
"""

from __future__ import annotations

import copy
import json
import os

import torch
from torch import nn

from fdlora.integrations.transformers.trainable.adapters import _state, lora_parameters, saved_modules

from ..errors import SaveError
from .fsdp import full

PREFIX = "base_model.model."


def adapter_state_dict(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter `name`'s tensors under PEFT's keys, whole and on the CPU (sharded ones are gathered: under FSDP
    every process must call this)."""
    out = {}
    for path, (A, B) in lora_parameters(model, name).items():
        out[f"{PREFIX}{path}.lora_A.weight"] = full(A.detach()).cpu().contiguous()
        out[f"{PREFIX}{path}.lora_B.weight"] = full(B.detach()).cpu().contiguous()
    for path, m in saved_modules(model, name).items():
        for k, v in m.state_dict().items():
            out[f"{PREFIX}{path}.{k}"] = full(v.detach()).cpu().contiguous()
    return out


def save_adapter(model: nn.Module, name: str, out_dir: str | os.PathLike, base_model_name_or_path: str | None = None,
                 state_dict: dict[str, torch.Tensor] | None = None) -> str:
    """Write trainable adapter `name` of `model` to `out_dir` in PEFT's layout; returns the directory.
    `state_dict`: its tensors already gathered by `adapter_state_dict` (FSDP: on every process)."""
    from safetensors.torch import save_file

    cfg = copy.deepcopy(_state(model).configs[name])
    cfg.base_model_name_or_path = base_model_name_or_path
    out_dir = os.fspath(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
        cfg.save_pretrained(out_dir)
        sd = adapter_state_dict(model, name) if state_dict is None else state_dict
        save_file(sd, os.path.join(out_dir, "adapter_model.safetensors"),
                  metadata={"format": "pt"})
    except OSError as e:
        raise SaveError(f"could not write the adapter to {out_dir}: {e}; pick a writable directory.") from e
    return out_dir


def read_config(out_dir: str) -> dict:
    with open(os.path.join(out_dir, "adapter_config.json")) as f:
        return json.load(f)
