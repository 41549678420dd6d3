"""Plain-torch LoRA ops: the oracle in tests, the baseline in benchmarks, the fallback on any device."""

from .lora import lora_conv_delta, lora_delta, lora_delta_rows, lora_expand_add, lora_shrink
from .lora_linear import lora_linear
from .lora_merge import lora_merge

__all__ = ["lora_conv_delta", "lora_delta", "lora_delta_rows", "lora_expand_add", "lora_linear", "lora_merge",
           "lora_shrink"]
