"""The canonical adapter: the one type every format converts into and every layer loads from.

Nothing downstream of a converter looks at state-dict keys: a `LoraAdapter` maps module paths
(relative to the model it targets, e.g. ``down_blocks.0.attentions.0.proj_in``) to `ModuleLora`
weights in the layout of ``nn.Linear`` / ``nn.Conv2d``:

    linear:  A [r, K], B [N, r]             delta = (x A^T) B^T * scale
    conv2d:  A [r, C_in, kh, kw], B [N, r, 1, 1]   (kohya LoCon: A has the base kernel/stride/padding)
    experts: A [E, r, K], B [E, N, r]       expert e: delta_e = (x A_e^T) B_e^T * scale, on the tokens routed
             to e (a fused expert parameter such as Mixtral's gate_up_proj [E, N, K]; fdlora.layers.modules.moe_experts)

with ``scale = alpha / r`` (or ``alpha / sqrt(r)`` for rsLoRA) times the user's weight.

LyCORIS LoHa / LoKr / full ``diff`` modules arrive here as *exact* A/B factors of their ΔW
(fdlora.hub.formats.lycoris; `origin` says which), a non-Tucker conv one with a flat A [r, C*kh*kw]
that `fit_to` shapes once the target layer is known. A DoRA module carries its `magnitude` [N]
(fdlora.layers.modules.dora applies it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..errors import AdapterNameError, AdapterShapeError, FormatError, NonFiniteError

LayerKind = Literal["linear", "conv2d", "experts"]
MAX_SCALE = 1e4  # |alpha / r| above this is a corrupt alpha, not a style (real files stay under ~100)


RESERVED_NAMES = ("__base__",)  # "__base__" means "no adapter" in per-sample / per-row specs
MAX_NAME = 256


def check_adapter_name(name: object) -> str:
    """`name` if fd-lora can use it as an adapter name: a non-empty string of printable characters, at most
    `MAX_NAME` long, not reserved. Raises AdapterNameError naming the rule otherwise."""
    if not isinstance(name, str):
        raise AdapterNameError(f"an adapter name must be a string, got {type(name).__name__} {str(name)[:40]!r}.")
    if not name or len(name) > MAX_NAME or not name.isprintable():
        raise AdapterNameError(f"adapter name {name[:60]!r} is not usable: give 1..{MAX_NAME} printable characters.")
    if name in RESERVED_NAMES:
        raise AdapterNameError(f"{name!r} is reserved (it selects the base model in per-sample specs); pick another "
                               "adapter_name.")
    return name



def _finite(tensors) -> list[bool]:
    """Whether each tensor holds no NaN / Inf. One fp32 sum per tensor screens them (a NaN or Inf anywhere makes
    the sum non-finite; finite fp16 values cannot overflow it): ~6x faster than an elementwise check on the 1,444
    tensors of an SDXL adapter. A tensor whose sum is not finite is checked element by element (large finite
    bf16 / fp32 values can overflow the sum)."""
    tensors = list(tensors)
    sums = [t.sum(dtype=torch.float32) if t.is_floating_point() else None for t in tensors]
    devices = {s.device for s in sums if s is not None}
    if len(devices) == 1:
        screened = torch.stack([s for s in sums if s is not None]).isfinite().tolist()
        it = iter(screened)
        screen = [next(it) if s is not None else False for s in sums]
    else:
        screen = [bool(s.isfinite()) if s is not None else False for s in sums]
    return [ok or bool(torch.isfinite(t).all()) for t, ok in zip(tensors, screen)]

@dataclass(frozen=True)
class Provenance:
    """Where an adapter came from: enough to find the exact bytes again."""

    source: str = "<memory>"  # repo id, path, or "<memory>"
    revision: str | None = None  # commit sha when resolved through the Hub
    file: str | None = None
    format: str = "canonical"
    component: str | None = None  # pipeline component the module paths are relative to (unet, text_encoder, ...)


@dataclass
class ModuleLora:
    """LoRA weights for one module. `alpha` defaults to the rank (scale 1)."""

    A: torch.Tensor
    B: torch.Tensor
    alpha: float | None = None
    bias: torch.Tensor | None = None  # lora_B bias [N] (PEFT lora_bias=True, LyCORIS diff_b); scaled like the delta
    magnitude: torch.Tensor | None = None  # DoRA m [N] per output channel (PEFT lora_magnitude_vector, dora_scale)
    dora_eps: float = 0.0  # added to DoRA's weight norm (LyCORIS adds its dtype's eps; PEFT adds none)
    origin: str = "lora"  # what the file stored: lora | loha | lokr | full (the factors are exact either way)
    # set by LoraAdapter.check_finite once these tensors passed: cached adapters are checked once, not per load
    finite: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.A.dim() not in (2, 3, 4) or self.A.dim() != self.B.dim():
            raise AdapterShapeError(
                f"LoRA A {tuple(self.A.shape)} / B {tuple(self.B.shape)}: expected A [r, K] and B [N, r] "
                "(linear), A [r, C_in, kh, kw] and B [N, r, 1, 1] (conv2d) or A [E, r, K] and B [E, N, r] (experts)."
            )
        if self.A.dim() == 3 and self.A.shape[0] != self.B.shape[0]:
            raise AdapterShapeError(f"expert LoRA A {tuple(self.A.shape)} / B {tuple(self.B.shape)}: A [E, r, K] and "
                                    "B [E, N, r] must have the same number of experts E.")
        if self.B.shape[-1 if self.A.dim() == 3 else 1] != self.rank:
            raise AdapterShapeError(
                f"LoRA rank mismatch: A {tuple(self.A.shape)} has rank {self.rank} but B is {tuple(self.B.shape)}; "
                "A must be [r, K] and B [N, r] (experts: A [E, r, K], B [E, N, r])."
            )
        if self.A.dim() == 4 and tuple(self.B.shape[2:]) != (1, 1):
            raise AdapterShapeError(f"conv LoRA B must be [N, r, 1, 1], got {tuple(self.B.shape)}.")
        if 0 in self.A.shape or 0 in self.B.shape:
            raise AdapterShapeError(f"LoRA A {tuple(self.A.shape)} / B {tuple(self.B.shape)} has an empty dimension; "
                                    "a LoRA needs rank >= 1 and non-empty features. The file is corrupt.")
        if self.magnitude is not None and tuple(self.magnitude.shape) != (self.out_features,):
            raise AdapterShapeError(f"DoRA magnitude {tuple(self.magnitude.shape)} does not match the "
                                    f"{self.out_features} outputs of B {tuple(self.B.shape)}.")
        if self.alpha is None:
            self.alpha = float(self.rank)
        self.alpha = float(self.alpha)  # (checked finite by __setattr__)

    def __setattr__(self, name, value) -> None:  # converters set alpha after building: check it every time
        if name == "alpha" and value is not None:
            value = float(value)
            if not math.isfinite(value):
                raise FormatError(f"LoRA alpha is {value}; it must be a finite number. The file's alpha (a .alpha "
                                  "tensor, lora_alpha in its config or metadata) is corrupt.")
        object.__setattr__(self, name, value)

    @property
    def rank(self) -> int:
        shape = self.A.shape  # (loads ask it of every module, several times: one tensor call)
        return int(shape[1 if len(shape) == 3 else 0])

    @property
    def kind(self) -> LayerKind:
        return {2: "linear", 3: "experts"}.get(self.A.dim(), "conv2d")

    @property
    def in_features(self) -> int:
        return int(self.A.shape[-1 if self.A.dim() == 3 else 1])

    @property
    def out_features(self) -> int:
        return int(self.B.shape[1 if self.B.dim() == 3 else 0])

    def scaling(self, use_rslora: bool = False) -> float:
        return self.alpha / (math.sqrt(self.rank) if use_rslora else self.rank)

    def nbytes(self) -> int:
        extra = sum(t.nbytes for t in (self.bias, self.magnitude) if t is not None)
        return self.A.nbytes + self.B.nbytes + extra

    @classmethod
    def checked(cls, fields: dict) -> ModuleLora:
        """A module from the fields of one that a constructor already checked (in fd-lora's reader process,
        fdlora.hub.worker), without checking them again: a background load rebuilds ~700 of these on the thread
        that shares the GIL with serving."""
        m = cls.__new__(cls)
        m.__dict__.update(fields)
        return m

    def replace(self, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None,
                magnitude: torch.Tensor | None = None, **kw) -> ModuleLora:
        """A copy with other tensors (moved, packed, cast, reshaped) and every other field kept."""
        mag = self.magnitude if magnitude is None else magnitude
        return dataclasses.replace(self, A=A, B=B, bias=bias, magnitude=mag, **kw)


@dataclass
class LoraAdapter:
    """A whole adapter: module path -> weights, plus how to scale them and where it came from."""

    modules: dict[str, ModuleLora]
    use_rslora: bool = False
    name: str | None = None
    provenance: Provenance = field(default_factory=Provenance)

    def __post_init__(self) -> None:
        if not self.modules:
            raise FormatError("an adapter needs at least one module; this one has none.")

    def scaling(self, path: str) -> float:
        return self.modules[path].scaling(self.use_rslora)

    def scales(self) -> list[float]:
        """Every module's `ModuleLora.scaling`, in module order (check_finite and the handle's commit both ask)."""
        rslora = self.use_rslora
        return [m.scaling(rslora) for m in self.modules.values()]

    def nbytes(self) -> int:
        return sum(m.nbytes() for m in self.modules.values())

    def check_finite(self, name: str | None = None) -> None:
        """Raise NonFiniteError on NaN/Inf in the weights, or a scale (alpha / r) that is not finite or above
        `MAX_SCALE` in size. `name` is what the message calls the adapter (default: its own name). Tensors that
        passed before are skipped (they are treated as read-only once loaded; an in-place edit must reset
        `ModuleLora.finite`); scales are checked every time (a float each)."""
        who = f"adapter {name or self.name!r}" if (name or self.name) else "the adapter"
        todo = []
        for (path, m), scale in zip(self.modules.items(), self.scales()):
            if not -MAX_SCALE <= scale <= MAX_SCALE:  # (False for NaN and +-Inf too)
                raise NonFiniteError(
                    f"{who}: {path} has alpha {m.alpha:g} at rank {m.rank}, a scale of {scale:g} (limit "
                    f"+-{MAX_SCALE:g}); the file's alpha is corrupt. Load another revision, or pass validate=False "
                    "to skip this check."
                )
            if not m.finite:
                todo += [(path, what, t) for what, t in (("A", m.A), ("B", m.B), ("bias", m.bias),
                                                         ("magnitude", m.magnitude)) if t is not None]
        for (path, what, _), ok in zip(todo, _finite(t for _, _, t in todo)):
            if not ok:
                raise NonFiniteError(
                    f"{who}: {path}.{what} contains NaN or Inf; "
                    "the file is corrupt or was saved from a diverged run. Load another revision, "
                    "or pass validate=False to skip this check."
                )
        for m in self.modules.values():
            if not m.finite:
                m.finite = True

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> LoraAdapter:
        def cv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype)

        mods = {p: m.replace(cv(m.A), cv(m.B), cv(m.bias), cv(m.magnitude), finite=False)
                for p, m in self.modules.items()}
        return LoraAdapter(mods, self.use_rslora, self.name, self.provenance)

    def __repr__(self) -> str:
        ranks = sorted({m.rank for m in self.modules.values()})
        return (
            f"LoraAdapter(name={self.name!r}, modules={len(self.modules)}, ranks={ranks}, "
            f"rslora={self.use_rslora}, from={self.provenance.source!r}@{self.provenance.revision})"
        )
