"""LoRA on a module that is Linear inside but not an nn.Linear: MoE routers (a 2-D `weight` [E, H] used through
F.linear inside a forward that also picks the top-k experts).

PEFT targets such a weight with lora.ParamWrapper (2-D: one "expert", plain Linear math): the router runs on
W + scale * B A, B [E, r], A [r, H]. fd-lora keeps the router's own forward and adds the LoRA delta to the
output of the F.linear call that reads the weight (Mixtral / Qwen3-MoE / OLMoE / gpt-oss routers call
F.linear(x, self.weight[, bias]); DeepSeek's casts first, `weight.type(torch.float32)`, which is followed):

    logits = x W^T (+ b) + sum_s w[m, s] * scale[s] * (x A_s^T) B_s^T

with the same modes as FusedLoraLinear (blend, per-sample, per-row; rows are the router's flattened
[M, H] input, batch-major). A router whose forward never calls F.linear on its weight raises, naming it,
on its first call: the one MoE refusal that comes after a load (a load cannot run the forward to see).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fdlora.errors import FdLoraError, UnsupportedFeatureError
from fdlora.hub.adapter import ModuleLora
from fdlora.layers.modules.fused import LayerSpec, _FusedLora, check_fits, spec_of
from fdlora.layers.state import Mode, ModelState
from fdlora.layers.storage import offload

_CASTS = (torch.Tensor.type, torch.Tensor.to, torch.Tensor.float)


def is_router(module: nn.Module) -> bool:
    """A module fd-lora has no Linear-like layer for, with a 2-D float `weight` parameter [E, H]."""
    w = getattr(module, "weight", None)
    return (isinstance(w, nn.Parameter) and w.dim() == 2 and w.is_floating_point() and spec_of(module) is None
            and not isinstance(module, _FusedLora) and not isinstance(module, nn.Embedding))


def check(module: nn.Module, m: ModuleLora, path: str, what: str) -> None:
    """Raise unless `m` is a plain LoRA for router `module` (A [r, H], B [E, r]; no bias or DoRA: PEFT's
    ParamWrapper has neither, and the router's forward is not one matmul to add them to)."""
    E, H = module.weight.shape
    check_fits(LayerSpec("linear", (int(H),), int(E)), m, path, what)
    if m.bias is not None or m.magnitude is not None:
        raise UnsupportedFeatureError(f"{what}: {path} ({type(module).__name__}) has a LoRA bias or DoRA magnitude; "
                                      "fd-lora serves plain LoRA on routers.")


class _AddLora(TorchFunctionMode):
    """Adds the layer's LoRA to F.linear calls on its base weight (or a cast of it) inside the router's forward."""

    def __init__(self, layer: FusedLoraRouter) -> None:
        super().__init__()
        self.layer = layer
        self.weights = [layer.base.weight]
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.linear and len(args) > 1 and any(args[1] is w for w in self.weights):
            self.seen = True
            return self.layer.add_delta(out, args[0])
        if func in _CASTS and args and any(args[0] is w for w in self.weights):
            self.weights.append(out)
        return out


class FusedLoraRouter(_FusedLora):
    kind = "linear"

    def __init__(self, base: nn.Module, state: ModelState, index: int, path: str, rank: int,
                 dtype: torch.dtype | None = None) -> None:
        E, H = base.weight.shape
        super().__init__(base, state, index, path, rank, (int(H),), int(E), dtype)
        self.in_features = int(H)

    def select_backend(self) -> None:
        super().select_backend()
        self._plain = False  # no merged-weight cache: the router's forward is not one matmul
        self._seen_weight()
        offload.note(self)

    def check(self, m: ModuleLora, what: str) -> None:
        check(self.base, m, self.path, what)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        y = self._common_forward(x, args, kwargs)
        if y is not None:
            return y
        if self._skip():
            return self.base(x, *args, **kwargs)
        mode = _AddLora(self)
        with mode:
            out = self.base(x, *args, **kwargs)
        if not mode.seen:
            raise FdLoraError(f"{self.path}: {type(self.base).__name__}.forward never calls F.linear on its weight, "
                              "so fd-lora cannot add the LoRA to it; serve this adapter with PEFT.")
        return out

    def add_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [..., E] (the F.linear output) plus the LoRA of input x [..., H]."""
        A, B, ranks, S = self._bank()
        x2 = x.reshape(-1, self.in_features).to(A.dtype)
        y2 = y.reshape(-1, self.out_features).contiguous()
        if self.state.mode is Mode.ROWS:
            row_slot = self.state.row_slot(x.device)
            if row_slot.shape[0] != x2.shape[0]:
                raise FdLoraError(f"{self.path}: {row_slot.shape[0]} per-row adapters given for {x2.shape[0]} rows.")
            self._ops.lora_delta_rows(y2, x2, A, B, self.scale_unit[:S], row_slot, ranks)
        else:
            scale, gw = self._weights(x2, x2.shape[0])
            self._ops.lora_delta(y2, x2, A, B, scale[:S], gw[:, :S], ranks)
        return y2.view(y.shape)
