"""LoRA on fused MoE experts: 3-D expert parameters served inside the routed, grouped expert computation.

Transformers 5 keeps a MoE layer's experts as stacked parameters (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V2/V3:
gate_up_proj [E, 2I, H], down_proj [E, H, I]; gpt-oss stores them transposed, [E, K, N], with biases), run by
one experts module whose forward takes (hidden_states [M, H], top_k_index [M, k], top_k_weights [M, k]).

What PEFT computes (peft 0.21, lora.ParamWrapper, read off peft/tuners/lora/layer.py): a 3-D target
parameter gets lora_A [E*r, K] and lora_B [N, E*r], K the input and N the output features of the
expert matmul (for [E, N, K] parameters PEFT swaps its in/out features; for transposed [E, K, N] ones
it does not, and stores the delta transposed), and the experts run on W + ΔW with

    A_e = lora_A.view(E, r, K)[e]            (expert e owns rows e*r .. e*r+r-1)
    B_e = lora_B.view(N, r, E)[:, :, e]      (expert e owns columns e, e+E, e+2E, ...: interleaved)
    ΔW_e = scale * B_e A_e   [N, K]          scale = alpha / r (alpha / sqrt(r) for rsLoRA)

fd-lora keeps the factors (the canonical `ModuleLora` kind "experts": A [E, r, K], B [E, N, r];
`peft_factors` converts) and applies them where each expert runs, on the tokens routed to it:

    y_t = x_t W_e^T + sum_s w[t, s] * scale[s] * (x_t A_{e,s}^T) B_{e,s}^T      for each token t routed to e

The computation is grouped like transformers' own grouped_mm experts forward (the default
implementation of these modules, so it is the reference for the base part): the (token, choice)
pairs are sorted by expert, and each expert's block is one base matmul plus one `lora_delta` over
all slots (the torch reference op, one weight row per pair), never a dense per-token ΔW. The
per-token slot weights w [M, S] (per-row adapters, per-sample adapters) are gathered with the
tokens, so a row's adapter follows its tokens through routing; in blend mode every token has the blend.

Each expert parameter is one layer for the handle (`ExpertLora`, path "<experts>.<param>", its own
scale-table row and `ExpertBank`); the experts module is replaced by one `FusedLoraExperts` holding
the original module and the `ExpertLora`s of its parameters, and is put back when the last goes
(the placement is fdlora.layers.model.moe_targets's). Routers (a 2-D `weight` used through F.linear) are
`fdlora.layers.modules.moe_router.FusedLoraRouter`.

Cost: the expert loop reads the token counts on the host (one sync per MoE layer call, as
transformers' own fallback does) and runs 2 matmuls + 1 lora_delta per hit expert and parameter,
so it is eager-only (not for torch.compile / CUDA graphs) and slower than transformers' single
grouped GEMM when many experts are hit; three grouped GEMMs (base, shrink, expand) would close that.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from fdlora.errors import AdapterShapeError, UnsupportedFeatureError
from fdlora.hub.adapter import ModuleLora
from fdlora.kernels import registry
from fdlora.kernels.ops.lora_delta import lora_delta as expert_delta
from fdlora.layers.fastpath.merged import MergedWeight
from fdlora.layers.state import Mode, ModelState

SELECTION = registry.Selection(registry.backends()["torch"],
                               ("fused experts: the torch reference, one lora_delta per expert's token group",))


def is_experts(module: nn.Module) -> bool:
    """A transformers experts module fd-lora can run: one set up by `use_experts_implementation` (the attributes
    below), whose forward transformers itself runs through the generic grouped implementation by default."""
    return (all(hasattr(module, a) for a in ("num_experts", "has_gate", "has_bias", "is_transposed"))
            and hasattr(module, "_apply_gate"))


def expert_params(module: nn.Module) -> tuple[str, str]:
    """(up projection, down projection) parameter names of an experts module."""
    return ("gate_up_proj" if module.has_gate else "up_proj"), "down_proj"


def dims(module: nn.Module, param: str) -> tuple[int, int, int]:
    """(E, K, N) of expert parameter `param`: experts, input and output features of its matmul."""
    E, d1, d2 = getattr(module, param).shape
    return (int(E), int(d1), int(d2)) if module.is_transposed else (int(E), int(d2), int(d1))


def peft_factors(module: nn.Module, param: str, lora_A: torch.Tensor,
                 lora_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT ParamWrapper's lora_A [E*r, K] / lora_B [N, E*r] of `module.param` -> (A [E, r, K], B [E, N, r])."""
    E, K, N = dims(module, param)
    if (lora_A.dim() != 2 or lora_B.dim() != 2 or lora_A.shape[0] % E or lora_A.shape[1] != K
            or tuple(lora_B.shape) != (N, lora_A.shape[0])):
        raise AdapterShapeError(
            f"LoRA for expert parameter {param} {tuple(getattr(module, param).shape)} has lora_A "
            f"{tuple(lora_A.shape)} and lora_B {tuple(lora_B.shape)}; PEFT's layout for it is lora_A [{E}*r, {K}] "
            f"and lora_B [{N}, {E}*r]. The adapter was made for another model."
        )
    r = lora_A.shape[0] // E
    return lora_A.reshape(E, r, K), lora_B.reshape(N, r, E).permute(2, 0, 1).contiguous()


