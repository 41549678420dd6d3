"""Trainable fd-lora adapters from a PEFT LoraConfig or a live PeftModel (fdlora.add_trainable_adapter,
fdlora.from_peft(..., trainable=True))."""
