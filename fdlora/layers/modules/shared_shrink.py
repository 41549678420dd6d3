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
blends at few rows per sample, per-row prefill (per-row calls of at most FEW_ROWS rows are declined: decode). The
merged-weight cache needs no shrink at all; the Triton backend's lora_linear (one op choosing merged /
shrink-in-the-GEMM / cuBLAS + delta per shape) and eager decode's kept-ready launches (one launch per layer,
host-bound) keep their paths, except per-row calls above FEW_ROWS rows, which fdlora.layers.fastpath.decode hands here.
In blend mode the stack covers the active adapters' slot range only; otherwise the slots up to the last one loaded.
Never when compiling, frozen, capturing a CUDA graph, under autograd, under offload hooks (banks move every call),
or for inference-mode tensors (they have no version counter, so an in-place change of x between two members could
not be seen).

Per row. Every row has its own slot, so a member-major stack would compute S x the columns a row needs and give
each expand an S*R-wide rank axis. Where the backend's shrink takes a row_slot (Triton's lora_shrink_split), the
stack is slot-major instead, [S, n*R, K] (`stack_by_slot`): one launch reads x about once and computes, per row,
only its own slot's n*R columns; member i's h is the strided [P, M, S, R] view at columns s*n*R + i*R + r, and
its expand masks every h element whose row weight is 0 (the rest of h is never written). The one-hot row weights
([M, S], lora_expand_add's group weight with G = M) come from the state (`row_onehot`), built once while the row
slots stay the same, for every member of every group.

Shared A. kohya Flux files carry one lora_down for q, k, v (and single blocks' linear1 for q, k, v, proj_mlp); the
converter hands every member that one A. The stack keeps a slot's A once when all members hold the same one
(checked when the banks change, not per call), so such a group's h has rank r, not n*r (`_stack`; per row,
`stack_by_slot` when every slot is shared). The banks still
hold one copy each (a slot cannot alias across banks): what the group saves is the compute and the h traffic.

Staleness. h is kept with (x's weak reference, data_ptr, _version, shape, stride, stream), the stack's key
(backend, slot range, every member's bank version and A address: every bank write goes through AdapterBank.mark,
which bumps the version; a move or resize changes the address) and, per row, the row slots' address and version
(h by row and the row weights depend on them; inference-mode slots have no version: declined); any difference
recomputes it, so a stale h is never served. It is dropped once every member has used it. Groups come from RULES
(data: parent module class -> member paths) when the handle wraps or unwraps layers (`regroup`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from fdlora.layers.state import Mode

ENABLED = True  # tests and benchmarks turn it off to compare with the ungrouped path
# Per-row calls of at most this many rows (decode) take each member's own lora_delta_rows, one fused launch each:
# such calls are launch-bound, and the group runs one launch more (shrink + n expands vs n). Llama-3-8B q/k/v at
# 32 rows on an H100: grouped 32.5 vs separate 31.2 us (benchmarks/bench_shared_shrink.py,
# rows-4xr16). The same bound as the kernels' few-rows range (fdlora.kernels.triton.config.FEW_ROWS).
FEW_ROWS = 64


class Stack(NamedTuple):
    """The members' stacked A for one slot range (A None: they cannot share a shrink now)."""

    key: tuple  # backend, slot range, layout, every bank's (version, A address): any change rebuilds the stack
    A: torch.Tensor | None  # [U, R, K] member-major, or [S, W, K] slot-major (by_row)
    lo: int
    hi: int
    R: int
    columns: list | None  # per member: where its columns of h start (by_row: within a slot), or an index of them
    by_row: bool  # slot-major, for lora_shrink_split's row_slot


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
    from fdlora.layers.modules.fused import FusedLoraLinear

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
        self._members = [weakref.ref(m) for m in members]  # weak: each member holds the group (no reference cycle)
        self._stack: Stack | None = None
        self._h: tuple | None = None  # (key, x's weak ref, h [P, M, n*S*R] fp32, ids served, per-row weights [M, S])
        self.shrinks = 0  # shrinks run and expands served (tests and benchmarks read them)
        self.expands = 0
        for m in members:
            m.__dict__["shrink_group"] = self

    @property
    def members(self) -> list:
        """The member layers (held weakly: each holds this group as `shrink_group`)."""
        return [r() for r in self._members]

    def __getstate__(self) -> dict:  # copies and pickles carry the members, not the caches (a weak reference, ids)
        return {**self.__dict__, "_members": self.members, "_stack": None, "_h": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._members = [weakref.ref(m) for m in state["_members"]]

    def __repr__(self) -> str:
        return f"ShrinkGroup({', '.join(m.path for m in self.members)})"

    def _stacked(self, layer, members: list, lo: int, hi: int | None, by_row: bool = False) -> Stack | None:
        """The members' stacked A over slots lo:hi (hi None: up to the last one used), refreshed when any bank
        changed; None when the members cannot share a shrink now (different backends, devices, dtypes or bank
        shapes, more than the backend takes). Member-major unless `by_row` (lo 0) and the slot-major stack fits the
        backend's rank bound. The per-call cost is the key: bank versions and addresses (a write bumps the version, a
        move or resize changes the address)."""
        backend = layer.selection.backend
        if any(m.selection.backend is not backend for m in members):
            return None
        banks = [m.__dict__["bank"] for m in members]
        key = (backend, lo, hi, by_row, *[(b.version, b._buffers["A"].data_ptr()) for b in banks])
        got = self._stack
        if got is not None and got.key == key:
            return got if got.A is not None else None
        A0 = banks[0].A
        # eager only (see delta), so the stack covers the live part of the banks, as FusedLoraLinear._bank does on
        # the torch backend: slots up to the last one used in any member (in blend mode, only the active ones'
        # range: a loaded but inactive adapter costs the group no shrink), rank up to the widest live one
        ext = [b.extent() for b in banks]
        end, R = max(e[0] for e in ext), max(e[1] for e in ext)
        top = end if hi is None else min(hi, end)
        cap = backend.capability
        alike = all(b.A.device == A0.device and b.A.dtype == A0.dtype and b.A.shape[0] == A0.shape[0] for b in banks)
        self._stack = Stack(key, None, 0, 0, 0, None, False)
        if not alike or top <= lo or any(R > b.rank_capacity for b in banks):
            return None
        for rows in (True, False) if by_row else (False,):
            A, columns = (stack_by_slot if rows else _stack)([b.A[lo:top, :R] for b in banks])
            if (cap.max_slots is None or A.shape[0] <= cap.max_slots) and (
                    cap.max_rank is None or A.shape[1] <= cap.max_rank):
                self._stack = Stack(key, A, lo, top, R, columns, rows)
                return self._stack
        return None

    def takes_rows(self, layer, x: torch.Tensor, M: int) -> bool:
        """Whether eager decode on CUDA (fdlora.layers.fastpath.decode) should give a per-row call of M rows up to the
        group instead of its own one-launch path: more rows than FEW_ROWS, and `may_serve`."""
        return M > FEW_ROWS and self.may_serve(layer, x)

    @staticmethod
    def may_serve(layer, x: torch.Tensor) -> bool:
        """The call-independent part of `delta`'s checks (see the module docstring's "Never when")."""
        return not (not ENABLED or layer.state.static or torch.compiler.is_compiling() or x.is_inference()
                    or layer.__dict__.get("offloaded")
                    or (torch.is_grad_enabled() and (x.requires_grad or layer.bank.A.requires_grad))
                    or (x.is_cuda and torch._C._cuda_isCurrentStreamCapturing()))

    def delta(self, layer, x: torch.Tensor, y2: torch.Tensor) -> bool:
        """y2 += this member's LoRA delta through the group's shared h (computing h if this x has none yet); False
        (nothing done) when this call may not take the group path: the layer's regular path then runs."""
        st = layer.state
        if not self.may_serve(layer, x):
            return False
        M = y2.shape[0]
        row_slot = st.row_slot(x.device) if st.mode is Mode.ROWS else None
        if row_slot is not None and (M <= FEW_ROWS or row_slot.shape[0] != M or row_slot.is_inference()):
            return False  # decode: the members' own launches (FEW_ROWS); a wrong count: the regular path's error
        lo, hi = 0, None
        if st.mode is Mode.BLEND:  # the active adapters' slots (not empty: the layer skips blend calls without)
            live = [st.slots.by_name[n] for n in st.active]
            lo, hi = min(live), max(live) + 1
        ops = layer._ops
        split = getattr(ops, "lora_shrink_split", None)  # K-split partials the expand adds (Triton): no sum launch
        members = self.members
        stack = self._stacked(layer, members, lo, hi, by_row=row_slot is not None and split is not None)
        if stack is None:
            return False
        A, lo, hi, R = stack.A, stack.lo, stack.hi, stack.R
        S = hi - lo
        stream = torch._C._cuda_getCurrentRawStream(x.device.index) if x.is_cuda else 0
        rkey = None if row_slot is None else (row_slot.data_ptr(), row_slot._version)  # h and weights follow the slots
        xkey = (x.data_ptr(), x._version, x.shape, x.stride(), stream, stack.key, rkey)
        got = self._h
        if got is None or got[0] != xkey or got[1]() is not x:
            x2 = x.reshape(M, A.shape[2]).to(A.dtype)
            h = (split(x2, A, row_slot) if stack.by_row else split(x2, A)) if split else ops.lora_shrink(x2, A)
            # [M, S] one-hot row weights (G = M; lo is 0), kept by the state while the row slots stay as they are
            rows_w = None if row_slot is None else st.row_onehot(x.device, hi)
            got = self._h = (xkey, weakref.ref(x), h, set(), rows_w)
            self.shrinks += 1
        if row_slot is None:
            scale, gw = layer._weights(x, M)
        else:
            scale, gw = layer.scale_unit, got[4]
        at, bank, h = stack.columns[next(i for i, m in enumerate(members) if m is layer)], layer.bank, got[2]
        if stack.by_row:
            h = h.unflatten(-1, (S, A.shape[1]))[..., at:at + R]  # [P, M, S, R]: this member's columns of each slot
        else:
            h = h[..., at:at + S * R] if isinstance(at, int) else h.index_select(-1, at)
        ops.lora_expand_add(y2, h, bank.B[:, lo:hi, :R], scale[lo:hi], gw[:, lo:hi])
        self.expands += 1
        if bank._buffers["bias"] is not None:
            layer._add_bias(y2, scale, gw, row_slot)
        got[3].add(id(layer))
        if len(got[3]) == len(members):
            self._h = None  # every member served: give the memory back
        return True


def stack_by_slot(A: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The members' A ([S, R, K] each) slot-major, [S, n*R, K]: slot s holds member 0's A_s, then member 1's, ...,
    so that lora_shrink_split by row computes a row's slot for every member in one program; member i's columns
    within a slot start at i*R. One copy ([S, R, K], every member at 0) when all members hold the same A (kohya's
    fused qkv); with some slots shared, every member keeps its own columns (the slot width must be one)."""
    if all(torch.equal(A[0], a) for a in A[1:]):
        return A[0].contiguous(), [0] * len(A)
    R = A[0].shape[1]
    return torch.cat(A, dim=1).contiguous(), [i * R for i in range(len(A))]


def _stack(A: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
    """The members' A ([S, R, K] each) stacked member-major, each slot's A once when every member holds the same one:
    kohya Flux files carry one lora_down for q, k and v (img_attn qkv, single blocks' linear1, which diffusers'
    converter gives to_q / to_k / to_v / proj_mlp alike), so their h is computed once, not once per member.
    Member 0's slots come first (its h is h[:, :S*R]); a member whose slots are all shared reads the same columns,
    one with none shared its own range after them, one with some shared an index of its columns (a gather)."""
    n = len(A)
    S, R = A[0].shape[:2]
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
    return torch.cat(blocks).contiguous(), columns
