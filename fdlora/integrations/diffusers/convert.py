"""`from_diffusers(pipe)`: the PEFT LoRA layers diffusers' `load_lora_weights` put in, converted to fd-lora.

    pipe.load_lora_weights(...)              # diffusers + PEFT
    pipe = fdlora.from_diffusers(pipe)       # the same adapters, now fused

Each component is a PEFT-injected torch model, so the conversion is the Transformers one
(fdlora.integrations.transformers.api.convert_live), applied per component.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fdlora.errors import FdLoraError
from fdlora.integrations.transformers.api import convert_live


def from_diffusers(pipe: Any) -> Any:
    """Convert the PEFT LoRA layers diffusers' `load_lora_weights` put into a pipeline's components.

    Each component holding them (unet / transformer / text encoders) is converted in place as in
    `from_peft`; the pipeline is returned. Adapters are then driven with fd-lora
    (`fdlora.set_adapters(pipe.unet, ...)`, or the pipeline methods after `pipe.load_fd_lora`).
    """
    from peft.tuners.lora import LoraLayer

    done = []
    for name, comp in getattr(pipe, "components", {}).items():
        model = getattr(comp, "_orig_mod", comp)
        if isinstance(model, nn.Module) and any(isinstance(m, LoraLayer) for m in model.modules()):
            convert_live(model)
            done.append(name)
    if not done:
        raise FdLoraError(f"{type(pipe).__name__} has no component with PEFT LoRA layers; load adapters with "
                          "pipe.load_fd_lora(source) instead.")
    return pipe
