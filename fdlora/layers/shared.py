"""One shrink for the layers that read the same input: q/k/v, gate/up, Flux single blocks' q/k/v/proj_mlp.

    h   = x [A_1; A_2; ...; A_n]^T       once per input: one lora_shrink over the members' stacked banks (on
                                         Triton its K-split partial sums, which the expands add: lora_shrink_split)
    y_i += (h_i * w_i) B_i^T              per member, when the model calls it: lora_expand_add on its columns

Why this form. The members are separate modules that the model's own code calls one after another
with the same `x` object (diffusers' attention processors, Llama's attention and MLP); their outputs
exist one at a time, so the expand stays per member and what is shared is the shrink, the part that
re-reads x. Separate deltas read x n times (and, split into shrink + expand at few rows, launch 2n
kernels); the group reads it once and launches n + 1, at the price of writing and re-reading h
(M x n*S*R fp32, a few % of x at ranks <= 64). The idea is SGLang's qkv_lora_b / gate_up_lora_b (one
stacked A, one B per output slice) without fusing the base projections, which fd-lora never rewrites.

When. FusedLoraLinear's per-call delta path (base output + lora_delta / lora_delta_rows) asks the layer's
group first: the torch and cuda backends, bases other than a plain nn.Linear (quantized, subclasses), per-sample
blends at few rows per sample, per-row prefill. The merged-weight cache needs no shrink at all; the Triton backend's
lora_linear (one op choosing merged / shrink-in-the-GEMM / cuBLAS + delta per shape) and eager decode's kept-ready
launches (one launch per layer, host-bound) keep their paths. In blend mode the stack covers the active adapters'
slot range only; otherwise the slots up to the last one loaded.
Never when compiling, frozen, capturing a CUDA graph, under autograd, under offload hooks (banks move every call),
or for inference-mode tensors (they have no version counter, so an in-place change of x between two members could
not be seen).

Shared A. kohya Flux files carry one lora_down for q, k, v (and single blocks' linear1 for q, k, v, proj_mlp); the
converter hands every member that one A. The stack keeps a slot's A once when all members hold the same one
(checked when the banks change, not per call), so such a group's h has rank r, not n*r (`_stack`). The banks still
hold one copy each (a slot cannot alias across banks): what the group saves is the compute and the h traffic.

Staleness. h is kept with (x's weak reference, data_ptr, _version, shape, stride, stream) and the stack's key
(backend, slot range, every member's bank version and A address: every bank write goes through AdapterBank.mark,
which bumps the version; a move or resize changes the address); any difference recomputes it, so a stale h is
never served. It is dropped once every member has used it. Groups come from RULES (data: parent
module class -> member paths) when the handle wraps or unwraps layers (`regroup`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .state import Mode

ENABLED = True  # tests and benchmarks turn it off to compare with the ungrouped path


@dataclass(frozen=True)
class Rule:
    """Members (paths relative to a module of class `parent`) that read one input tensor by construction; `unless`
    names a boolean attribute of the parent that, when true, means they do not (cross-attention's k/v)."""

    parent: str
    members: tuple[str, ...]
    unless: str | None = None


_LLM = ("Llama", "Mistral", "Mixtral", "Qwen2", "Qwen3", "Gemma", "Gemma2", "Gemma3", "Granite", "Olmo", "Olmo2",
        "Cohere", "StableLm", "Starcoder2")
_LLM_MLP = ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2", "Gemma3", "Granite", "Olmo", "Olmo2", "Cohere")

RULES: tuple[Rule, ...] = (
    # diffusers Attention: self-attention projects one x to q, k, v; cross-attention projects the text to k, v
    Rule("Attention", ("to_q", "to_k", "to_v"), unless="is_cross_attention"),
    Rule("Attention", ("to_k", "to_v")),
    Rule("Attention", ("add_q_proj", "add_k_proj", "add_v_proj")),  # SD3 / joint attention: the context stream
    Rule("FluxAttention", ("to_q", "to_k", "to_v")),
    Rule("FluxAttention", ("add_q_proj", "add_k_proj", "add_v_proj")),
    Rule("FluxSingleTransformerBlock", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")),
    *(Rule(f"{f}Attention", ("q_proj", "k_proj", "v_proj")) for f in _LLM),
    *(Rule(f"{f}MLP", ("gate_proj", "up_proj")) for f in _LLM_MLP),
)


def regroup(model: nn.Module, layers: dict, rules: tuple[Rule, ...] = RULES) -> list[ShrinkGroup]:
    """Group the wrapped linear layers of `model` by `rules` (first matching rule wins, two members at least) and
    attach each group to its members (`layer.shrink_group`); layers in no group get None."""
    from .fused import FusedLoraLinear

    for layer in layers.values():
        layer.__dict__["shrink_group"] = None
    by_parent: dict[str, list[Rule]] = {}
    for rule in rules:
        by_parent.setdefault(rule.parent, []).append(rule)
    groups, taken = [], set()
    for path, module in model.named_modules():
        for rule in by_parent.get(type(module).__name__, ()):
            if rule.unless is not None and getattr(module, rule.unless, False):
                continue
            paths = [f"{path}.{m}" if path else m for m in rule.members]
            members = [layers[p] for p in paths if p in layers and p not in taken]
            members = [m for m in members if type(m) is FusedLoraLinear]
            if len(members) >= 2 and len({m.in_features for m in members}) == 1:
                groups.append(ShrinkGroup(members))
                taken.update(m.path for m in members)
    return groups


class ShrinkGroup:
    """Layers that read one input: their stacked A, and the h of the input being served."""

    def __init__(self, members: list) -> None:
        self.members = members
        self._stack: tuple | None = None  # (key, A [n*S, R, K], S, R)
        self._h: tuple | None = None  # (key, h [M, n*S*R] fp32, ids of the members served)
        self.shrinks = 0  # shrinks run and expands served (tests and benchmarks read them)
        self.expands = 0
        for m in members:
            m.__dict__["shrink_group"] = self

    def __getstate__(self) -> dict:  # copies and pickles carry the members, not the caches (a weak reference, ids)
        return {**self.__dict__, "_stack": None, "_h": None}

    def __repr__(self) -> str:
        return f"ShrinkGroup({', '.join(m.path for m in self.members)})"

    def _stacked(self, layer, lo: int, hi: int | None) -> tuple | None:
        """(key, A_stack [U, R, K], lo, hi, R, columns) of the members' banks over slots lo:hi (hi None: up to the
        last one used), refreshed when any bank changed; None when the members cannot share a shrink now (different
        backends, devices, dtypes or bank shapes). `columns[i]` is where member i's [M, (hi-lo)*R] block of h
        starts, or an index of its columns when they are not one range. The per-call cost is the key: bank versions
        and addresses (a write bumps the version, a move or resize changes the address)."""
        backend = layer.selection.backend
        if any(m.selection.backend is not backend for m in self.members):
            return None
        banks = [m.__dict__["bank"] for m in self.members]
        key = (backend, lo, hi, *[(b.version, b._buffers["A"].data_ptr()) for b in banks])
        got = self._stack
        if got is not None and got[0] == key:
            return got if got[1] is not None else None
        A0 = banks[0].A
        # eager only (see delta), so the stack covers the live part of the banks, as FusedLoraLinear._bank does on
        # the torch backend: slots up to the last one used in any member (in blend mode, only the active ones'
        # range: a loaded but inactive adapter costs the group no shrink), rank up to the widest live one
        ext = [b.extent() for b in banks]
        end, R = max(e[0] for e in ext), max(e[1] for e in ext)
        top = end if hi is None else min(hi, end)
        most = backend.capability.max_slots
        alike = all(b.A.device == A0.device and b.A.dtype == A0.dtype and b.A.shape[0] == A0.shape[0] for b in banks)
        if (not alike or top <= lo or any(R > b.rank_capacity for b in banks)
                or (most is not None and len(banks) * (top - lo) > most)):
            self._stack = (key, None, 0, 0, 0, None)
            return None
        self._stack = (key, *_stack(banks, lo, top, R))
        return self._stack

    def delta(self, layer, x: torch.Tensor, y2: torch.Tensor) -> bool:
        """y2 += this member's LoRA delta through the group's shared h (computing h if this x has none yet); False
        (nothing done) when this call may not take the group path: the layer's regular path then runs."""
        st = layer.state
        if (not ENABLED or st.static or torch.compiler.is_compiling() or x.is_inference()
                or layer.__dict__.get("offloaded")
                or (torch.is_grad_enabled() and (x.requires_grad or layer.bank.A.requires_grad))
                or (x.is_cuda and torch._C._cuda_isCurrentStreamCapturing())):
            return False
        lo, hi = 0, None
        if st.mode is Mode.BLEND:  # the active adapters' slots (not empty: the layer skips blend calls without)
            live = [st.slots.by_name[n] for n in st.active]
            lo, hi = min(live), max(live) + 1
        stack = self._stacked(layer, lo, hi)
        if stack is None:
            return False
        skey, A, lo, hi, R, columns = stack
        S = hi - lo
        M, N = y2.shape
        if st.mode is Mode.ROWS:
            row_slot = st.row_slot(x.device)
            if row_slot.shape[0] != M:
                return False  # the regular path raises the clear error
            scale = layer.scale_unit
            gw = (row_slot.long()[:, None] == torch.arange(hi, device=x.device)).float()  # [M, S]: G = M (lo is 0)
        else:
            scale, gw = layer._weights(x, M)
            row_slot = None
        ops = layer._ops
        stream = torch._C._cuda_getCurrentRawStream(x.device.index) if x.is_cuda else 0
        xkey = (x.data_ptr(), x._version, x.shape, x.stride(), stream, skey)
        got = self._h
        if got is None or got[0] != xkey or got[1]() is not x:
            x2 = x.reshape(M, A.shape[2]).to(A.dtype)
            split = getattr(ops, "lora_shrink_split", None)  # K-split partials the expand adds (Triton): no sum launch
            got = self._h = (xkey, weakref.ref(x), split(x2, A) if split else ops.lora_shrink(x2, A), set())
            self.shrinks += 1
        at, bank = columns[next(i for i, m in enumerate(self.members) if m is layer)], layer.bank
        h = got[2][..., at:at + S * R] if isinstance(at, int) else got[2].index_select(-1, at)
        ops.lora_expand_add(y2, h, bank.B[:, lo:hi, :R], scale[lo:hi], gw[:, lo:hi])
        self.expands += 1
        if bank._buffers["bias"] is not None:
            layer._add_bias(y2, scale, gw, row_slot)
        got[3].add(id(layer))
        if len(got[3]) == len(self.members):
            self._h = None  # every member served: give the memory back
        return True


def _stack(banks: list, lo: int, hi: int, R: int) -> tuple[torch.Tensor, int, int, int, list]:
    """The stacked A of `banks` (slots lo:hi, rank :R) with each slot's A once when every member holds the same one:
    kohya Flux files carry one lora_down for q, k and v (img_attn qkv, single blocks' linear1, which diffusers'
    converter gives to_q / to_k / to_v / proj_mlp alike), so their h is computed once, not once per member.
    Member 0's slots come first (its h is h[:, :S*R]); a member whose slots are all shared reads the same columns,
    one with none shared its own range after them, one with some shared an index of its columns (a gather)."""
    n = len(banks)
    S = hi - lo
    A = [b.A[lo:hi, :R] for b in banks]
    shared = [all(torch.equal(A[0][s], a[s]) for a in A[1:]) for s in range(S)]
    blocks, columns = [A[0]], [0]
    start = S * R
    for i in range(1, n):
        own = [s for s in range(S) if not shared[s]]
        if not own:
            columns.append(0)
            continue
        blocks.append(A[i][own])
        if len(own) == S:
            columns.append(start)
        else:
            at, idx = iter(range(start // R, start // R + len(own))), []
            for s in range(S):
                c = next(at) if not shared[s] else s
                idx.extend(range(c * R, (c + 1) * R))
            columns.append(torch.tensor(idx, device=A[0].device))
        start += len(own) * R
    return torch.cat(blocks).contiguous(), lo, hi, R, columns
