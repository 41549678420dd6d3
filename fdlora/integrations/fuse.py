"""Fuse the active adapters into base weights, and unfuse back to the exact original bits.

Fusing computes each layer's delta in fp32 from the banks and adds it to the weight once; the
original weight is kept (on the CPU) and copied back on unfuse, so a fuse/unfuse cycle is exact
however often it runs (diffusers' unfuse subtracts a recomputed delta and drifts in fp16/bf16).
"""

from __future__ import annotations

import torch

from fdlora.errors import FdLoraError, NonFiniteError
from fdlora.layers.modules import dora
from fdlora.layers.modules.fused import FusedLoraConv2d, _FusedLora, _is_conv1d
from fdlora.layers.quant import quantized


def delta_weight(layer: _FusedLora, slot_weights: torch.Tensor) -> torch.Tensor:
    """sum_s w_s * B_s A_s in fp32, shaped like the base weight. `slot_weights` [S] holds w_s * alpha/r."""
    if dora.active(layer):  # DoRA slots rescale W too (fdlora.layers.modules.dora)
        return dora.delta_weight(layer, slot_weights)
    S, R = layer.bank.extent()  # only the live part of the bank
    A, B = layer.bank.A[:S, :R].float(), layer.bank.B[:, :S, :R].float()  # [S, R, ...], [N, S, R]
    Bw = (B * slot_weights[:S].float().to(B.device)[None, :, None]).reshape(B.shape[0], S * R)
    delta = Bw @ A.reshape(S * R, -1)  # [N, K] or [N, C*kh*kw]
    if isinstance(layer, FusedLoraConv2d):
        return delta.view(layer.base.weight.shape)
    return delta.t() if _is_conv1d(layer.base) else delta


def fuse_layer(layer: _FusedLora, slot_weights: torch.Tensor, safe: bool) -> torch.Tensor | tuple:
    """Add the delta into the base weight in place; returns the original weight (CPU copy), or (weight, bias)
    when a lora bias (LyCORIS diff_b, PEFT lora_bias) goes into the base bias too."""
    w = getattr(layer.base, "weight", None)
    q = quantized.kind(layer.base)
    if q is not None or not isinstance(w, torch.Tensor) or not w.is_floating_point():
        n = layer.out_features * int(torch.tensor(layer.bank.A.shape[2:]).prod())
        raise FdLoraError(
            f"{layer.path}: cannot fuse into a {type(layer.base).__name__} ({q or 'quantized or opaque base'}): "
            f"fusing would dequantize its weight into a {layer.bank.A.dtype} copy ({n * layer.bank.A.element_size()} "
            "bytes for this layer, the memory the quantization saves) and re-quantize it, losing most of the LoRA. "
            "Keep the adapter unfused: fd-lora applies it as base output + delta."
        )
    fused = w.float() + delta_weight(layer, slot_weights)
    if safe and not torch.isfinite(fused).all():
        raise NonFiniteError(f"{layer.path}: fusing would put NaN/Inf into the weight; nothing was fused.")
    db = dora.bias_delta(layer, slot_weights)
    b = getattr(layer.base, "bias", None)
    if db is not None and not isinstance(b, torch.Tensor):
        raise FdLoraError(f"{layer.path}: the adapter has a bias delta but the base layer has no bias to fuse it into; "
                          "keep the adapter unfused.")
    original = w.detach().to("cpu", copy=True)
    with torch.no_grad():
        w.copy_(fused.to(w.dtype))
        if db is not None:
            original = (original, b.detach().to("cpu", copy=True))
            b.copy_((b.float() + db.to(b.device)).to(b.dtype))
    layer.release_merged()  # its W' was merged from the old weight
    return original


def unfuse_layer(layer: _FusedLora, original: torch.Tensor | tuple) -> None:
    with torch.no_grad():
        if isinstance(original, tuple):
            original, bias = original
            layer.base.bias.copy_(bias)
        layer.base.weight.copy_(original)
    layer.release_merged()
