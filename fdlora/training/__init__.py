"""Training through fd-lora's layers: trainable adapters, the trainer and the YAML schema of `fdlora train`.

    adapters.py   add_trainable_adapter / trainable_parameters / lora_parameters / per_sample (peft.LoraConfig in)
    convert.py    a live PeftModel's adapters into trainable fd-lora layers (trainable_from_peft)
    save.py       a trained adapter out as a PEFT adapter directory
    schema.py / trainer.py / data.py / quant.py   `fdlora train`: YAML schema, loop, data sources, QLoRA bases
    checkpoint.py / fsdp.py / push.py   process-count independent checkpoints, FSDP2 sharding, output.push_to_hub
    tiny.py       tiny-vit / tiny-llama / tiny-sd15 from configs, their synthetic batches and losses
    (the layers are fdlora.layers.trainable.modules; the op and its autograd formula fdlora.kernels.train_ops)
"""

from fdlora.integrations.transformers.trainable.adapters import (
    add_trainable_adapter,
    lora_parameters,
    per_sample,
    remove_trainable,
    saved_modules,
    set_active,
    state_of,
    trainable_parameters,
)
from fdlora.integrations.transformers.trainable.convert import trainable_from_peft

__all__ = ["add_trainable_adapter", "lora_parameters", "per_sample", "remove_trainable", "saved_modules",
           "set_active", "state_of", "trainable_from_peft", "trainable_parameters"]
