"""Transformers models served by fd-lora: `FdLoraModel`, `adapter_names` in forward and generate, save / merge.

Loading is `.api` (load_fd_lora, from_peft): read step, attach step, then `enable` here.

    model = fdlora.load_fd_lora(llama, "user/chat-adapter", adapter_name="chat")   # PEFT dir / Hub repo
    fdlora.load_fd_lora(model, "./other-adapter", adapter_name="other")
    out = model(input_ids, adapter_names=["chat", "__base__", "other"])           # one adapter per row
    out = model(input_ids, fd_lora_adapters=["chat", None, {"chat": .5, "other": .5}])   # or per-row blends
    seqs = model.generate(input_ids, adapter_names=["chat", "other", "chat"], num_beams=2)

How `adapter_names` gets in. `generate` validates its kwargs against `forward`'s signature before
any module runs, so a forward hook cannot carry it, and a wrapper object would be a second identity
for everything keyed on the model (fdlora.set_adapters(model, ...), the handle registry, isinstance
checks of Transformers pipelines). Instead the model *instance* is switched to a subclass of its own
class with `FdLoraModel` first (same name and module; built once per class, nothing of any
transformers class is reassigned); `unload()` / `merge_and_unload()` switch it back. The subclass's
`forward` / `generate` take `adapter_names` (PEFT's list of names, "__base__" for none) or
`fd_lora_adapters` (fd-lora's: a name, None or a {name: weight} blend per sample), run the
original inside a per-sample scope (fdlora.runtime.routing) and report the original signatures
(`__wrapped__`), so Transformers' own kwarg checks are unchanged. Each call holds the model's lock
(fdlora.runtime.scope.lock_of) from start to end, a whole generate included: the per-sample state
is the model's, so concurrent calls run one after the other instead of reading each other's rows;
loads, deletes and switches wait for them the same way. The diffusers integration
switches pipelines the same way.

The methods that end fd-lora on a model (`merge_and_unload`, `unload`) switch the class back after
`.save` has done the work; `.save` never imports this module.

The PEFT-integration methods Transformers models have (`load_adapter`, `set_adapter`,
`disable_adapters`, `enable_adapters`, `active_adapters`, `delete_adapter`, `save_pretrained`) and
PEFT's `disable_adapter()`, `merge_and_unload()`, `unload()` act on fd-lora's adapters.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from fdlora.errors import FdLoraError
from fdlora.integrations.transformers import save, saved_modules
from fdlora.integrations.transformers.attach import attach
from fdlora.integrations.transformers.loraconfig import lora_config
from fdlora.integrations.transformers.read import adapter_from_state, read
from fdlora.layers import registry_of_models
from fdlora.runtime.routing import adapter_rows
from fdlora.runtime.scope import lock_of
from fdlora.runtime.session import session_of


class FdLoraModel:
    """Mixin of a Transformers model served by fd-lora (see the module docstring)."""

    def _fd_handle(self):
        h = registry_of_models.get(self)
        if h is None:
            raise FdLoraError(f"{type(self).__name__} has no fd-lora adapters; load one with fdlora.load_fd_lora.")
        return h

    def load_adapter(self, peft_model_id: Any = None, adapter_name: str | None = None, *,
                     peft_config: Any = None, adapter_state_dict: dict | None = None, **hub_kwargs: Any) -> None:
        """Transformers' `load_adapter`: a PEFT folder / Hub repo, or `peft_config` + `adapter_state_dict`.

        As there, the new adapter is active only if no other adapter is.
        """
        self._fd_handle()
        for k in ("device_map", "max_memory", "offload_folder", "offload_index", "low_cpu_mem_usage",
                  "is_trainable", "hotswap", "adapter_kwargs"):
            hub_kwargs.pop(k, None)
        name = adapter_name or "default"
        if adapter_state_dict is not None:
            if peft_config is None:
                raise FdLoraError("adapter_state_dict needs its peft_config (a LoraConfig or its dict).")
            load = adapter_from_state(self, lora_config(peft_config), adapter_state_dict, name)
        else:
            load = read(self, peft_model_id, name, **hub_kwargs)  # outside the lock: calls go on while it reads
        with lock_of(self):
            activate = not self._fd_handle().active_adapters()
            attach(self, [(name, load)], activate=name if activate else None)

    def set_adapter(self, adapter_name: str | Sequence[str]) -> None:
        with lock_of(self):
            self._fd_handle().set_adapters(adapter_name)

    def active_adapters(self) -> list[str]:
        return self._fd_handle().active_adapters()

    def disable_adapters(self) -> None:
        with lock_of(self):
            self._fd_handle().disable()

    def enable_adapters(self) -> None:
        with lock_of(self):
            self._fd_handle().enable()

    def delete_adapter(self, adapter_names: str | Sequence[str]) -> None:
        """Waits for calls in flight (the model's lock): a call never loses an adapter halfway."""
        with lock_of(self):
            self._fd_handle().delete_adapter(adapter_names)
            s = session_of(self)
            for n in [adapter_names] if isinstance(adapter_names, str) else adapter_names:
                s.configs.pop(n, None)
                saved_modules.drop(self, s, n)

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """PEFT's context manager: the base model inside the block (which holds the model's lock)."""
        with lock_of(self):
            h = self._fd_handle()
            was = h.state.enabled
            h.disable()
            try:
                yield
            finally:
                if was:
                    h.enable()

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, adapter_name: str | None = None,
                        **kwargs: Any) -> None:
        """Like Transformers with PEFT adapters loaded: writes one adapter (default: the first active) as PEFT.

        For a full checkpoint with the adapter baked in: `model.merge_and_unload().save_pretrained(...)`.
        """
        with lock_of(self):
            h = self._fd_handle()
            names = h.active_adapters() or h.list_adapters()
            save.write_peft(self, save_directory, adapter_name or names[0])

    def merge_and_unload(self, adapter_names: Sequence[str] | None = None, *, copy: bool = False) -> nn.Module:
        """PEFT's: a plain model with the adapters merged in (fdlora.merge_and_unload)."""
        with lock_of(self):
            return disable(save.merge(self, adapter_names, copy=copy))

    def unload(self) -> nn.Module:
        """Every original module back, no adapters, the model's own class back (PEFT's `unload`)."""
        with lock_of(self):
            return disable(save.remove(self))


