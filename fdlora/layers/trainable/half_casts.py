"""The half-precision copies of every trainable adapter's A and B that an eager CUDA step reads, made for all the
layers of a model in a few grouped launches once per forward pass of the model instead of by each layer.

An eager half-precision step of a trainable layer reads A and s B in the activations' dtype forward and A and s B
backward (fdlora.kernels.ops.lora_train.half_casts: A, s A, B, s B). Each layer making its own is two or three
launches per layer per step, and eager steps of hundreds of small layers are host-bound (SDXL's UNet: 560 LoRA
layers, about 20 us of host time per launch on an H100 host). Here the first layer called in a forward pass of the
model makes them for every registered layer with six `torch._foreach_*` launches; the others find theirs made.

When a copy may be served: only inside a forward pass of the model the adapters were added to (its forward pre-hook
and hook open and close the pass; `arm`), made in that pass, from the very tensors the layer holds now, whose version
counters have not moved since. The pass bounds what the counters cannot see (an in-place change through `.data`, as
some optimizers make it): no pass reuses another's copies, as autocast's weight cast cache lives for one autocast
region. Outside a pass (a submodule called on its own, gradient checkpointing's recompute in the backward), for a
layer whose parameters were replaced, in a model sharded by FSDP (its units gather their parameters as each is
called), or once the parameters' storage moved between passes (ZeRO-3 frees it), the layer makes its own with
`half_casts`: the same tensors bit for bit, so a recompute saves what the first forward saved.
"""

from __future__ import annotations

import torch
from torch import nn

from fdlora.kernels.ops.lora_train import half_casts


class _Group:
    """The copies of one (dtype, device): parallel lists over the registered (layer path, adapter) keys."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.made = -1  # the pass whose copies these are
        self.off = False  # storage moved between passes: every layer makes its own
        self._empty()

    def _empty(self) -> None:
        self.index: dict[tuple, int] = {}
        self.A: list[torch.Tensor] = []
        self.B: list[torch.Tensor] = []
        self.s: list[float] = []
        self.casts: list[list[torch.Tensor]] = [[], [], [], []]  # A, s A, B, s B
        self.versions: list[tuple[int, int]] = []
        self.ptrs: list[tuple[int, int]] = []

    def get(self, key: tuple, A: torch.Tensor, B: torch.Tensor, s: float, scale: torch.Tensor, now: int):
        i = self.index.get(key)
        if i is None:
            return self._add(key, A, B, s, scale, now)
        if self.made != now and not self._remake(now):
            return None
        if self.A[i] is not A or self.B[i] is not B or self.s[i] != s \
                or self.versions[i] != (A._version, B._version):
            return self._set(i, A, B, s, scale)
        c = self.casts
        return c[0][i], c[1][i], c[2][i], c[3][i]

    def _add(self, key, A, B, s, scale, now):
        self.index[key] = len(self.A)
        self.A.append(A), self.B.append(B), self.s.append(s), self.versions.append(None), self.ptrs.append(None)
        for c in self.casts:
            c.append(None)
        if self.made == -1:
            self.made = now
        return self._set(len(self.A) - 1, A, B, s, scale)

    def _set(self, i, A, B, s, scale):
        """Slot i made from A and B alone (a new layer, or one whose parameters changed since this pass's copies)."""
        with torch.no_grad():
            made = half_casts(A, B, scale, self.dtype)
        self.A[i], self.B[i], self.s[i] = A, B, s
        self.versions[i], self.ptrs[i] = (A._version, B._version), (A.data_ptr(), B.data_ptr())
        for c, t in zip(self.casts, made):
            c[i] = t
        return made

    def _remake(self, now: int) -> bool:
        """Every slot made again from the tensors it was made from, in six grouped launches; False (and off for
        good) when any of them no longer holds its storage where it did."""
        if self.off:
            return False
        if [(a.data_ptr(), b.data_ptr()) for a, b in zip(self.A, self.B)] != self.ptrs:
            self.off = True
            self._empty()  # (nothing is served from here on: drop the references)
            return False
        cA, sA, cB, sB = self.casts
        with torch.no_grad():
            torch._foreach_copy_(cA, self.A)
            torch._foreach_copy_(cB, self.B)
            torch._foreach_copy_(sA, torch._foreach_mul(self.A, self.s))
            torch._foreach_copy_(sB, torch._foreach_mul(self.B, self.s))
        self.versions = [(a._version, b._version) for a, b in zip(self.A, self.B)]
        self.made = now
        return True



class HalfCasts:
    """Per model (its TrainState's `halves`): the copies, and which forward pass of the model is running."""

    def __init__(self) -> None:
        self.groups: dict[tuple, _Group] = {}
        self.passes = 0  # forward passes of the model begun
        self.depth = 0  # > 0 inside one
        self.off = None  # None: not yet looked; True: the model is sharded by FSDP (its units gather their
        # parameters as each is called, after the first layer's call would have read them)

    def get(self, key: tuple, A: torch.Tensor, B: torch.Tensor, s: float, scale: torch.Tensor,
            dtype: torch.dtype):
        """(A, s A, B, s B) in dtype for the layer adapter `key` (A, B its parameters now, s == scale), or None
        outside a forward pass of the model (the layer then makes its own)."""
        if not self.depth or self.off:
            return None
        g = self.groups.get((dtype, A.device))
        if g is None:
            g = self.groups[(dtype, A.device)] = _Group(dtype)
        if g.off:
            return None
        return g.get(key, A, B, s, scale, self.passes)

    def clear(self) -> None:
        """Forget every copy (adapters were added or removed: their slots are made again as layers call)."""
        self.groups.clear()
        self.off = None

    def __getstate__(self) -> dict:  # (a copied or unpickled model makes its copies afresh)
        return {"groups": {}, "passes": 0, "depth": 0, "off": None}


_STATE = "_fdlora_train_state"


def _begin(module: nn.Module, args) -> None:
    st = module.__dict__.get(_STATE)
    if st is not None and not torch.compiler.is_compiling():
        h = st.halves
        if h.off is None:  # (fully_shard swaps each unit's class for one named FSDP<class>)
            h.off = any(type(m).__name__.startswith("FSDP") for m in module.modules())
        if not h.depth:
            h.passes += 1
        h.depth += 1


def _end(module: nn.Module, args, out) -> None:
    st = module.__dict__.get(_STATE)
    if st is not None and not torch.compiler.is_compiling():
        st.halves.depth = max(st.halves.depth - 1, 0)


def arm(model: nn.Module, state) -> None:
    """Open and close a pass around each forward call of `model` (once per model; the hooks find the state through
    the model, so a deep copy of the model finds its own)."""
    hooked = _STATE in model.__dict__
    object.__setattr__(model, _STATE, state)
    if not hooked:
        model.register_forward_pre_hook(_begin)
        model.register_forward_hook(_end, always_call=True)


def disarm(model: nn.Module) -> None:
    """No pass opens any more (the hooks stay, finding no state)."""
    model.__dict__.pop(_STATE, None)
