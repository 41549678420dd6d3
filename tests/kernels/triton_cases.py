"""Case table, inputs, float64 oracle and eager-error tolerance for the Triton LoRA ops.

Inputs are poisoned where a correct kernel must not look: A/B rows past each slot's live rank
(rounded up to 16, the bank's zero padding granule), every weight of an inactive or empty slot,
and x rows that receive no adapter are NaN in what the kernel sees; the oracle uses the clean
values. A kernel that reads any of them writes NaN and fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fdlora import env

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HAS_CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="interp"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def skip_unless(device: str) -> None:
    """CPU cases need a process started with TRITON_INTERPRET=1 (test_triton_interpret.py starts one);
    CUDA cases need a device."""
    if device == "cpu" and not env.triton_interpret():
        pytest.skip("CPU Triton cases need TRITON_INTERPRET=1 at start (test_triton_interpret.py runs them)")
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("no CUDA device")


@dataclass(frozen=True)
class Case:
    id: str
    mode: str  # "blend" (G=1) | "groups" (G>1, per-sample segments) | "rows" (per-row slot)
    M: int
    K: int
    N: int
    R: int  # bank rank capacity
    ranks: tuple[int, ...]  # live rank per slot (0 = empty slot); S = len(ranks)
    scales: tuple[float, ...]  # per-slot scale (0 = inactive)
    G: int = 1
    dtype: str = "fp32"
    strided: bool = False  # x is a column slice of a wider tensor, y a slice too
    split: bool | None = False  # True: two-launch shrink + expand path; False: fused kernel; None: dispatch.py
    segments: tuple[tuple[int, int], ...] = ()  # rows mode: (slot, rows) runs in order (-1: base); () = random slots

    @property
    def S(self) -> int:
        return len(self.ranks)


def _c(id, mode, M, K, N, R, ranks, scales, **kw) -> Case:  # noqa: A002
    return Case(id, mode, M, K, N, R, tuple(ranks), tuple(scales), **kw)


CASES = [
    _c("blend-r16-M37-K48-N40-fp32", "blend", 37, 48, 40, 16, [16], [0.5]),
    _c("blend-r1-M5-K17-N3-fp16", "blend", 5, 17, 3, 16, [1], [2.0], dtype="fp16"),
    _c("blend-r128-M20-K24-N20-fp32", "blend", 20, 24, 20, 128, [128], [0.25]),
    _c("blend-S4-ranks3.16.40.64-zero-slot-fp16", "blend", 33, 40, 36, 64, [3, 16, 40, 64], [0.7, 0.0, 1.3, 0.4],
       dtype="fp16"),
    _c("blend-S16-r1..16-fp32", "blend", 19, 32, 24, 16, list(range(1, 17)),
       [0.0 if s % 5 == 0 else 0.1 * (s + 1) for s in range(16)]),
    _c("blend-S3-empty-slot-strided-fp16", "blend", 29, 40, 33, 32, [8, 0, 32], [1.0, 1.0, 0.5], dtype="fp16",
       strided=True),
    _c("blend-all-inactive-fp32", "blend", 17, 16, 16, 16, [16, 4], [0.0, 0.0]),
    _c("blend-M1-K33-N17-r7-fp16", "blend", 1, 33, 17, 16, [7], [1.0], dtype="fp16"),
    _c("blend-S2-r5.r70-bf16", "blend", 18, 20, 24, 80, [5, 70], [1.0, 0.5], dtype="bf16"),
    _c("blend-S4-r16-split-fp32", "blend", 21, 96, 40, 16, [16, 16, 16, 16], [0.5, 0.0, 1.0, 2.0], split=True),
    _c("groups-G3-M39-untiled-S3-fp32", "groups", 39, 24, 40, 32, [16, 32, 9], [1.0, 0.5, 2.0], G=3),
    _c("groups-G4-M44-base-sample-fp16", "groups", 44, 48, 20, 16, [16, 12, 16], [0.5, 1.0, 1.5], G=4, dtype="fp16"),
    _c("groups-G8-M8-one-row-each-fp32", "groups", 8, 32, 16, 16, [16, 2], [1.0, 1.0], G=8),
    _c("groups-G3-M45-split-strided-fp16", "groups", 45, 80, 36, 32, [16, 32, 5], [1.0, 0.0, 0.5], G=3,
       dtype="fp16", strided=True, split=True),
    _c("rows-S5-mixed-ranks-M33-fp32", "rows", 33, 40, 24, 64, [1, 16, 64, 33, 0], [1.0, 0.5, 0.25, 2.0, 1.0]),
    _c("rows-S3-r128-M18-fp16", "rows", 18, 24, 20, 128, [128, 100, 16], [0.5, 1.0, 0.0], dtype="fp16"),
    _c("rows-S16-r1..16-M40-fp32", "rows", 40, 16, 16, 16, list(range(1, 17)), [0.5] * 16),
    _c("rows-S2-M3-strided-fp16", "rows", 3, 17, 9, 16, [16, 3], [1.0, 2.0], dtype="fp16", strided=True),
    _c("rows-S4-r16-bf16", "rows", 24, 32, 24, 16, [16, 16, 8, 16], [1.0, 0.5, 2.0, 0.0], dtype="bf16"),
]


def _ragged(n: int) -> Case:
    """Per-row batch of n adapters (1..8) in contiguous runs of uneven length, a base run after the first, and for
    n >= 3 the first adapter again at the end (a slot in two runs), as an LLM batch of several users' requests."""
    runs = [(s, 1 + (5 * s + 3) % 7) for s in range(n)]
    runs.insert(1, (-1, 2))
    if n >= 3:
        runs.append((0, 3))
    dtype, M = ("fp32", "fp16", "bf16")[n % 3], sum(rows for _, rows in runs)
    return _c(f"rows-ragged-S{n}-M{M}-{dtype}", "rows", M, 24, 20, 16,
              [16, 3, 8, 16, 1, 12, 16, 5][:n], [1.0, 0.5, 2.0, 0.25, 1.5, 0.75, 1.0, 0.3][:n], dtype=dtype,
              segments=tuple(runs))


