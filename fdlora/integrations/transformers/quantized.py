"""Quantized bases (bitsandbytes 4-bit nf4/fp4, 8-bit): LoRA through the opaque-base path.

A bitsandbytes Linear4bit / Linear8bitLt has in_features / out_features, so FusedLoraLinear wraps it
like any Linear-like module: y = base(x) + fused delta, with the base's own quantized kernel and no
dequantising or merging. Only merging into such a base is refused (fdlora.integrations.transformers.save).
"""

from __future__ import annotations

import importlib.util

from torch import nn

from fdlora.errors import UnsupportedFeatureError

INSTALL = "pip install bitsandbytes"


def uses_bitsandbytes(model: nn.Module) -> bool:
    """Whether a Transformers model was loaded with a bitsandbytes quantization_config (or holds bnb layers)."""
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if str(getattr(method, "value", method)) == "bitsandbytes":
        return True
    return getattr(model, "is_loaded_in_4bit", False) is True or getattr(model, "is_loaded_in_8bit", False) is True


def require_bitsandbytes(why: str) -> None:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UnsupportedFeatureError(
            f"{why} needs bitsandbytes, which is not installed. Install it with `{INSTALL}` or "
            "`pip install fd-lora[quant]` (CUDA, and releases from 0.46 also run on CPU), then load the model again."
        )


def check_quantized(model: nn.Module) -> None:
    """A model quantized with bitsandbytes can only run if bitsandbytes imports; say how to get it."""
    if uses_bitsandbytes(model):
        require_bitsandbytes(f"{type(model).__name__} is quantized with bitsandbytes and")


def is_quantized_linear(module: nn.Module) -> bool:
    """A Linear-like module whose weight is not a float tensor (bnb 4/8-bit and similar)."""
    w = getattr(module, "weight", None)
    return w is not None and hasattr(w, "is_floating_point") and not w.is_floating_point()
