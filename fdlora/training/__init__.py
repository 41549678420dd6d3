"""Training through fd-lora's layers: trainable adapters, the trainer and the YAML schema of `fdlora train`.

    adapters.py   add_trainable_adapter / trainable_parameters / lora_parameters / per_sample (peft.LoraConfig in)
    save.py       a trained adapter out as a PEFT adapter directory
    (the layers are fdlora.layers.trainable; the op and its autograd formula fdlora.kernels.train_ops)
"""

from .adapters import (
    add_trainable_adapter,
    lora_parameters,
    per_sample,
    remove_trainable,
    saved_modules,
    set_active,
    state_of,
    trainable_parameters,
)

__all__ = ["add_trainable_adapter", "lora_parameters", "per_sample", "remove_trainable", "saved_modules",
           "set_active", "state_of", "trainable_parameters"]
