"""Read adapters out of live PEFT models (the weights PEFT holds in its LoraLayers)."""

from __future__ import annotations

from torch import nn

from ..errors import FormatError, UnsupportedFeatureError
from ..hub.adapter import LoraAdapter, ModuleLora, Provenance


def peft_root(model: nn.Module) -> nn.Module:
    """The wrapped base model inside a PeftModel / LoraModel (module paths are relative to it)."""
    from peft import PeftModel
    from peft.tuners.lora import LoraModel

    if isinstance(model, PeftModel):
        model = model.base_model
    if isinstance(model, LoraModel):
        model = model.model
    return model


def adapter_from_peft(model: nn.Module, adapter_name: str = "default") -> LoraAdapter:
    """A `LoraAdapter` with the exact weights and current scaling of `adapter_name` in a PEFT model.

    The scale PEFT applies (alpha/r, alpha/sqrt(r) for rsLoRA, times any `set_scale`) is kept
    exactly by storing alpha = scaling * r.
    """
    from peft.tuners.lora import LoraLayer

    modules: dict[str, ModuleLora] = {}
    for path, layer in peft_root(model).named_modules():
        if not isinstance(layer, LoraLayer) or adapter_name not in layer.lora_A:
            continue
        if layer.use_dora.get(adapter_name, False):
            raise UnsupportedFeatureError(
                f"{path}: adapter {adapter_name!r} uses DoRA, which fd-lora does not implement yet; "
                "merge it with PEFT (merge_and_unload) or use a plain LoRA."
            )
        A = layer.lora_A[adapter_name].weight.detach()
        B_mod = layer.lora_B[adapter_name]
        B = B_mod.weight.detach()
        r = A.shape[0]
        bias = B_mod.bias.detach() if getattr(B_mod, "bias", None) is not None else None
        modules[path] = ModuleLora(A, B, alpha=float(layer.scaling[adapter_name]) * r, bias=bias)
    if not modules:
        raise FormatError(f"the PEFT model holds no LoRA adapter named {adapter_name!r}.")
    return LoraAdapter(modules, name=adapter_name, provenance=Provenance(source="<peft model>", format="peft-live"))
