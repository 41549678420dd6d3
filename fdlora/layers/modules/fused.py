"""FusedLoraLinear / FusedLoraConv2d: the untouched base module plus every loaded adapter.

    y = base(x) + sum_s scale[s] * (x A_s^T) B_s^T        (one op call, backend chosen once)

The base module is kept as is (nn.Linear, transformers Conv1D, nn.Conv2d, or any opaque
Linear-like module such as a quantized linear: base output + delta), so restoring the model is
putting the same object back. The mode comes from the shared `ModelState`; all shapes are static.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fdlora import env
from fdlora.errors import AdapterShapeError, FdLoraError
from fdlora.hub.adapter import ModuleLora
from fdlora.kernels import registry
from fdlora.layers.fastpath import decode, hot, percall, remerge
from fdlora.layers.fastpath import merged as _merged
from fdlora.layers.fastpath.merged import MergedWeight, blend_key, merged_key
from fdlora.layers.modules import dora
from fdlora.layers.quant import dequant, gguf, quantized
from fdlora.layers.state import Mode, ModelState
from fdlora.layers.storage import offload
from fdlora.layers.storage.bank import AdapterBank

logger = logging.getLogger("fdlora")
dispatch_log = logging.getLogger("fdlora.dispatch")
_UNSEEN = (object(), None)
GROUP_MIN_ROWS = 64  # rows per sample from which per-sample calls run on per-blend merged copies (diffusion sizes)


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): weight [K, N], y = x W + b."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a Linear-like module, or None if it is not one."""
    if _is_conv1d(module):
        K, N = module.weight.shape
        return int(K), int(N)
    K, N = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if isinstance(K, int) and isinstance(N, int) and not isinstance(module, nn.modules.conv._ConvNd):
        return K, N
    return None


def compute_dtype(module: nn.Module, default: torch.dtype = torch.float32) -> tuple[torch.dtype, torch.device]:
    """The float dtype and device the module computes in (quantized bases report a compute dtype)."""
    w = getattr(module, "weight", None)
    device = w.device if isinstance(w, torch.Tensor) else torch.device("cpu")
    dtype = quantized.compute_dtype(module)  # float8 storage, GGUF, bitsandbytes: the dtype they compute in
    if dtype is not None:
        return dtype, device
    if isinstance(w, torch.Tensor) and w.is_floating_point():
        return w.dtype, device
    return default, device


@dataclass(frozen=True)
class LayerSpec:
    """What a LoRA for a module must look like: kind, A's shape after the rank, B's rows."""

    kind: str
    a_shape: tuple[int, ...]
    out_features: int