CASES += [_ragged(n) for n in range(1, 9)]

# Realistic widths (GPU only): SDXL / Flux / LLM layers with a 4-slot bank.
REALISTIC = [
    _c("sdxl-4096x1280-r64-S4-blend-fp16", "blend", 4096, 1280, 1280, 64, [64, 16, 32, 8], [0.5, 0.0, 0.8, 1.0],
       dtype="fp16"),
    _c("sdxl-4096x640-r16-G2-fp16", "groups", 4096, 640, 640, 16, [16, 16], [1.0, 0.7], G=2, dtype="fp16"),
    _c("flux-1024x3072-r16x4-blend-bf16", "blend", 1024, 3072, 3072, 16, [16, 16, 16, 16], [0.3, 0.3, 0.2, 0.2],
       dtype="bf16"),
    _c("llm-16x4096-r16-S8-rows-bf16", "rows", 16, 4096, 4096, 16, [16] * 8, [1.0] * 8, dtype="bf16"),
    _c("llm-16x4096-r64-S4-blend-bf16", "blend", 16, 4096, 4096, 64, [64, 64, 16, 0], [0.5, 0.5, 1.0, 1.0],
       dtype="bf16", split=None),
    _c("llm-256x4096-r16-S2-G2-bf16", "groups", 256, 4096, 4096, 16, [16, 16], [1.0, 0.5], G=2, dtype="bf16",
       split=None),
    _c("llm-256x4096-r32-S8-rows-fp16", "rows", 256, 4096, 4096, 32, [32, 16, 8, 32, 32, 1, 16, 32], [1.0] * 8,
       dtype="fp16"),
]


def with_dtype(case: Case, dtype: str) -> Case:
    return Case(**{**case.__dict__, "id": case.id.rsplit("-", 1)[0] + f"-{dtype}", "dtype": dtype})