def check_fits(module: nn.Module, param: str, m: ModuleLora, path: str, what: str) -> None:
    """Raise unless LoRA `m` fits expert parameter `module.param` (checked when a load is planned)."""
    if getattr(module, "_is_expert_parallel", False):
        raise UnsupportedFeatureError(f"{what}: {path} belongs to expert-parallel experts "
                                      f"({type(module).__name__}); fd-lora serves LoRA on experts that hold every "
                                      "expert locally.")
    E, K, N = dims(module, param)
    if m.kind != "experts" or tuple(m.A.shape) != (E, m.rank, K) or tuple(m.B.shape) != (E, N, m.rank):
        raise AdapterShapeError(f"{what}: LoRA for {path} has A {tuple(m.A.shape)} and B {tuple(m.B.shape)}, but "
                                f"the expert parameter takes A [{E}, r, {K}] and B [{E}, {N}, r]. The adapter was "
                                "made for another model.")
    if m.bias is not None or m.magnitude is not None:
        raise UnsupportedFeatureError(f"{what}: {path} has a LoRA bias or DoRA magnitude; PEFT's ParamWrapper has "
                                      "neither, and fd-lora does not implement them on expert parameters.")
    if not (m.A.is_floating_point() and m.B.is_floating_point()):
        raise AdapterShapeError(f"{what}: {path} weights are {m.A.dtype}/{m.B.dtype}; LoRA weights must be float.")


