"""Trainable LoRA layers: a frozen base plus trainable adapters, forward and backward through one op per adapter.

    y = base(x) + sum_a scale_a * dropout_a(x) A_a^T B_a^T          (fdlora::lora_train_linear / _conv2d)

`TrainableLoraLinear` / `TrainableLoraConv2d` wrap whatever module PEFT would target: a plain nn.Linear / nn.Conv2d,
transformers' Conv1D, a bitsandbytes Linear4bit / Linear8bitLt, or an inference `FusedLoraLinear` whose loaded
adapters then stay active as a fixed, frozen blend under the new one. A plain frozen nn.Linear goes into the op
whole (base GEMM, LoRA and grad_x = gy W + LoRA part in one op call each way); any other base runs its own forward
(and its own backward for grad_x, e.g. bitsandbytes' dequantizing one) and the op adds the LoRA part in fp32. A
frozen 4-bit bitsandbytes base runs inside the op's eager Function instead (fdlora.kernels.train_ops.train_linear_over,
the base computed as bitsandbytes computes it, without its Python layers: fdlora.layers.trainable.frozen_4bit): the
delta is added into its output in place and grad_x = gy W + the LoRA part comes out of one in-place GEMM pair, W
dequantized in the backward as bitsandbytes' own backward does, so neither a copy of the base output nor a second [M, K]
input gradient and their sum are made.

Why not a trainable slot inside the AdapterBank (DESIGN.md's sketch): bank slots are zero-padded, rank-16-aligned
buffers shared by every adapter of a layer, sized for serving; an optimizer needs exactly [r, K] / [N, r]
leaf Parameters (PEFT's orientation, what `fdlora.lora_parameters` returns and what PEFT checkpoints hold). The
trained adapter goes into a bank the normal way once saved (`fdlora.load_fd_lora` on the output directory).

Parameters are named `lora_A.<adapter>` / `lora_B.<adapter>`; A is [r, K] (conv: [r, C, kh, kw]) and B is [N, r]
(conv: [N, r, 1, 1]), exactly PEFT's lora_A / lora_B weights, in fp32 unless asked otherwise.
Per-sample training (one adapter per sample, `TrainState.samples`) runs each adapter's op on its own samples only,
so each adapter gets the gradients it would get alone.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fdlora.errors import FdLoraError
from fdlora.kernels import train_ops
from fdlora.layers.modules.fused import FusedLoraLinear, linear_dims
from fdlora.layers.state import Mode
from fdlora.layers.trainable.frozen_4bit import frozen_4bit
from fdlora.layers.trainable.half_casts import HalfCasts


@dataclass
class TrainState:
    """Per model: which trainable adapters are active, and the per-sample routing (None: every sample gets
    the active adapters). Shared by every trainable layer of the model (not a submodule)."""

    active: list[str] = field(default_factory=list)
    samples: list[str | None] | None = None
    configs: dict[str, object] = field(default_factory=dict)  # name -> the LoraConfig it was made from
    _index: dict = field(default_factory=dict)  # (samples tuple, name, device) -> index tensor
    _cast: tuple | None = field(default=None, repr=False, compare=False)  # the last autocast cast (see cast)
    halves: HalfCasts = field(default_factory=HalfCasts, repr=False, compare=False)  # A, B copies per forward pass

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cast": None}  # (weak references do not pickle)

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x.to(dtype), made once for the layers that read one input in turn (q, k and v of one norm output): the
        last cast is reused while x is unchanged (same tensor, same version) and the cast is still alive (saved by
        the layer that made it), in the same grad mode. Autocast caches its weight casts in the same way; PEFT and
        plain nn.Linear layers cast the shared input once per layer, and each cast is a launch forward and one
        backward on host-bound steps (its gradients then add up in `dtype` before the one cast back)."""
        c, grad = self._cast, torch.is_grad_enabled()
        if c is not None and c[0]() is x and c[1] == x._version and c[2] is dtype and c[3] is grad:
            xc = c[4]()
            if xc is not None:
                return xc
        xc = x.to(dtype)
        self._cast = (weakref.ref(x), x._version, dtype, grad, weakref.ref(xc))
        return xc

    def sample_index(self, name: str, device: torch.device) -> torch.Tensor | None:
        key = (tuple(self.samples), name, device)
        idx = self._index.get(key)
        if idx is None:
            rows = [i for i, n in enumerate(self.samples) if n == name]
            if len(self._index) > 64:
                self._index.clear()
            idx = self._index[key] = torch.tensor(rows, dtype=torch.long, device=device) if rows else None
        return idx


