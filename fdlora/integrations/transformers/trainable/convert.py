"""A live PEFT LoRA model into fd-lora trainable layers, its adapters kept trainable (and their values kept).

    model = fdlora.training.trainable_from_peft(peft_model)   # what fdlora.from_peft(peft_model, trainable=True) does

Each PEFT adapter becomes a trainable fd-lora adapter of the same name and LoraConfig, with PEFT's lora_A / lora_B
values and modules_to_save copies; PEFT's active adapters stay active. The PeftModel is consumed (its base model
is unwrapped with PEFT's own `unload`, nothing merged) and the plain model is returned.
"""

from __future__ import annotations

import torch
from torch import nn

from fdlora.errors import FdLoraError, UnsupportedFeatureError
from fdlora.integrations.transformers.trainable.adapters import (
    add_trainable_adapter,
    lora_parameters,
    saved_modules,
    set_active,
)

PREFIX = "base_model.model."


def trainable_from_peft(peft_model) -> nn.Module:
    wrapped = [p for p, m in peft_model.named_modules() if type(m).__name__ == "ParamWrapper"]
    if wrapped:  # checked before PEFT's unload below changes anything
        raise UnsupportedFeatureError(f"{wrapped[0]}: LoRA on parameters (MoE routers / fused experts, PEFT's "
                                      "ParamWrapper) is served by fdlora.from_peft(model) for inference but cannot be "
                                      "kept trainable; train it with PEFT.")
    configs = dict(peft_model.peft_config)
    active = list(peft_model.active_adapters) if hasattr(peft_model, "active_adapters") else ["default"]
    values, saved, originals = {n: {} for n in configs}, {n: {} for n in configs}, {}
    for path, m in peft_model.named_modules():
        path = path[len(PREFIX):] if path.startswith(PREFIX) else path
        if type(m).__name__ == "ModulesToSaveWrapper":
            originals[path] = m.original_module
            for n, c in m.modules_to_save.items():
                saved[n][path] = {k: v.detach().clone() for k, v in c.state_dict().items()}
        elif hasattr(m, "lora_A") and isinstance(m.lora_A, nn.ModuleDict):
            for n in m.lora_A:
                values[n][path] = (m.lora_A[n].weight.detach().clone(), m.lora_B[n].weight.detach().clone())
    unknown = [n for n, c in configs.items() if str(getattr(c, "peft_type", "")).split(".")[-1].upper() != "LORA"]
    if unknown:
        raise FdLoraError(f"adapters {unknown} are not LoRA; only LoRA adapters can be kept trainable.")
    model = peft_model.unload()
    for path, orig in originals.items():
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, orig)
    for n, cfg in configs.items():
        add_trainable_adapter(model, n, cfg, dtype=next(iter(values[n].values()))[0].dtype if values[n] else
                              torch.float32)
        with torch.no_grad():
            for path, (A, B) in lora_parameters(model, n).items():
                A.copy_(values[n][path][0])
                B.copy_(values[n][path][1])
            for path, c in saved_modules(model, n).items():
                c.load_state_dict(saved[n][path])
    set_active(model, [n for n in active if n in configs])
    return model