def spec_of(module: nn.Module) -> LayerSpec | None:
    """The LoRA shape a module takes, or None if fd-lora cannot wrap it."""
    if isinstance(module, _FusedLora):
        module = module.base
    if isinstance(module, nn.Conv2d):
        return LayerSpec("conv2d", (module.in_channels // module.groups, *module.kernel_size), module.out_channels)
    dims = linear_dims(module)
    return None if dims is None else LayerSpec("linear", (dims[0],), dims[1])


def check_fits(spec: LayerSpec, m: ModuleLora, path: str, what: str) -> None:
    """Raise a clear error if LoRA weights `m` cannot go into a module of shape `spec`."""
    if m.kind != spec.kind:
        raise AdapterShapeError(f"{what}: a {m.kind} LoRA cannot target {path}, which is a {spec.kind} layer.")
    if tuple(m.A.shape[1:]) != spec.a_shape or m.out_features != spec.out_features:
        raise AdapterShapeError(
            f"{what}: LoRA for {path} has A {tuple(m.A.shape)} and B {tuple(m.B.shape)}, but the module takes "
            f"A [r, {', '.join(map(str, spec.a_shape))}] and B [{spec.out_features}, r]. "
            "The adapter was made for another base model (or another variant of it)."
        )
    if not (m.A.is_floating_point() and m.B.is_floating_point()):
        raise AdapterShapeError(f"{what}: {path} weights are {m.A.dtype}/{m.B.dtype}; LoRA weights must be float.")
    if m.bias is not None and tuple(m.bias.shape) != (spec.out_features,):
        raise AdapterShapeError(f"{what}: {path} lora bias is {tuple(m.bias.shape)}, expected ({spec.out_features},).")


class _FusedLora(nn.Module):
    kind = "linear"

    def __init__(self, base: nn.Module, state: ModelState, index: int, path: str,
                 rank: int, a_shape: tuple[int, ...], out_features: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        bdtype, device = compute_dtype(base)
        device = offload.home(base, device)  # an offloaded (meta) weight: fdlora.layers.storage.offload
        self.base = base
        self.bank = AdapterBank(state.slots.capacity, rank, out_features, a_shape, dtype or bdtype, device)
        # plain attributes straight into the instance dict: nn.Module.__setattr__'s checks cost ~0.3 s of a first
        # SDXL-size load (722 layers); `state` is shared and `merged` derived (fdlora.layers.fastpath.merged),
        # neither a child
        self.__dict__.update(path=path, index=index, out_features=out_features, state=state, merged=MergedWeight(),
                             selection=None, _plain=False, _whole=False)  # the backend and _plain/_whole: set by
        # select_backend below
        self._fast_children()
        self.rebind()
        self.select_backend()
        registry.track(self)

    def _fast_children(self) -> None:
        """Also keep `base` and `bank` in the instance dict: the forward path reads them without going
        through nn.Module.__getattr__ (they stay registered submodules; reassigning one drops the copy)."""
        self.__dict__["base"], self.__dict__["bank"] = self._modules["base"], self._modules["bank"]
        _merged.bind(self)  # (here: __init__, moves and copies all pass through)

    @property
    def weight(self) -> torch.Tensor:
        """The base module's weight: model code that reads `layer.weight` (T5, PEFT) keeps working."""
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)

    # --- wiring -------------------------------------------------------------------------------
    def rebind(self) -> None:
        """Point this layer's scale views at the shared table on its device."""
        t = self.state.table.on(self.bank.A.device)
        self.__dict__.update(scale_blend=t[0, self.index],  # [S] weight * alpha / r
                             scale_unit=t[1, self.index],  # [S] alpha / r
                             blend_weight=self.state.ones(self.bank.A.device))  # [1, S] group weight of blend mode

    def select_backend(self) -> None:
        A = self.bank.A
        p = registry.Problem(A.device.type, A.dtype, self.kind, self.bank.rank_capacity, self.bank.slots)
        try:
            self.selection = registry.select(p)
        except FdLoraError as e:
            raise type(e)(f"{self.path}: {e}") from None

    @property
    def _ops(self):
        return self.selection.backend.ops

    def _apply(self, fn, recurse=True):  # .to() / .half(): follow the bank to its new device and dtype
        super()._apply(fn, recurse)
        self._fast_children()
        self.rebind()
        self.select_backend()
        self.release_merged()
        return self

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._fast_children()

    def release_merged(self) -> None:
        """Drop the merged-weight copy, if any (restore, unwrap, device or dtype moves)."""
        self.merged.release()

    def _seen_weight(self) -> None:
        w = self.base._parameters.get("weight")
        self.__dict__["_seen_w"] = (w, None if w is None else w.dtype)

    def plain_now(self) -> bool:
        """`_plain`, re-derived when the base's weight was replaced or changed dtype under the layer (torchao's
        quantize_ or diffusers' enable_layerwise_casting run after fd-lora wrapped the model): a quantized or
        float8-stored weight is never read as a float matrix (fdlora.layers.quant.quantized), and a merged copy made
        from the old weight is dropped. Two identity compares per call otherwise."""
        if self.__dict__.get("offloaded"):  # offload hooks swap the weight every call; such a layer is never plain
            return False
        w, dtype = self.__dict__.get("_seen_w", _UNSEEN)  # (a layer pickled before this check: derive it now)
        now = self.base._parameters.get("weight")
        if now is not w or (now is not None and now.dtype is not dtype):
            self.rebind()  # (a hook that replaced the weight, e.g. accelerate's dispatch, may have moved the bank too)
            self.select_backend()
            if not self._plain:
                self.release_merged()
                logger.debug("fd-lora: %s: base weight is now %s: base output + LoRA delta, no merged copy",
                             self.path, quantized.kind(self.base) or "not plain")
        return self._plain

    # --- loading ------------------------------------------------------------------------------
    def check(self, m: ModuleLora, what: str) -> None:
        spec = self.__dict__.get("_spec")
        if spec is None:
            spec = self.__dict__["_spec"] = spec_of(self.base)  # fixed for the layer's life: loads check often
        check_fits(spec, m, self.path, what)

    # --- merged-weight cache (fdlora.layers.fastpath.merged) -------------------------------------------------
    def _cached(self) -> bool:
        """This call may use the merged-weight cache: eager blend mode with something active, on a plain base.
        (The compile check comes before reading `active`: a traced graph must not guard on the active set.)"""
        st = self.state
        return (st.mode is Mode.BLEND and self._plain and not st.static and not torch.compiler.is_compiling()
                and bool(st.active))

    def _merged_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The base module's computation on W' from the merged-weight cache, or None when this call may not use
        it. The hot path of eager inference: plain dict reads, no nn.Module attribute lookups; while the cache
        key holds, nothing about the bank can have changed, so only per-call conditions are checked."""
        params = self.base._parameters  # _plain: a plain nn.Linear / Conv1D / nn.Conv2d
        w = params["weight"]
        remerge.note_rows(self, x)
        if ((torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
                or (x.is_cuda and torch._C._cuda_isCurrentStreamCapturing())):
            return None
        merged = self.merged
        buf = merged.buf
        if buf is None and merged.denied == _merged.BUDGET.generation:  # no room for this layer (or cache off)
            return None
        if buf is None or merged.key != blend_key(self, w):
            bank = self.bank
            if bank._buffers["bias"] is not None or True not in bank.used:
                return None
            buf = remerge.refresh(self, w)
            if buf is None:
                return None
        fn = self._weight_fn(buf, params["bias"])
        hot.keep(self, x, fn, buf)  # the next calls like this one: a few compares, then fn (fdlora.layers.fastpath.hot)
        return fn(x)

    def merge_into(self, out: torch.Tensor, W: torch.Tensor, stamp: torch.Tensor) -> None:
        """out = W + sum_s scale_blend[s] B_s A_s, shaped like the base weight (the device-checked cache of
        compiled, frozen and captured calls), unless `stamp` says on the device that out already holds this blend of
        this bank (fdlora.layers.fastpath.merged; eager calls refresh through fdlora.layers.fastpath.remerge)."""
        self._ops.lora_merge(*remerge.entry(self, out, W, self.scale_blend[:self.bank.slots]), stamp,
                             self.bank.dversion)

    def prepare_merge(self, out: torch.Tensor, W: torch.Tensor, stamp: torch.Tensor):
        """merge_into now, and that launch kept ready to replay (the backend's prepare_merge), or None."""
        prepare = getattr(self._ops, "prepare_merge", None)
        if prepare is None:
            self.merge_into(out, W, stamp)
            return None
        return prepare(*remerge.entry(self, out, W, self.scale_blend[:self.bank.slots]), stamp, self.bank.dversion)

    # --- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        fn = None if args or kwargs else hot.get(self, x)  # a repeat of the last call: fdlora.layers.fastpath.hot
        if fn is not None:
            return fn(x)
        y = self._common_forward(x, args, kwargs)
        return y if y is not None else self._kind_forward(x, args, kwargs)

    def _common_forward(self, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The start every layer kind's forward shares: follow offload hooks and weight changes, then the autograd
        (reference), DoRA and merged-weight-cache paths; None when the kind's own paths decide."""
        # an offload hook moved or replaced tensors (fdlora.layers.storage.offload); traced graphs must not guard on it
        if not torch.compiler.is_compiling() and offload.stale(self, x):
            offload.follow(self, x.device)
        self.plain_now()  # a weight quantized / recast under the layer (fdlora.layers.quant.quantized)
        if self._needs_autograd(x):
            self._took("reference (autograd)", x)
            return self._reference_forward(x, args, kwargs)
        if self.bank._buffers["magnitude"] is not None:  # a DoRA slot: fdlora.layers.modules.dora serves every mode
            self._took("dora", x)
            return dora.forward(self, x, args, kwargs)
        if self._cached():
            y = self._merged_forward(x)
            if y is not None:
                self._took("merged cache", x)
            return y
        return None

    def dispatch_path(self) -> str:
        """The path this layer's last full call took and its backend; for lora_linear the dispatcher's plan for that
        shape, where the backend plans in Python."""
        path = self.__dict__.get("dispatch", "not called")
        rows = self.__dict__.get("dispatch_rows")
        plan_of = getattr(self._ops, "plan_of", None) if path == "lora_linear" else None
        if plan_of is not None and rows is not None:
            A, _, _, _ = self._bank()
            path = f"lora_linear: {plan_of(self.base.weight, A, *rows)}"
        return f"{path} [{self.selection.name}]"

    def _took(self, path: str, x: torch.Tensor) -> None:
        """Record the path this call took (fdlora.dispatch_counts), logged on "fdlora.dispatch" under
        FDLORA_DEBUG_DISPATCH=1 when it changes. The hot path replays the recorded call and records nothing; a traced
        call records nothing either (reading the record would make the graph guard on the path eager calls took)."""
        if not torch.compiler.is_compiling() and self.__dict__.get("dispatch") != path:
            self.__dict__["dispatch"] = path
            if env.debug_dispatch():
                dispatch_log.warning("%s %s x%s on %s -> %s", self.path, type(self.base).__name__, tuple(x.shape),
                                     self.selection.name, path)

    def _needs_autograd(self, x: torch.Tensor) -> bool:
        """A call whose input carries gradients (a trainable adapter or module before this layer, input
        gradients) on a kernel backend: the kernels' ops have no backward, so the reference computes it."""
        return (torch.is_grad_enabled() and x.requires_grad and self.selection.backend is not _REFERENCE.backend
                and not torch.compiler.is_compiling())

    def _reference_forward(self, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """This call on the torch reference (differentiable: plain torch ops); the layer's selection is restored
        after. Calls on one model are serialized (fdlora.runtime.scope), so no other call sees the swap."""
        selection = self.selection
        self.selection = _REFERENCE
        try:
            return self.forward(x, *args, **kwargs)
        finally:
            self.selection = selection

    def _skip(self) -> bool:
        st = self.state
        if st.mode is Mode.OFF:
            return True
        if st.static or torch.compiler.is_compiling():
            return False  # no host-side shortcuts: a switch must not change the traced graph
        return (st.mode is Mode.BLEND and not st.active) or not any(self.bank.used)

    def _bank(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(A, B, ranks, S): in eager mode the torch backend only computes over the live slots and rank;
        compiled or frozen models, and kernels that skip the padding themselves, get the whole bank."""
        b = self.bank
        if self.selection.name == "torch" and not (
                self.state.static or torch.compiler.is_compiling()):
            S, R = b.extent()
            return b.A[:S, :R], b.B[:, :S, :R], b.ranks[:S], S
        return b.A, b.B, b.ranks, b.slots

    def _weights(self, x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale [S], group_weight [G, S]) for the blend and per-sample modes."""
        if self.state.mode is Mode.BLEND:
            return self.scale_blend, self.blend_weight
        gw = self.state.group_weight(x.shape[0], rows, x.device)
        if gw is None or rows % gw.shape[0]:
            given = sorted({b for (b, _) in self.state._group_weight})
            raise FdLoraError(
                f"{self.path}: per-sample adapters were given for batch sizes {given}, but this input has shape "
                f"{tuple(x.shape)}; give one entry per sample of the batch."
            )
        return self.scale_unit, gw

    def _add_bias(self, y2: torch.Tensor, scale: torch.Tensor, gw: torch.Tensor, row_slot: torch.Tensor | None) -> None:
        bias = self.bank.bias.float()  # [S, N]
        if row_slot is not None:
            S = bias.shape[0]
            onehot = (row_slot.long()[:, None] == torch.arange(S, device=row_slot.device)).float()
            d = (onehot * scale) @ bias  # [M, N]
        else:
            G = gw.shape[0]
            d = ((gw * scale) @ bias).repeat_interleave(y2.shape[0] // G, dim=0)
        y2.copy_((y2.float() + d).to(y2.dtype))

    def extra_repr(self) -> str:
        b = self.bank
        return (f"path={self.path!r}, slots={b.slots}, rank_capacity={b.rank_capacity}, dtype={b.A.dtype}, "
                f"backend={self.selection}")


_REFERENCE = registry.Selection(registry.backends()["torch"],
                                ("autograd: the torch reference (kernels have no backward)",))


class FusedLoraLinear(_FusedLora):
    kind = "linear"

    def __init__(self, base: nn.Module, state: ModelState, index: int, path: str, rank: int,
                 dtype: torch.dtype | None = None) -> None:
        dims = linear_dims(base)
        if dims is None:
            raise FdLoraError(f"{path}: {type(base).__name__} is not Linear-like (no in_features/out_features).")
        super().__init__(base, state, index, path, rank, (dims[0],), dims[1], dtype)
        self.in_features = dims[0]

    def select_backend(self) -> None:
        super().select_backend()
        A = self.bank.A
        linear = type(self.base) is nn.Linear
        # a plain float nn.Linear / Conv1D in the bank's dtype: the merged-weight cache applies (not a torchao,
        # GGUF or float8-stored weight, even inside an nn.Linear: fdlora.layers.quant.quantized)
        self._plain = (linear or _is_conv1d(self.base)) and quantized.plain_weight(self.base, A.dtype, A.device)
        self._seen_weight()
        # the backend computes base GEMM + LoRA in one op (fdlora.kernels.triton.forward.lora_linear): nn.Linear only
        self._whole = linear and self._plain and self.selection.name != "torch" and hasattr(self._ops, "lora_linear")
        offload.note(self)  # under offload hooks: neither plain nor whole (fdlora.layers.storage.offload)
        # a base that dequantizes W per call (diffusers GGUF, torchao weight-only): blend calls merge into that W
        self._dequant = gguf.route(self) or dequant.route(self)

    def _on_device_cache(self, x: torch.Tensor) -> bool:
        """Blend calls that may not branch on the host (compiled, frozen, being captured) use the merged-weight
        cache through fdlora::merged_linear (fdlora.layers.fastpath.merged), which checks for changes on the device."""
        return (type(self.base) is nn.Linear and self._plain and _merged.BUDGET.enabled(x.device.type)
                and (self.state.static or torch.compiler.is_compiling()
                     or (x.is_cuda and torch.cuda.is_current_stream_capturing()))
                and not (torch.is_grad_enabled() and (x.requires_grad or self.base.weight.requires_grad)))

    def per_call_linear(self, x: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor,
                        B: torch.Tensor, scale: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        """y = x W^T + bias + blend LoRA by the per-call kernels (merged_linear's path when the budget is full)."""
        gw = self.blend_weight[:, :A.shape[0]]
        if self._whole:
            return self._ops.lora_linear(x, W, bias, A, B, scale, gw, ranks)
        y = F.linear(x, W, bias)
        self._ops.lora_delta(y, x, A, B, scale, gw, ranks)
        return y

    def _kept_linear(self, x: torch.Tensor) -> torch.Tensor | None:
        """An eager blend call without the merged-weight cache through the backend's kept-ready form of lora_linear
        (prepare_linear: one merge replayed with bound arguments, one GEMM), made once per shape, stream and
        addresses; None when this call does not take it (compiled, frozen, capturing, autograd, a lora bias, or a
        shape the dispatch runs on another path)."""
        st, b, base = self.state, self.bank, self.base
        prepare = getattr(self._ops, "prepare_linear", None)
        W = base.weight
        if (prepare is None or st.static or torch.compiler.is_compiling() or b._buffers["bias"] is not None
                or (torch.is_grad_enabled() and (x.requires_grad or W.requires_grad))
                or torch._C._cuda_isCurrentStreamCapturing()):
            return None
        x2 = x.reshape(-1, self.in_features).to(W.dtype)
        stream = torch._C._cuda_getCurrentRawStream(x.device.index)
        key = (x2.shape[0], x2.dtype, stream, W.data_ptr(), b.A.data_ptr(), self.scale_blend.data_ptr())
        kept = self.__dict__.get("_kept")
        if kept is None or kept[0] != key:
            kept = self.__dict__["_kept"] = (key, prepare(x2, W, base.bias, b.A, b.B, self.scale_blend, b.ranks,
                                                          stream))
        if kept[1] is None:
            return None
        if x.dtype is W.dtype:  # the next calls like this one: straight to the bound call (fdlora.layers.fastpath.hot)
            hot.keep(self, x, kept[1])
        return kept[1](x2).view(*x.shape[:-1], self.out_features)

    def _grouped_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Per-sample adapters at merged speed: the batch's distinct blends each get a merged-weight copy
        (fdlora.layers.fastpath.remerge.refresh_groups), and each group of samples runs one GEMM on its copy (an
        all-zero blend on W itself). None when this call does not take this path: not eager, autograd, few rows per
        sample (decode: the per-row kernel is cheaper than a copy per adapter), more blends than copies, no room.
        The copies a layer found are kept with the batch's grouping, its key and the budget's generation (a release
        bumps it), so a repeated batch costs a key compare before its GEMMs."""
        st = self.state
        groups = st.groups.get(x.shape[0])
        if groups is None:
            return None
        W = self.base.weight
        K, N = self.in_features, self.out_features
        M = x.numel() // K if K else 0
        remerge.note_rows(self, x)
        if (st.static or torch.compiler.is_compiling() or type(self.base) is not nn.Linear or not self._plain
                or self.offloaded
                or M < GROUP_MIN_ROWS * len(groups.of_sample) or len(groups.blends) > remerge.MAX_GROUP_COPIES
                or not _merged.BUDGET.enabled(x.device.type)
                or (torch.is_grad_enabled() and (W.requires_grad or x.requires_grad))
                or (x.is_cuda and torch._C._cuda_isCurrentStreamCapturing())):
            return None
        key = merged_key(self, W)
        kept = self.__dict__.get("_groups")
        copies = self.merged.groups
        if kept is not None and kept[0] is groups and kept[1] == key and kept[2] == _merged.BUDGET.generation:
            if not kept[3]:  # no room for this batch's copies: until the budget changes, the per-call path
                return None
            weights = [W if not any(b) else copies[b].buf for b in groups.blends]  # (the copies, not their tensors,
        else:  # are kept: a released copy's memory must go back)
            weights = [W if not any(b) else getattr(copies.get(b), "buf", None) for b in groups.blends]
            if any(w is None or (w is not W and copies[b].key != key) for w, b in zip(weights, groups.blends)):
                weights = remerge.refresh_groups(self, W, groups.blends)
            self.__dict__["_groups"] = (groups, key, _merged.BUDGET.generation, weights is not None)
            if weights is None:
                return None
        bias, jobs = self.base.bias, groups.jobs(M // len(groups.of_sample))
        prepare = getattr(self._ops, "prepare_groups", None)
        if prepare is not None and x.is_cuda and x.dtype is W.dtype:  # the GEMMs bound in C++, kept on the hot path
            run = prepare(x, weights, bias, [v for job in jobs for v in job])
            if run is not None:
                hot.keep(self, x, run)
                return run(x)
        x2 = x.reshape(M, K).to(W.dtype)
        y2 = torch.empty(M, N, dtype=W.dtype, device=x.device)
        for g, first, n, count, stride in jobs:
            if count == 1:  # a run of samples: one GEMM
                xs, ys, wt = x2[first:first + n], y2[first:first + n], weights[g].t()
                op = torch.mm if bias is None else functools.partial(torch.addmm, bias)
            else:  # one position of every period (CFG): one strided bmm
                xs, ys = x2.view(count, stride, K)[:, first:first + n], y2.view(count, stride, N)[:, first:first + n]
                wt = weights[g].t().expand(count, K, N)
                op = torch.bmm if bias is None else functools.partial(torch.baddbmm, bias)
            op(xs, wt, out=ys)
        return y2.view(*x.shape[:-1], N)

    def _with_weight(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if type(self.base) is nn.Linear:
            return F.linear(x, w, bias)
        y = torch.addmm(bias, x.reshape(-1, x.shape[-1]), w)  # transformers Conv1D: x W + b
        return y.view(*x.shape[:-1], w.shape[1])

    def _weight_fn(self, w: torch.Tensor, bias: torch.Tensor | None):
        """x -> the base computation on weight `w` (F.linear itself for an nn.Linear: no Python frame of ours)."""
        if type(self.base) is nn.Linear:
            return functools.partial(F.linear, weight=w, bias=bias)
        return functools.partial(self._with_weight, w=w, bias=bias)

    def _kind_forward(self, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        mode, skip = self.state.mode, self._skip()
        if mode is Mode.SAMPLES and not skip and not (args or kwargs):
            y = self._grouped_forward(x)
            if y is not None:
                self._took("per-prompt copies", x)
                return y
        if not skip and not (args or kwargs) and mode is not Mode.OFF:
            y = percall.forward(self, x)  # eager CUDA on a GPU the dispatch is conservative on: cuBLAS forms
            if y is not None:
                return y
        route = self.__dict__.get("_dequant")
        y = route.family.forward(self, x) if route and not (skip or args or kwargs) else None
        if y is not None:  # a blend call on the W the base dequantizes anyway, the LoRA merged in (layers.dequant)
            self._took("dequant merge", x)
            return y
        if not skip and mode is not Mode.OFF:
            y = decode.forward(self, x, args, kwargs)  # eager decode: one kept-ready launch
            if y is not None:
                self._took("decode", x)
                return y
        if mode is Mode.BLEND and not skip and self._on_device_cache(x):
            self._took("on-device merged cache", x)
            b = self.bank
            x2 = x.reshape(-1, self.in_features).to(b.A.dtype)
            base = self.base
            y2 = torch.ops.fdlora.merged_linear(x2, base.weight, base.bias, b.A, b.B, self.scale_blend[:b.slots],
                                                b.ranks)
            if b.bias is not None:
                self._add_bias(y2, self.scale_blend, self.blend_weight, None)
            return y2.view(*x.shape[:-1], self.out_features)
        if mode is Mode.BLEND and not skip and self._whole and x.is_cuda:
            y = self._kept_linear(x)
            if y is not None:
                self._took("merge into scratch", x)
                return y
        if mode in (Mode.BLEND, Mode.SAMPLES) and not skip and self._whole:
            A, B, ranks, S = self._bank()
            x2 = x.reshape(-1, self.in_features).to(A.dtype)
            scale, gw = self._weights(x, x2.shape[0])
            self.__dict__["dispatch_rows"] = (x2.shape[0], gw.shape[0])
            self._took("lora_linear", x)
            y2 = self._ops.lora_linear(x2, self.base.weight, self.base.bias, A, B, scale[:S], gw[:, :S], ranks)
            if self.bank.bias is not None:
                self._add_bias(y2, scale, gw, None)
            return y2.view(*x.shape[:-1], self.out_features)
        y = self.base(x, *args, **kwargs)
        if skip:
            self._took("base only", x)
            return y
        y = y.contiguous()
        # layers reading one x share its shrink (fdlora.layers.modules.shared_shrink)
        group = self.__dict__.get("shrink_group")
        if group is not None and group.delta(self, x, y.view(-1, self.out_features)):
            self._took("base + shared-shrink delta", x)
            return y
        A, B, ranks, S = self._bank()
        x2 = x.reshape(-1, self.in_features).to(A.dtype)
        y2 = y.view(-1, self.out_features)
        M, st = x2.shape[0], self.state
        if st.mode is Mode.ROWS:
            row_slot = st.row_slot(x.device)
            if row_slot.shape[0] != M:
                raise FdLoraError(f"{self.path}: {row_slot.shape[0]} per-row adapters given for {M} rows.")
            self._ops.lora_delta_rows(y2, x2, A, B, self.scale_unit[:S], row_slot, ranks)
            self._took("base + per-row delta", x)
            if self.bank.bias is not None:
                self._add_bias(y2, self.scale_unit, self.blend_weight, row_slot)
            return y
        scale, gw = self._weights(x, M)
        self._ops.lora_delta(y2, x2, A, B, scale[:S], gw[:, :S], ranks)
        self._took("base + delta", x)
        if self.bank.bias is not None:
            self._add_bias(y2, scale, gw, None)
        return y


class FusedLoraConv2d(_FusedLora):
    kind = "conv2d"

    def __init__(self, base: nn.Conv2d, state: ModelState, index: int, path: str, rank: int,
                 dtype: torch.dtype | None = None) -> None:
        if base.groups != 1:
            raise FdLoraError(f"{path}: LoRA on grouped convolutions (groups={base.groups}) is not supported.")
        super().__init__(base, state, index, path, rank, (base.in_channels, *base.kernel_size),
                         base.out_channels, dtype)

    def select_backend(self) -> None:
        super().select_backend()
        A = self.bank.A
        self._plain = type(self.base) is nn.Conv2d and quantized.plain_weight(self.base, A.dtype, A.device)
        self._seen_weight()
        offload.note(self)  # under offload hooks: not plain (fdlora.layers.storage.offload)

    def _with_weight(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.base._conv_forward(x, w, bias)

    def _weight_fn(self, w: torch.Tensor, bias: torch.Tensor | None):
        return functools.partial(self.base._conv_forward, weight=w, bias=bias)

    def _kind_forward(self, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        y = self.base(x, *args, **kwargs)
        if self._skip():
            self._took("base only", x)
            return y
        if self.state.mode is Mode.ROWS:
            raise FdLoraError(
                f"{self.path}: per-row adapters apply to linear layers; use per-sample adapters for convs."
            )
        y = y.contiguous()
        scale, gw = self._weights(x, x.shape[0])
        A, B, _, S = self._bank()
        b = self.base
        self._ops.lora_conv_delta(y, x.to(A.dtype), A, B, scale[:S], gw[:, :S], b.stride, b.padding, b.dilation)
        self._took("base + conv delta", x)
        if self.bank.bias is not None:
            y2 = y.permute(0, 2, 3, 1)  # bias per output channel
            d = ((gw * scale) @ self.bank.bias.float()).repeat_interleave(y.shape[0] // gw.shape[0], dim=0)
            y.copy_((y2.float() + d[:, None, None, :]).to(y.dtype).permute(0, 3, 1, 2))
        return y
