"""Frozen quantized bases for QLoRA: bitsandbytes nf4 / fp4 (Linear4bit) and int8 (Linear8bitLt).

    manual  fd-lora swaps the model's nn.Linear modules for quantized ones (all of them but `skip_modules`,
            which match by path suffix, as Transformers' llm_int8_skip_modules do)
    hf      the model is loaded with from_pretrained(..., quantization_config=BitsAndBytesConfig(...))

Either way the quantized weights are frozen buffers of bitsandbytes' own modules: grad_x flows through their
dequantizing backward, and `fdlora.trainable_parameters` never returns them (only adapter A / B are trainable).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import FdLoraError

INSTALL = "pip install fd-lora[quant]"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class MissingDependencyError(FdLoraError, ImportError):
    """An optional dependency a feature needs is not installed; the message names the pip command."""


@dataclass
class QuantSpec:
    type: str = "nf4"  # nf4 | fp4 | int8
    compute_dtype: str = "float32"
    double_quant: bool = True
    skip_modules: list[str] = field(default_factory=list)


def require_bitsandbytes(what: str = "quantization") -> None:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise MissingDependencyError(f"{what} needs bitsandbytes, which is not installed; fix: {INSTALL}")


def _skipped(path: str, skip: list[str]) -> bool:
    return any(path == s or path.endswith("." + s) or path.startswith(s + ".") for s in skip)


def quantize_manual(model: nn.Module, spec: QuantSpec, device: torch.device | str = "cpu") -> list[str]:
    """Swap every plain nn.Linear not under `skip_modules` for a frozen bitsandbytes one; returns the paths."""
    require_bitsandbytes()
    import bitsandbytes as bnb

    done = []
    for path, lin in list(model.named_modules()):
        if type(lin) is not nn.Linear or _skipped(path, spec.skip_modules):
            continue
        W = lin.weight.data.detach().to("cpu", torch.float32)
        bias = None if lin.bias is None else nn.Parameter(lin.bias.data.detach().clone(), requires_grad=False)
        if spec.type == "int8":
            q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=bias is not None, has_fp16_weights=False,
                                    threshold=6.0)
            q.weight = bnb.nn.Int8Params(W, requires_grad=False, has_fp16_weights=False)
        else:
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=bias is not None,
                                  compute_dtype=DTYPES[spec.compute_dtype], compress_statistics=spec.double_quant,
                                  quant_type=spec.type, device="cpu")
            q.weight = bnb.nn.Params4bit(W, requires_grad=False, quant_type=spec.type,
                                         compress_statistics=spec.double_quant)
        if bias is not None:
            q.bias = bias
        q = q.to(device)  # bitsandbytes quantizes on the move
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, q)
        done.append(path)
    return done


def hf_quantization_config(spec: QuantSpec):
    """The transformers BitsAndBytesConfig of `spec` (method: hf)."""
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    if spec.type == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=spec.skip_modules or None)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=spec.type,
                              bnb_4bit_compute_dtype=DTYPES[spec.compute_dtype],
                              bnb_4bit_use_double_quant=spec.double_quant,
                              llm_int8_skip_modules=spec.skip_modules or None)


def quantized_modules(model: nn.Module) -> list[str]:
    """Paths of bitsandbytes quantized linears in `model` (wrapped ones included)."""
    return [p for p, m in model.named_modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt")]
