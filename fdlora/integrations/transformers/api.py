"""The public functions on Transformers models: `load_fd_lora`, `from_peft`, `save_peft`, `merge_and_unload`, `unload`.

    model = fdlora.load_fd_lora(llama, "user/chat-adapter", adapter_name="chat")   # PEFT dir / Hub repo
    model = fdlora.from_peft(peft_model)     # PeftModel, LoraModel, or a model with PEFT layers injected

Both are the same three steps, each in its own module and each entered once:
read (`.read` for folders, Hub repos and state dicts, `.live` for PEFT layers in a model: everything
checked, nothing changed) -> attach (`.attach`: fused layers, banks, module copies; all or nothing)
-> enable (`.model`: the instance becomes an `FdLoraModel`, whose forward / generate take
adapter_names). A quantized base is checked first (`.quantized`).

They take the model as the user holds it (`unwrap` removes torch.compile's wrapper) and hand the
module that holds the layers to `.save` / the read and attach steps; `save_peft` and friends are
the public forms of `.save`'s functions, switching the class back when fd-lora leaves the model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from torch import nn

from fdlora.hub.adapter import LoraAdapter
from fdlora.integrations.transformers import save
from fdlora.integrations.transformers.attach import attach, attach_live
from fdlora.integrations.transformers.live import read_live
from fdlora.integrations.transformers.model import disable, enable
from fdlora.integrations.transformers.quantized import check_quantized
from fdlora.integrations.transformers.read import read
from fdlora.runtime.scope import lock_of


def unwrap(model: nn.Module) -> nn.Module:
    """The module that holds the fused layers (torch.compile's wrapper removed)."""
    return getattr(model, "_orig_mod", model)


def load_fd_lora(model: nn.Module, source: str | os.PathLike | LoraAdapter, adapter_name: str | None = None,
                 *, activate: bool = True, **hub_kwargs: Any) -> nn.Module:
    """Load a PEFT adapter (directory or Hub repo id; or a LoraAdapter) into a Transformers model, in place.

    Honours every LoraConfig field that changes the math (see fdlora.integrations.transformers.loraconfig);
    modules_to_save become full module copies that only this adapter uses. The adapter becomes the
    only active one unless `activate=False`. Hub keywords: revision, subfolder, token, cache_dir,
    local_files_only, force_download, allow_pickle. Returns `model`, whose forward and generate now
    take `adapter_names=[...]`.
    """
    base = unwrap(model)
    name = adapter_name or "default"
    check_quantized(base)
    load = read(base, source, name, **hub_kwargs)
    attach(base, [(name, load)], activate=name if activate else None)
    enable(base)
    return model


def convert_live(model: nn.Module) -> nn.Module:
    """Replace the PEFT LoRA layers of `model` by fd-lora fused layers with the same adapters and state.

    Returns the model that holds them now (inside a PeftModel wrapper: its base model)."""
    live = read_live(model)
    with lock_of(live.root):
        attach_live(live)
    return live.root


def from_peft(peft_model: nn.Module, trainable: bool = False) -> nn.Module:
    """Convert a live PeftModel / LoraModel (or a model with PEFT LoRA layers) to fd-lora, in place.

    `trainable=True` keeps its adapters trainable instead
    (fdlora.integrations.transformers.trainable.convert.trainable_from_peft: fd-lora's
    trainable layers with the same values, modules_to_save and active set; `fdlora.trainable_parameters(model)` is
    what an optimizer gets).

    Returns the underlying Transformers model, now served by fd-lora (an `fdlora.FdLoraModel`: its
    forward / generate take adapter_names); use it from now on, the PEFT wrapper has no LoRA layers
    left. Every adapter, its exact scale, the active set and the disabled flag carry over;
    modules_to_save become fd-lora module copies. Outputs are the same before and after (up to
    float rounding of the fused kernels).
    """
    if trainable:
        from fdlora.integrations.transformers.trainable.convert import trainable_from_peft

        return trainable_from_peft(peft_model)
    root = convert_live(peft_model)
    return enable(root)


def save_peft(model: nn.Module, directory: str | os.PathLike, adapter_name: str = "default") -> str:
    """Write adapter `adapter_name` of `model` as a PEFT adapter folder (see fdlora.integrations.transformers.save)."""
    with lock_of(unwrap(model)):
        return save.write_peft(unwrap(model), directory, adapter_name)


def merge_and_unload(model: nn.Module, adapter_names: Sequence[str] | None = None, *,
                     copy: bool = False) -> nn.Module:
    """A plain model (no fd-lora layers) with `adapter_names` (default: the active ones) merged in.

    Each adapter merges at its current weight (1.0 if it is not active). In place by default (the
    fd-lora model is used up, as with PEFT's merge_and_unload); `copy=True` returns a merged deep copy
    and leaves `model` serving its adapters.
    """
    with lock_of(unwrap(model)):
        return disable(save.merge(unwrap(model), adapter_names, copy=copy))


def unload(model: nn.Module) -> nn.Module:
    """Every original module back, all adapters dropped (PEFT's `unload`); returns the plain model."""
    with lock_of(unwrap(model)):
        return disable(save.remove(unwrap(model)))