class ExpertBank(nn.Module):
    """The per-slot factors of one expert parameter, AdapterBank's layout with an expert axis first:

        A [E, S', R', K], B [E, N, S', R']   so A[e] / B[e] are expert e's [S', R', K] / [N, S', R'] bank
        ranks [S'] int32                      the live rank per slot (the ops' signature takes it)

    Unlike AdapterBank it holds only what is loaded: S' = the last used slot + 1 and R' = the largest live rank
    (no padding: the torch reference needs none), grown in place by `write`. An expert stack is E times a
    layer's size, so a bank preallocated at the handle's capacity (4 slots x rank 64) would cost a full-size
    DeepSeek-V3 (E=256) ~2.7 GB per layer before any adapter is loaded; this one costs what PEFT's factors cost.
    Experts are never compiled or captured (the grouped forward syncs on the host), so growing is safe.
    `bias` / `magnitude` stay None (PEFT's ParamWrapper has neither)."""

    def __init__(self, slots: int, experts: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.register_buffer("A", torch.zeros(experts, 0, 0, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("B", torch.zeros(experts, out_features, 0, 0, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("ranks", torch.zeros(0, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self.register_buffer("magnitude", None, persistent=False)
        self.register_buffer("dversion", torch.zeros(1, dtype=torch.int32, device=device), persistent=False)
        self.used: list[bool] = [False] * slots
        self.host_ranks: list[int] = [0] * slots
        self.version = 0

    @property
    def slots(self) -> int:
        return len(self.used)

    @property
    def rank_capacity(self) -> int:
        return self.A.shape[2]

    def extent(self) -> tuple[int, int]:
        """(slots up to the last used one, largest live rank): the loaded part."""
        S = max((s + 1 for s, u in enumerate(self.used) if u), default=0)
        return S, max(self.host_ranks, default=0)

    def _fit(self, slots: int, rank: int) -> None:
        """Reallocate to at least `slots` x `rank`, keeping what is loaded."""
        E, S0, R0, K = self.A.shape
        S, R = max(S0, slots), max(R0, rank)
        if (S, R) == (S0, R0):
            return
        A = self.A.new_zeros(E, S, R, K)
        B = self.B.new_zeros(E, self.B.shape[1], S, R)
        A[:, :S0, :R0] = self.A
        B[:, :, :S0, :R0] = self.B
        ranks = self.ranks.new_zeros(S)
        ranks[:S0] = self.ranks
        self.A, self.B, self.ranks = A, B, ranks

    def write(self, slot: int, m: ModuleLora) -> None:
        r = m.rank
        self._fit(slot + 1, r)
        self.A[:, slot, :r].copy_(m.A)
        self.A[:, slot, r:].zero_()
        self.B[:, :, slot, :r].copy_(m.B)
        self.B[:, :, slot, r:].zero_()
        self.ranks[slot] = r
        self.mark(slot, r)

    def clear(self, slot: int) -> None:
        if slot < self.A.shape[1]:
            self.A[:, slot].zero_()
            self.B[:, :, slot].zero_()
            self.ranks[slot] = 0
        self.mark(slot, 0)

    def mark(self, slot: int, rank: int, device: bool = True) -> None:
        self.used[slot] = rank > 0
        self.host_ranks[slot] = rank
        self.__dict__["version"] += 1
        if device:
            self._buffers["dversion"].add_(1)

    def resize(self, slots: int, rank: int) -> None:
        """The handle's capacity changed: more slots may be used now (nothing is allocated until a write); the
        rank argument is the handle's capacity, which this bank does not preallocate."""
        if slots < self.slots:
            raise ValueError(f"resize to {slots} slots would drop loaded adapters ({self.slots} slots).")
        self.used = self.used + [False] * (slots - self.slots)
        self.host_ranks = self.host_ranks + [0] * (slots - len(self.host_ranks))
        self.version += 1
        self.dversion.add_(1)


class ExpertLora(nn.Module):
    """The adapters of one expert parameter: a layer for the handle (path "<experts>.<param>", a scale-table row,
    a bank), living inside the `FusedLoraExperts` that replaced its experts module, whose grouped forward calls
    `delta` for each expert's block of tokens."""

    kind = "experts"

    def __init__(self, experts: nn.Module, param: str, state: ModelState, index: int, path: str, rank: int,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        W = getattr(experts, param)
        E, K, N = dims(experts, param)
        self.param, self.path, self.index = param, path, index
        self.in_features, self.out_features = K, N
        self.bank = ExpertBank(state.slots.capacity, E, K, N, dtype or W.dtype, W.device)  # (grows on load)
        object.__setattr__(self, "base", experts)  # the original experts module (not a submodule of this one)
        object.__setattr__(self, "state", state)  # shared, not a submodule
        object.__setattr__(self, "merged", MergedWeight())  # the merged-weight cache never serves experts
        self.selection = SELECTION
        self.rebind()

    def rebind(self) -> None:
        """Point the scale views at the shared table on the bank's device (as _FusedLora.rebind)."""
        t = self.state.table.on(self.bank.A.device)
        self.scale_blend = t[0, self.index]  # [S] weight * alpha / r
        self.scale_unit = t[1, self.index]  # [S] alpha / r

    def select_backend(self) -> None:
        self.selection = SELECTION

    def release_merged(self) -> None:
        pass  # (no merged copy: the layer is not a merged-weight cache member)

    def plain_now(self) -> bool:
        return False  # never served by the merged-weight cache (fdlora.layers.fastpath.remerge skips it)

    def _apply(self, fn, recurse=True):  # .to() / .half(): the scale views follow the bank's device
        super()._apply(fn, recurse)
        self.rebind()
        return self

    def check(self, m: ModuleLora, what: str) -> None:
        check_fits(self.base, self.param, m, self.path, what)

    def active(self) -> bool:
        st = self.state
        if st.mode is Mode.OFF or True not in self.bank.used:
            return False
        return st.mode is not Mode.BLEND or bool(st.active)

    def delta(self, y: torch.Tensor, x: torch.Tensor, expert: int, rows: torch.Tensor | None) -> None:
        """y [n, N] += this parameter's LoRA on `x` [n, K], the tokens routed to `expert`; `rows` [n, S] are their
        slot weights (per-row / per-sample modes), None in blend mode."""
        b = self.bank
        S, R = b.extent()
        A, B = b.A[expert, :S, :R], b.B[expert, :, :S, :R]  # (the loaded part: A [S, R, K], B [N, S, R])
        if rows is None:
            scale, gw = self.scale_blend[:S], self.state.ones(x.device)[:, :S]
        else:
            scale, gw = self.scale_unit[:S], rows[:, :S]
        expert_delta(y, x.to(A.dtype), A, B, scale, gw, b.ranks[:S])

    def extra_repr(self) -> str:
        b = self.bank
        return (f"path={self.path!r}, experts={b.A.shape[0]}, slots={b.slots}, rank_capacity={b.rank_capacity}, "
                f"dtype={b.A.dtype}, backend={self.selection}")


class FusedLoraExperts(nn.Module):
    """An experts module served with LoRA on its parameters (see the module docstring): the original module is
    `base`, untouched; `loras` holds an `ExpertLora` per adapted parameter."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.loras = nn.ModuleDict()
        # the (hidden_states, top_k_index, top_k_weights) arguments by the names this class gives them
        self._signature = inspect.signature(type(base).forward)

    @property
    def num_experts(self) -> int:
        return self.base.num_experts

    def forward(self, *args, **kwargs) -> torch.Tensor:
        loras = [lo for lo in self.loras.values() if lo.active()]
        if not loras:
            return self.base(*args, **kwargs)
        hidden_states, top_k_index, top_k_weights = list(self._signature.bind(self.base, *args, **kwargs)
                                                         .arguments.values())[1:4]
        b = self.base
        M, H = hidden_states.shape
        k = top_k_index.shape[-1]
        ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)  # (token, choice) pairs grouped by expert
        token = perm // k
        x = hidden_states[token]
        counts = torch.bincount(ids, minlength=b.num_experts).tolist()
        rows = loras[0].state.token_weights(M, hidden_states.device)  # [M, S] per-row / per-sample, else None
        rows = None if rows is None else rows[token]  # each pair carries its token's slot weights
        up, down = expert_params(b)
        h = self._grouped(up, x, counts, rows)
        h = b._apply_gate(h) if b.has_gate else b.act_fn(h)
        y = self._grouped(down, h, counts, rows)
        if getattr(b, "has_post_expert_norm", False):
            y = b.post_expert_norm(y)
        y = y * top_k_weights.reshape(-1)[perm, None]
        out = torch.empty_like(y)
        out[perm] = y  # back to (token, choice) order
        return out.view(M, k, H).sum(dim=1).to(hidden_states.dtype)

    def _grouped(self, param: str, x: torch.Tensor, counts: list[int], rows: torch.Tensor | None) -> torch.Tensor:
        """Expert e's matmul (bias included) on its block of `x`, plus this parameter's LoRA if it has one."""
        b = self.base
        W = getattr(b, param)
        bias = getattr(b, param + "_bias") if b.has_bias else None
        lora = self.loras[param] if param in self.loras and self.loras[param].active() else None
        N = W.shape[2] if b.is_transposed else W.shape[1]
        y = x.new_empty(x.shape[0], N, dtype=W.dtype)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            blk = slice(start, start + n)
            xe = x[blk].to(W.dtype)
            ye = xe @ W[e] if b.is_transposed else F.linear(xe, W[e])
            if bias is not None:
                ye = ye + bias[e]
            if lora is not None:
                lora.delta(ye, xe, e, None if rows is None else rows[blk])
            y[blk] = ye
            start += n
        return y


def delta_weight(layer: ExpertLora, slot_weights: torch.Tensor) -> torch.Tensor:
    """sum_s w_s * B_{e,s} A_{e,s} for every expert e, in fp32, shaped like the parameter ([E, N, K], or [E, K, N]
    for transposed experts). `slot_weights` [S] holds w_s * alpha / r (merging:
    fdlora.integrations.transformers.save)."""
    S, R = layer.bank.extent()
    A = layer.bank.A[:, :S, :R].float()  # [E, S, R, K]
    B = layer.bank.B[:, :, :S, :R].float()  # [E, N, S, R]
    E, N, K = B.shape[0], B.shape[1], A.shape[-1]
    Bw = (B * slot_weights[:S].float().to(B.device)[None, None, :, None]).reshape(E, N, S * R)
    delta = torch.bmm(Bw, A.reshape(E, S * R, K))
    return delta.transpose(1, 2) if layer.base.is_transposed else delta


def param_target(model: nn.Module, path: str, modules: Mapping[str, nn.Module] | None = None
                 ) -> tuple[nn.Module, str] | None:
    """(experts module, parameter name) if `path` names an expert parameter fd-lora serves, else None. `modules`:
    the model's modules by path, when the caller has them (fdlora.layers.model.loading looks up every target of a
    load)."""
    parent, _, param = path.rpartition(".")
    if modules is not None:
        module = modules.get(parent)
        if module is None:
            return None
    else:
        try:
            module = model.get_submodule(parent)
        except AttributeError:
            return None
    if isinstance(module, FusedLoraExperts):
        module = module.base
    if is_experts(module) and param in expert_params(module):
        W = getattr(module, param, None)
        if isinstance(W, torch.Tensor) and W.dim() == 3:
            return module, param
    return None