def granule(r: int) -> int:
    return -(-r // 16) * 16


def make_inputs(case: Case, device: str, seed: int = 0) -> dict:
    """Kernel inputs (poisoned) and clean fp64 copies for the oracle."""
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[case.dtype]
    M, K, N, R, S = case.M, case.K, case.N, case.R, case.S

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    A = rnd(S, R, K, std=K**-0.5)
    B = rnd(N, S, R, std=R**-0.5)
    scale = torch.tensor(case.scales, dtype=torch.float32)
    ranks = torch.tensor(case.ranks, dtype=torch.int32)
    for s, r in enumerate(case.ranks):
        A[s, r:] = 0
        B[:, s, r:] = 0
    x = rnd(M, K)
    y = rnd(M, N)
    gw = torch.ones(1, S)
    row_slot = None
    if case.mode == "groups":
        gw = torch.zeros(case.G, S)
        for i in range(case.G):
            if i % 4 == 1 and case.G > 3:
                continue  # a base-only sample
            if i % 4 == 2:
                gw[i] = torch.rand(S, generator=g)  # a blended sample
            else:
                gw[i, i % S] = 1.0
    elif case.mode == "rows" and case.segments:
        row_slot = torch.tensor([s for s, rows in case.segments for _ in range(rows)], dtype=torch.int32)
        assert row_slot.shape == (M,), f"{case.id}: the segments hold {row_slot.shape[0]} rows, not M={M}"
    elif case.mode == "rows":
        row_slot = torch.randint(-1, S, (M,), generator=g, dtype=torch.int32)
        row_slot[: min(M, S)] = torch.arange(min(M, S), dtype=torch.int32)  # every slot appears
        if M > S:
            row_slot[S] = -1
    w = _row_weights(case, scale, gw, row_slot, ranks)  # [M, S] fp64, 0 where no adapter applies
    oracle = y.double() + torch.einsum("ms,msr,nsr->mn", w, torch.einsum("mk,srk->msr", x.double(), A.double()),
                                       B.double())

    # What the kernel sees: poison what it must skip.
    Ak, Bk, xk = A.clone(), B.clone(), x.clone()
    for s, r in enumerate(case.ranks):
        dead = scale[s] == 0 or r == 0
        Ak[s, 0 if dead else granule(r):] = float("nan")
        Bk[:, s, 0 if dead else granule(r):] = float("nan")
    xk[(w == 0).all(dim=1)] = float("nan")
    out = {
        "x": _place(xk.to(dt), device, case.strided),
        "y": _place(y.to(dt), device, case.strided),
        "A": Ak.to(dt).to(device),
        "B": Bk.to(dt).to(device),
        "scale": scale.to(device),
        "ranks": ranks.to(device),
        "oracle": oracle,
        "untouched": (w == 0).all(dim=1),
        "clean": {"x": x.to(dt), "y": y.to(dt), "A": A.to(dt), "B": B.to(dt), "w": w},
    }
    if case.mode == "rows":
        out["row_slot"] = row_slot.to(device)
    else:
        out["group_weight"] = gw.to(device)
    return out


def _row_weights(case, scale, gw, row_slot, ranks) -> torch.Tensor:
    M, S = case.M, case.S
    if row_slot is not None:
        w = (row_slot.long()[:, None] == torch.arange(S)).double() * scale.double()
    else:
        w = (gw.double() * scale.double()).repeat_interleave(M // gw.shape[0], dim=0)
    return w * (ranks > 0).double()


def _place(t: torch.Tensor, device: str, strided: bool) -> torch.Tensor:
    """A copy of t on device (never t itself: the kernels write y in place, and "clean" must stay clean);
    strided: a view into a wider buffer (row stride > columns, odd offset)."""
    if not strided:
        return t.to(device, copy=True)
    M, C = t.shape
    big = torch.full((M, C + 7), float("nan"), dtype=t.dtype, device=device)
    big[:, 3 : 3 + C] = t.to(device)
    return big[:, 3 : 3 + C]


def eager_peft(clean: dict, case: Case) -> torch.Tensor:
    """What PEFT-style eager torch computes in the operand dtype: one matmul pair per slot, added in dtype."""
    x, y, A, B, w = clean["x"], clean["y"].clone(), clean["A"], clean["B"], clean["w"]
    for s, r in enumerate(case.ranks):
        if r == 0 or not w[:, s].any():
            continue
        h = x @ A[s, :r].t()
        y = y + (h * w[:, s : s + 1].to(h.dtype)) @ B[:, s, :r].t()
    return y


def tolerance(case: Case, eager: torch.Tensor, oracle: torch.Tensor) -> float:
    """Twice eager's own max error in this dtype, plus a few ulps at the output's magnitude.

    The ulps cover a wide live rank that takes two passes (y rounded once per pass) and fp32's
    tiny eager error on short K, where "twice eager" alone would ask for better than one rounding.
    """
    eps = torch.finfo(DTYPES[case.dtype]).eps
    ulps = 4 if case.dtype == "fp32" else 2  # fp32: eager's K-sum error is tiny; allow a few roundings
    return 2.0 * (eager.double() - oracle).abs().max().item() + ulps * eps * oracle.abs().max().item()


# --- a two-layer model with adapters, for the model-level GPU tests of both backends -----------------------------
MLP_DIMS = {"0": (64, 96), "2": (96, 64)}  # fused layer path -> (in, out) of Linear(64, 96), GELU, Linear(96, 64)


def mlp_with_adapters(ranks: dict[str, int]) -> tuple[torch.nn.Module, dict[str, dict]]:
    """(model, {name: {path: ModuleLora}}): Linear-GELU-Linear in fp16 on CUDA, injected (4 slots, rank capacity
    32) under the current backend, with one random adapter per name at its rank (alpha = r) loaded."""
    import fdlora
    from fdlora import LoraAdapter, ModuleLora

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64)).cuda().half()
    fdlora.inject(model, list(MLP_DIMS), max_slots=4, max_rank=32)
    adapters = {}
    for name, r in ranks.items():
        adapters[name] = {p: ModuleLora(torch.randn(r, k) * 0.2, torch.randn(n, r) * 0.2, alpha=float(r))
                          for p, (k, n) in MLP_DIMS.items()}
        fdlora.add_adapter(model, LoraAdapter(adapters[name], name=name).to(dtype=torch.float16, device="cuda"))
    return model, adapters


def mlp_oracle(model: torch.nn.Module, adapters: dict[str, dict], x: torch.Tensor,
               active: dict[str, float]) -> torch.Tensor:
    """The model's output in fp32 from its base weights plus w * B A of each active adapter, every sample alike."""
    h = x.float()
    for i, p in enumerate(MLP_DIMS):
        lin = model[int(p)].base
        out = h @ lin.weight.float().t() + lin.bias.float()
        for n, w in active.items():
            m = adapters[n][p]
            out = out + w * (h @ m.A.cuda().float().t()) @ m.B.cuda().float().t()
        h = torch.nn.functional.gelu(out) if i == 0 else out
    return h