class _Passthrough(nn.Module):
    """Attribute reads the wrapper does not have go to the wrapped module (model code reads `layer.weight`...)."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self._modules.get("base") if "_modules" in self.__dict__ else None
            if inner is None:
                raise
            return getattr(inner, name)


def _autocast_input(x: torch.Tensor, st: TrainState) -> torch.Tensor:
    """x in autocast's dtype while autocast is on for its device: what the wrapped nn.Linear / nn.Conv2d and PEFT's
    lora_A would compute in. The ops are custom ops, which autocast leaves alone; without this, the fp32 output of
    an autocast LayerNorm / GroupNorm made every base and LoRA GEMM of the layer an fp32 one. Eager casts go
    through the model's TrainState.cast (one cast per shared input)."""
    dev = x.device.type
    if not (x.is_floating_point() and torch.is_autocast_enabled(dev)):
        return x
    dt = torch.get_autocast_dtype(dev)
    if x.dtype is dt:
        return x
    return x.to(dt) if torch.compiler.is_compiling() else st.cast(x, dt)


class _TrainableLora(_Passthrough):
    kind = "linear"

    def __init__(self, base: nn.Module, path: str, state: TrainState) -> None:
        super().__init__()
        self.base = base
        self.path = path
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.dropout: dict[str, float] = {}
        self.scale_f: dict[str, float] = {}  # the scaling buffers' values (what HalfCasts multiplies by)
        object.__setattr__(self, "state", state)

    def add(self, name: str, r: int, scale: float, dropout: float, init: object, dtype: torch.dtype,
            device: torch.device) -> None:
        """A new adapter of rank r, initialised as PEFT does (True: kaiming-uniform A, zero B; "gaussian":
        N(0, 1/r) A, zero B; False: both as a fresh nn.Linear / nn.Conv2d would be)."""
        A = torch.empty(r, *self.a_shape, dtype=dtype, device=device)
        B = torch.empty(self.out_features, r, *([1, 1] if self.kind == "conv2d" else []), dtype=dtype, device=device)
        nn.init.kaiming_uniform_(A, a=math.sqrt(5))
        if init == "gaussian":
            nn.init.normal_(A, std=1 / r)
        if init is False:
            nn.init.kaiming_uniform_(B, a=math.sqrt(5))
        else:
            nn.init.zeros_(B)
        self.lora_A[name] = nn.Parameter(A)
        self.lora_B[name] = nn.Parameter(B)
        self.register_buffer(f"scaling_{name}", torch.tensor(float(scale), dtype=torch.float32, device=device),
                             persistent=False)
        self.dropout[name] = float(dropout)
        self.scale_f[name] = float(scale)

    def scaling(self, name: str) -> torch.Tensor:
        return self._buffers[f"scaling_{name}"]

    def _lora_input(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """dropout(x) as PEFT applies it (on the LoRA branch input, training mode only); None when it is x."""
        p = self.dropout[name]
        return F.dropout(x, p, training=True) if p > 0 and self.training else None

    def _lora(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(A, B, scale) of adapter `name`, read from the parameter and buffer dicts at each call (FSDP swaps the
        parameters it gathers) without nn.Module's Python attribute lookups: a call's host time is the point in eager
        steps of hundreds of small layers."""
        m = self._modules
        return m["lora_A"]._parameters[name], m["lora_B"]._parameters[name], self._buffers[f"scaling_{name}"]

    def _lora_cast(self, name: str, x: torch.Tensor) -> tuple:
        """`_lora` and the half-precision copies of A and B that an eager CUDA step of x reads, made ahead for the
        whole model (fdlora.layers.trainable.half_casts; None where the layer makes its own)."""
        A, B, scale = self._lora(name)
        if not train_ops._half_pair(x):
            return A, B, scale, None
        return A, B, scale, self.state.halves.get((self.path, name), A, B, self.scale_f[name], scale, x.dtype)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        st = self.state
        x = _autocast_input(x, st)
        if st.samples is None:
            have = self._modules["lora_A"]._parameters
            names = [n for n in st.active if n in have]
            if not names:
                return self._modules["base"](x, *args, **kwargs)
            return self._blend(x, names, args, kwargs)
        if len(st.samples) != x.shape[0]:
            raise FdLoraError(f"{self.path}: {len(st.samples)} per-sample adapters given for a batch of "
                              f"{x.shape[0]}; give one entry (an adapter name or None) per sample.")
        y = self._base_out(x, args, kwargs)
        for name in dict.fromkeys(n for n in st.samples if n is not None and n in self.lora_A):
            idx = st.sample_index(name, x.device)
            ys = self._add_lora(x.index_select(0, idx), y.index_select(0, idx), name)
            y = y.index_copy(0, idx, ys)
        return y

    def _base_out(self, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        return self.base(x, *args, **kwargs)

    def extra_repr(self) -> str:
        ranks = {n: a.shape[0] for n, a in self.lora_A.items()}
        return f"path={self.path!r}, adapters={ranks}"


class TrainableLoraLinear(_TrainableLora):
    kind = "linear"

    def __init__(self, base: nn.Module, path: str, state: TrainState) -> None:
        dims = linear_dims(base)
        if dims is None:
            raise FdLoraError(f"{path}: {type(base).__name__} is not Linear-like (no in_features/out_features).")
        super().__init__(base, path, state)
        self.in_features, self.out_features = dims
        self.a_shape = (dims[0],)
        self._run_4bit = frozen_4bit(base)  # chosen once: how a 4-bit base runs inside the op, or None

    def _plain_weight(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(W, bias) when the base is a frozen float nn.Linear the op can run itself, else None."""
        b = self._modules["base"]
        if type(b) is not nn.Linear or args or kwargs:
            return None
        W, bias = b._parameters["weight"], b._parameters["bias"]
        if W.requires_grad or (bias is not None and bias.requires_grad):
            return None
        return W, bias

    def _base_out(self, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """The wrapped module's output. Under an inference FusedLoraLinear in blend mode, its frozen blend is
        recomputed here in plain torch (autograd carries grad_x through it on every backend; the inference
        kernels write in place and have no backward)."""
        inner = self.base
        if not (type(inner) is FusedLoraLinear and inner.state.mode is Mode.BLEND and not args and not kwargs):
            return self.base(x, *args, **kwargs)
        y = inner.base(x)
        if inner._skip():
            return y
        b, K, N = inner.bank, self.in_features, self.out_features
        S, R = b.A.shape[0], b.A.shape[1]
        x2 = x.reshape(-1, K).to(b.A.dtype)
        h = (x2 @ b.A.reshape(S * R, K).t()).float() * inner.scale_blend[:S].repeat_interleave(R)
        d = h @ b.B.reshape(N, S * R).float().t()
        if b.bias is not None:
            d = d + inner.scale_blend[:S] @ b.bias.float()
        return (y.float() + d.view(*y.shape)).to(y.dtype)

    def _inside_base(self, args: tuple, kwargs: dict) -> nn.Module | None:
        """The base, when the op may run it inside (a frozen 4-bit base called on x alone, with no backward hooks
        and no trainable bias: all its backward would do is gy W), else None."""
        run = self._run_4bit
        b = self._modules["base"]
        if run is None or args or kwargs or run.module is not b:
            return None
        bias = b._parameters.get("bias")
        if b._backward_hooks or b._backward_pre_hooks or (bias is not None and bias.requires_grad):
            return None
        return b

    def _blend(self, x: torch.Tensor, names: list[str], args: tuple, kwargs: dict) -> torch.Tensor:
        plain = self._plain_weight(args, kwargs)
        if plain is None and (inside := self._inside_base(args, kwargs)) is not None:
            y = train_ops.train_linear_over(inside, self._run_4bit, x, self._lora_input(names[0], x),
                                            *self._lora_cast(names[0], x))
            for name in names[1:]:
                y = self._add_lora(x, y, name)
            return y
        y, (W, bias) = (None, plain) if plain is not None else (self._base_out(x, args, kwargs), (None, None))
        for name in names:
            y = train_ops.train_linear(x, self._lora_input(name, x), y, W, bias, *self._lora_cast(name, x))
            W = bias = None  # the base goes into the first adapter's call only
        return y

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor, name: str) -> torch.Tensor:
        return train_ops.train_linear(x, self._lora_input(name, x), y, None, None, *self._lora_cast(name, x))


class TrainableLoraConv2d(_TrainableLora):
    kind = "conv2d"

    def __init__(self, base: nn.Module, path: str, state: TrainState) -> None:
        conv = getattr(base, "base", base)  # an inference FusedLoraConv2d keeps the nn.Conv2d as .base
        if not isinstance(conv, nn.Conv2d) or conv.groups != 1:
            raise FdLoraError(f"{path}: trainable conv LoRA needs an nn.Conv2d with groups=1, "
                              f"got {type(conv).__name__}.")
        super().__init__(base, path, state)
        self.out_features = conv.out_channels
        self.a_shape = (conv.in_channels, *conv.kernel_size)
        self.stride, self.padding = list(conv.stride), conv.padding
        if isinstance(self.padding, str):
            raise FdLoraError(f"{path}: padding={self.padding!r} convolutions are not supported for LoRA training.")
        self.padding = list(self.padding)

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor, name: str) -> torch.Tensor:
        u = self._lora_input(name, x)
        A, B, scale = self._lora(name)
        return train_ops.train_conv2d(x if u is None else u, y, A, B, scale, self.stride, self.padding)

    def _blend(self, x: torch.Tensor, names: list[str], args: tuple, kwargs: dict) -> torch.Tensor:
        y = self._modules["base"](x, *args, **kwargs)
        for name in names:
            y = self._add_lora(x, y, name)
        return y


class SavedCopy(_Passthrough):
    """modules_to_save: the frozen original plus one trainable copy per adapter; a call runs the copy of the first
    active adapter that has one (PEFT's ModulesToSaveWrapper, without its class switching)."""

    def __init__(self, base: nn.Module, path: str, state: TrainState) -> None:
        super().__init__()
        self.base = base
        self.path = path
        self.copies = nn.ModuleDict()
        object.__setattr__(self, "state", state)

    def add(self, name: str) -> None:
        import copy

        c = copy.deepcopy(self.base)
        for p in c.parameters():
            p.requires_grad_(True)
        self.copies[name] = c

    def forward(self, *args, **kwargs):
        st = self.state
        if st.samples is not None and any(n in self.copies for n in st.samples if n is not None):
            raise FdLoraError(f"{self.path}: modules_to_save copies cannot be trained per sample; "
                              "train adapters with modules_to_save one at a time.")
        for name in st.active:
            if name in self.copies:
                return self.copies[name](*args, **kwargs)
        return self.base(*args, **kwargs)


TRAINABLE = (TrainableLoraLinear, TrainableLoraConv2d)
