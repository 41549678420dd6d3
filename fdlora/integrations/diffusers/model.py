"""`fdlora.load_fd_lora(model, source)` on a diffusers model (any `ModelMixin`), as its `load_lora_adapter`.

    fdlora.load_fd_lora(pipe.transformer, "user/wan-style", "style")   # Wan, Qwen, Flux ... or a UNet
    fdlora.set_adapters(pipe.transformer, ["style"], [0.8])

The model's LoRA family is found by rule (fdlora.integrations.diffusers.family.family_of_model: the
diffusers mixin whose family name starts the model's class name; `family=` a pipeline class
overrides it), so community layouts convert with that family's diffusers converters, as on a
pipeline. The load itself is the pipeline one (`FdLoraPipelineMixin.load_fd_lora`) over a
one-component holder: the same checks, atomicity, slots and per-call `scale` hook. Models that are
not diffusers models go to the Transformers loader (fdlora.integrations.transformers.load_fd_lora).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fdlora.integrations.diffusers.family import Family, family_of, family_of_model
from fdlora.integrations.diffusers.pipeline import FdLoraPipelineMixin
from fdlora.runtime.scope import lock_of


def is_diffusers_model(model: Any) -> bool:
    return any(c.__name__ == "ModelMixin" and c.__module__.startswith("diffusers.") for c in type(model).__mro__)


class _ModelHolder(FdLoraPipelineMixin):
    """One diffusers model seen as a one-component pipeline (the model's lock is the holder's)."""

    def __init__(self, component: str, model: nn.Module, family: Family | None) -> None:
        self.components = {component: model}
        self._fd_family = family
        self.__dict__["_fdlora_lock"] = lock_of(getattr(model, "_orig_mod", model))


def load_fd_lora(model: nn.Module, source: Any, adapter_name: str | None = None, *, family: Any = None,
                 prefix: str | None = None, **kwargs: Any) -> nn.Module:
    """Load a LoRA into a diffusers model (or, for any other model, a PEFT adapter: the Transformers loader).

    `family`: a diffusers pipeline class (or instance) whose LoRA mixin reads the file; by default the
    model's own family. `prefix`: the component the file's keys are under (default: the family's
    denoiser, `transformer` or `unet`, as `load_lora_adapter`'s prefix). Other keywords are the
    pipeline `load_fd_lora`'s (strict, max_slots, max_rank, targets, Hub keywords). Returns `model`.
    """
    if not is_diffusers_model(getattr(model, "_orig_mod", model)):
        from fdlora.integrations.transformers import load_fd_lora as load_transformers

        if family is not None or prefix is not None:
            kwargs.update({k: v for k, v in (("family", family), ("prefix", prefix)) if v is not None})
        return load_transformers(model, source, adapter_name, **kwargs)
    base = getattr(model, "_orig_mod", model)
    fam = family_of(family) if family is not None else family_of_model(base)
    comp = prefix or (fam.denoiser if fam is not None else
                      "unet" if type(base).__name__.startswith("UNet") else "transformer")
    _ModelHolder(comp, model, fam).load_fd_lora(source, adapter_name, **kwargs)
    return model
