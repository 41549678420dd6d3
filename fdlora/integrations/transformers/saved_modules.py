"""PEFT's modules_to_save in fd-lora: the original module plus one full copy per adapter, undoably.

A full copy (a classification head, an lm_head with new tokens) is not a low-rank delta, so it cannot
live in a bank. `SavedModules` takes the original's place and picks, per call, from the shared state:

    off / no active adapter with a copy   -> the original module (bit-exact base)
    blend                                 -> the copy of the one active adapter that has one
    per-sample (adapter_names=...)        -> each sample's copy, one sub-batch per distinct copy

Only the per-sample case loops in Python, over the distinct adapters that own a copy of this module
(PEFT does the same; a full module has no fused form). `unload` puts the original object back.
"""

from __future__ import annotations

import torch
from torch import nn

from fdlora.errors import FdLoraError
from fdlora.layers.state import Mode
from fdlora.runtime.session import Session


class SavedModules(nn.Module):
    def __init__(self, original: nn.Module, path: str, session: Session) -> None:
        super().__init__()
        self.original = original
        self.copies = nn.ModuleDict()
        self.path = path
        object.__setattr__(self, "session", session)  # shared, not a submodule

    def forward(self, *args, **kwargs):
        s: Session = self.session
        st = s.handle.state
        if not s.alive or st.mode is Mode.OFF or not self.copies:
            return self.original(*args, **kwargs)
        if st.mode is Mode.BLEND:
            owners = [n for n in st.active if n in self.copies]
            if len(owners) > 1:
                raise FdLoraError(
                    f"{self.path}: adapters {owners} are active together and each has its own full copy of this "
                    "module (modules_to_save); only one can be used at a time. Activate one of them, or mix them "
                    "per sample with adapter_names=[...]."
                )
            return (self.copies[owners[0]] if owners else self.original)(*args, **kwargs)
        if s.sample_names is None:
            raise FdLoraError(
                f"{self.path} holds modules_to_save copies, and per-sample adapters reached it without their names. "
                "Pass adapter_names=[...] to the model that fdlora.load_fd_lora / fdlora.from_peft returned."
            )
        return self._per_sample(s.sample_names, args, kwargs)

    def _per_sample(self, names, args, kwargs):
        x = args[0]
        if x.shape[0] % len(names):
            raise FdLoraError(f"{self.path}: {len(names)} adapter names for an input of batch {x.shape[0]}.")
        rep = x.shape[0] // len(names)  # generate repeats each sample (beams, num_return_sequences)
        groups: dict[str | None, list[int]] = {}
        for i, n in enumerate(names):
            if isinstance(n, tuple):  # a per-sample blend
                owners = [m for m in n if m in self.copies]
                if owners:
                    raise FdLoraError(f"{self.path}: sample {i} blends {list(n)}, and {owners} have their own full "
                                      "copy of this module (modules_to_save), which cannot be blended.")
                n = None
            groups.setdefault(n if n in self.copies else None, []).extend(range(i * rep, (i + 1) * rep))
        out = None
        for n, rows in groups.items():
            idx = torch.tensor(rows, device=x.device)
            y = (self.copies[n] if n is not None else self.original)(x[idx], *args[1:], **kwargs)
            if not isinstance(y, torch.Tensor):
                raise FdLoraError(f"{self.path}: per-sample modules_to_save needs a module returning one tensor, "
                                  f"got {type(y).__name__}.")
            if out is None:
                out = y.new_empty((x.shape[0], *y.shape[1:]))
            out[idx] = y
        return out


def _swap(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def install(model: nn.Module, session: Session, path: str, name: str, copy: nn.Module) -> None:
    """Give adapter `name` its own full copy of the module at `path`."""
    switch = session.saved.get(path)
    if switch is None:
        switch = SavedModules(model.get_submodule(path), path, session)
        _swap(model, path, switch)
        session.saved[path] = switch
    switch.copies[name] = copy


def drop(model: nn.Module, session: Session, name: str) -> None:
    """Forget adapter `name`'s copies; a module left with none gets its original back."""
    for path, switch in list(session.saved.items()):
        if name in switch.copies:
            del switch.copies[name]
        if not len(switch.copies):
            _swap(model, path, switch.original)
            del session.saved[path]


def unload(model: nn.Module, session: Session) -> None:
    """Every original module back in place."""
    for path, switch in session.saved.items():
        _swap(model, path, switch.original)
    session.saved.clear()