def _rows(self, adapter_names, fd_lora_adapters, args, kwargs):
    if adapter_names is not None and fd_lora_adapters is not None:
        raise FdLoraError("give adapter_names (PEFT) or fd_lora_adapters, not both.")
    if adapter_names is not None:
        return adapter_rows(self, adapter_names, args, kwargs, "adapter_names")
    if fd_lora_adapters is not None:
        return adapter_rows(self, fd_lora_adapters, args, kwargs, "fd_lora_adapters")
    return contextlib.nullcontext()


def _forward_of(cls: type):
    @functools.wraps(cls.forward)
    def forward(self, *args: Any, adapter_names: Sequence[str | None] | None = None,
                fd_lora_adapters: Sequence[Any] | None = None, **kwargs: Any) -> Any:
        with lock_of(self), _rows(self, adapter_names, fd_lora_adapters, args, kwargs):
            return cls.forward(self, *args, **kwargs)

    return forward


def _generate_of(cls: type):
    @functools.wraps(cls.generate)
    def generate(self, *args: Any, adapter_names: Sequence[str | None] | None = None,
                 fd_lora_adapters: Sequence[Any] | None = None, **kwargs: Any) -> Any:
        """Sample i generates with adapter_names[i] (or fd_lora_adapters[i]); beam search and
        num_return_sequences repeat each sample in place and the spec follows (fdlora.runtime.routing)."""
        with lock_of(self), _rows(self, adapter_names, fd_lora_adapters, args, kwargs):
            return cls.generate(self, *args, **kwargs)

    return generate


_SUBCLASSES: dict[type, type] = {}


def enable(model: nn.Module) -> nn.Module:
    """Switch this instance to its fd-lora subclass (idempotent)."""
    cls = type(model)
    if isinstance(model, FdLoraModel):
        return model
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        body = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_fdlora_base": cls,
                "forward": _forward_of(cls)}
        if hasattr(cls, "generate"):
            body["generate"] = _generate_of(cls)
        sub = _SUBCLASSES[cls] = type(cls.__name__, (FdLoraModel, cls), body)
    model.__class__ = sub
    _rehook(model)
    return model


def _rehook(model: nn.Module) -> None:
    """An accelerate hook on the model itself (cpu_offload, disk_offload, a device_map) kept the class's forward it
    found when it was added; point it at the class the instance has now, so fd-lora's forward (adapter_names,
    fd_lora_adapters) runs inside the hook and generate sees its signature (fdlora.layers.storage.offload)."""
    fwd = model.__dict__.get("forward")
    if "_old_forward" not in model.__dict__ or not isinstance(fwd, functools.partial):
        return
    model._old_forward = type(model).forward.__get__(model)
    model.forward = functools.update_wrapper(functools.partial(fwd.func, *fwd.args, **fwd.keywords),
                                             model._old_forward)


def disable(model: nn.Module) -> nn.Module:
    """The instance's own class back."""
    if isinstance(model, FdLoraModel):
        model.__class__ = type(model)._fdlora_base
        _rehook(model)
    return model
