"""lora_backward_parts: the LoRA backward's three pieces as separate Triton kernels, each shaped for bandwidth.

    gy piece (program: a group of row blocks x one BN column block; no inner loop when the group is one block):
        g_p    = gy Bs        [M, r]   fp32, the column block's partial, stored per row block (Bs = s B)
        gB_q   = gy^T h       [N, r]   fp32, accumulated over the group's rows, stored once per group
    gA piece (program: a group of row blocks x one BK column block):
        gA_q   = g^T u        [r, K]   fp32, accumulated over the group's rows, stored once per group
    gu piece (program: one [BM, BK] tile; no loop at all):
        grad_u = g As (+ grad_u, in place: the base part gy W computed before by cuBLAS)
    g = sum_p g_p (rounded to u's dtype, as the GEMM writing g in it would), grad_B = s sum_q gB_q, grad_A = sum_q gA_q

Each piece reads its big operand once (gy, u) or writes it once (grad_u) and reduces over rows into per-group partial
sums instead of atomics (deterministic, no memset). Why not one loop per program over the reduced axis, as the
two-pass kernels of fdlora.kernels.triton.train.lora_backward do: there each program walks 1-2 steps of a [BM, BN] tile
and stores a partial per step, so loads are never in flight ahead of the dots (the pass over gy ran at 0.2 TB/s on an
H100). Here a program either loops over enough row blocks for the software pipeline (num_stages) to keep loads in
flight, or has no loop and relies on many resident programs instead; the sweep (benchmarks/probes/
sweep_train_backward_parts.py) picks per shape. g crosses between pieces either summed once ([M, r] in u's dtype) or
as its fp32 partials [P, M, r], summed by the consuming kernel. The torch oracle is
fdlora.kernels.ops.lora_train.lora_train_linear_backward. `half_backward_plan` composes the shipped cuBLAS
half path (lora_train.lora_train_linear_backward_half) from one form per piece, for the sweep. On an H100 at
bench_train's layer shapes no combination beats it timed per call (Triton's launches are host-bound there); as GPU
time the best per shape does (0.51 / 0.70 / 0.37 / 0.65x the torch path against the half path's 0.58 / 0.76 /
0.45 / 0.73x), still short of the 0.6 target at two shapes. On a training path: `x_pass`, the gA
and gu pieces in one pass over u (u read once, grad_u written beside it), which eager CUDA steps of large layers run
(`half_backward_fused`, chosen by fdlora.kernels.train_ops.half_backward).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fdlora.kernels.ops.lora_train import _mm_f32, _to, lora_train_linear_backward_half
from fdlora.kernels.triton import config as C
from fdlora.kernels.triton.tiles import mma

MAX_RANK = 64  # rank columns kept in registers next to a tile; wider ranks take cuBLAS


@triton.jit
def _load_g(g_ptr, rows, rm, rr, rk, P, sgp, sgm, sgr, BM: tl.constexpr, RP: tl.constexpr, ROUND: tl.constexpr):
    """g's [BM, RP] rows: the plain tensor (P = 1), or the fp32 sum of its partials (ROUND; the caller rounds it)."""
    ptr = g_ptr + rows[:, None] * sgm + rr[None, :] * sgr
    mask = rm[:, None] & rk[None, :]
    if ROUND:
        g = tl.zeros((BM, RP), dtype=tl.float32)
        for p in range(0, P):
            g += tl.load(ptr + p * sgp, mask=mask, other=0.0)
    else:
        g = tl.load(ptr, mask=mask, other=0.0)
    return g


@triton.jit
def _blocks(L, R, BL: tl.constexpr, RP: tl.constexpr):
    """This program's row block (or group) and its BL columns of L, with the rank axis: (pid_m, the column block,
    cols, their mask, ranks, their mask). Consecutive programs take adjacent columns of the same rows."""
    pid = tl.program_id(0)
    lb = tl.cdiv(L, BL)
    pid_m, pid_l = pid // lb, pid % lb
    cols = pid_l * BL + tl.arange(0, BL)
    rr = tl.arange(0, RP)
    return pid_m, pid_l, cols, cols < L, rr, rr < R


@triton.jit
def _grad_u_kernel(
    g_ptr,  # [P, M, r]: P = 1 and u's dtype, or fp32 partials (ROUND)
    a_ptr,  # [r, K] u's dtype
    out_ptr,  # [M, K] out (ADD: holds the base part, added to in place)
    M, K, R, P,
    sgp, sgm, sgr, sar, sak, som, sok,
    RP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, ADD: tl.constexpr, ROUND: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, _, ks, km, rr, rk = _blocks(K, R, BK, RP)
    rows = pid_m * BM + tl.arange(0, BM)
    rm = rows < M
    rows = rows.to(tl.int64)
    g = _load_g(g_ptr, rows, rm, rr, rk, P, sgp, sgm, sgr, BM, RP, ROUND)
    a = tl.load(a_ptr + rr[:, None] * sar + ks[None, :] * sak, mask=rk[:, None] & km[None, :], other=0.0)
    g = g.to(tl.float32) if IEEE else g.to(out_ptr.dtype.element_ty)  # partials: the rounding of a GEMM writing g
    a = a.to(tl.float32) if IEEE else a.to(out_ptr.dtype.element_ty)
    acc = mma(g, a, tl.zeros((BM, BK), dtype=tl.float32), False, IEEE)
    ptr = out_ptr + rows[:, None] * som + ks[None, :] * sok
    mask = rm[:, None] & km[None, :]
    if ADD:
        acc += tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rank_zeros(L: tl.constexpr, RP: tl.constexpr, RANK_FIRST: tl.constexpr):
    """The fp32 accumulator of a rank-wide reduction over rows: [RP, L] with RANK_FIRST, else [L, RP]."""
    if RANK_FIRST:
        return tl.zeros((RP, L), dtype=tl.float32)
    else:
        return tl.zeros((L, RP), dtype=tl.float32)


@triton.jit
def _rank_acc(wide, rank, acc, RANK_FIRST: tl.constexpr, IEEE: tl.constexpr):
    """acc += rank^T wide ([RP, L]: rank as the dot's M) with RANK_FIRST, else wide^T rank ([L, RP]): one row block
    of a reduction over rows (wide [BM, L], rank [BM, RP])."""
    if RANK_FIRST:
        return mma(tl.trans(rank), wide, acc, False, IEEE)
    else:
        return mma(tl.trans(wide), rank, acc, False, IEEE)


@triton.jit
def _rank_store(ptr, ls, rr, sl, sr, acc, lm, rk, RANK_FIRST: tl.constexpr):
    """Store `_rank_zeros`' accumulator at ptr + l * sl + r * sr (columns ls, ranks rr, masks lm and rk)."""
    if RANK_FIRST:
        tl.store(ptr + rr[:, None] * sr + ls[None, :] * sl, acc, mask=rk[:, None] & lm[None, :])
    else:
        tl.store(ptr + ls[:, None] * sl + rr[None, :] * sr, acc, mask=lm[:, None] & rk[None, :])


@triton.jit
def _grad_a_kernel(
    g_ptr,  # [P, M, r]: P = 1 and u's dtype, or fp32 partials (ROUND)
    u_ptr,  # [M, K]
    out_ptr,  # [G, r, K] fp32 out: g^T u's partial per row group
    M, K, R, P, rows_per,
    sgp, sgm, sgr, sum_, suk,
    RP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, TRANS: tl.constexpr, ROUND: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, _, ks, km, rr, rk = _blocks(K, R, BK, RP)
    lo = pid_m * rows_per
    hi = tl.minimum(M, lo + rows_per)
    acc = _rank_zeros(BK, RP, not TRANS)  # TRANS: u^T g, the wide axis K as the dot's M (the MMA's long side)
    for m0 in range(lo, hi, BM):
        rows = m0 + tl.arange(0, BM)
        rm = rows < hi
        rows = rows.to(tl.int64)
        g = _load_g(g_ptr, rows, rm, rr, rk, P, sgp, sgm, sgr, BM, RP, ROUND)
        u = tl.load(u_ptr + rows[:, None] * sum_ + ks[None, :] * suk, mask=rm[:, None] & km[None, :], other=0.0)
        g = g.to(tl.float32) if IEEE else g.to(u_ptr.dtype.element_ty)
        u = u.to(tl.float32) if IEEE else u
        acc = _rank_acc(u, g, acc, not TRANS, IEEE)
    _rank_store(out_ptr + pid_m.to(tl.int64) * R * K, ks, rr, 1, K, acc, km, rk, not TRANS)


@triton.jit
def _x_pass_kernel(
    g_ptr,  # [M, r] u's dtype
    u_ptr,  # [M, K]
    a_ptr,  # [r, K] u's dtype (A)
    gu_ptr,  # [M, K] out: g A
    gap_ptr,  # [G, r, K] fp32 out: g^T u's partial per row group
    M, K, R, rows_per,
    sgm, sgr, sum_, suk, sar, sak, som, sok,
    RP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
):
    """The gA and gu pieces in one pass over u's columns: each [BM, BK] step reads u's tile for grad_A's partial and
    writes grad_u's tile beside it (g and A's columns stay in registers)."""
    pid_m, _, ks, km, rr, rk = _blocks(K, R, BK, RP)
    a = tl.load(a_ptr + rr[:, None] * sar + ks[None, :] * sak, mask=rk[:, None] & km[None, :], other=0.0)
    a = a.to(tl.float32) if IEEE else a.to(u_ptr.dtype.element_ty)
    acc = _rank_zeros(BK, RP, True)
    lo = pid_m * rows_per
    for m0 in range(lo, tl.minimum(M, lo + rows_per), BM):
        rows = m0 + tl.arange(0, BM)
        rm = rows < tl.minimum(M, lo + rows_per)
        rows = rows.to(tl.int64)
        g = _load_g(g_ptr, rows, rm, rr, rk, 1, 0, sgm, sgr, BM, RP, False)
        u = tl.load(u_ptr + rows[:, None] * sum_ + ks[None, :] * suk, mask=rm[:, None] & km[None, :], other=0.0)
        g = g.to(tl.float32) if IEEE else g.to(u_ptr.dtype.element_ty)
        acc = _rank_acc(u.to(tl.float32) if IEEE else u, g, acc, True, IEEE)
        out = mma(g, a, tl.zeros((BM, BK), dtype=tl.float32), False, IEEE)
        tl.store(gu_ptr + rows[:, None] * som + ks[None, :] * sok, out.to(gu_ptr.dtype.element_ty),
                 mask=rm[:, None] & km[None, :])
    _rank_store(gap_ptr + pid_m.to(tl.int64) * R * K, ks, rr, 1, K, acc, km, rk, True)


@triton.jit
def _gy_kernel(
    gy_ptr,  # [M, N]
    bs_ptr,  # [N, r] (s B, gy's dtype)
    h_ptr,  # [M, r]
    gp_ptr,  # [NB, M, r] fp32 out: g's partial per column block
    gbp_ptr,  # [G, N, r] fp32 out: gy^T h's partial per row group
    M, N, R, rows_per,
    sgm, sgn, sbn, sbr, shm, shr,
    RP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TRANS: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m, pid_n, cols, cm, rr, rk = _blocks(N, R, BN, RP)
    b = tl.load(bs_ptr + cols[:, None] * sbn + rr[None, :] * sbr, mask=cm[:, None] & rk[None, :], other=0.0)
    b = b.to(tl.float32) if IEEE else b.to(gy_ptr.dtype.element_ty)
    gb = _rank_zeros(BN, RP, TRANS)  # TRANS: h^T gy, rank as the dot's M
    lo = pid_m * rows_per
    hi = tl.minimum(M, lo + rows_per)
    for m0 in range(lo, hi, BM):
        rows = m0 + tl.arange(0, BM)
        rm = rows < hi
        rows = rows.to(tl.int64)
        gy = tl.load(gy_ptr + rows[:, None] * sgm + cols[None, :] * sgn, mask=rm[:, None] & cm[None, :], other=0.0)
        h = tl.load(h_ptr + rows[:, None] * shm + rr[None, :] * shr, mask=rm[:, None] & rk[None, :], other=0.0)
        gy = gy.to(tl.float32) if IEEE else gy
        h = h.to(tl.float32) if IEEE else h.to(gy_ptr.dtype.element_ty)
        g = mma(gy, b, tl.zeros((BM, RP), dtype=tl.float32), False, IEEE)
        tl.store(gp_ptr + (pid_n.to(tl.int64) * M + rows)[:, None] * R + rr[None, :], g, mask=rm[:, None] & rk[None, :])
        gb = _rank_acc(gy, h, gb, TRANS, IEEE)
    _rank_store(gbp_ptr + pid_m.to(tl.int64) * N * R, cols, rr, R, 1, gb, cm, rk, TRANS)


@dataclass(frozen=True)
class Tile:
    """One launch shape of a piece: BM rows x BL columns (BN of gy, BK of u) a step, warps, pipeline stages, `fill`
    programs per SM the row groups aim for (0: one row block a program, no loop), `trans` the dot's orientation."""

    BM: int = 128
    BL: int = 128
    warps: int = 4
    stages: int = 3
    fill: int = 2
    trans: bool = False

    @property
    def name(self) -> str:
        return f"{self.BM}x{self.BL}-w{self.warps}-s{self.stages}-f{self.fill}" + ("-t" if self.trans else "")

    def launch(self, L: str, r: int, dtype: torch.dtype) -> dict:
        """A piece's launch keywords for this shape: BM, its column block `L` ("BN" or "BK") = BL, RP (rank r padded),
        IEEE (fp32 operands: no tf32), warps and stages."""
        return {"BM": self.BM, L: self.BL, "RP": _rp(r), "IEEE": dtype == torch.float32, "num_warps": self.warps,
                "num_stages": self.stages}

    @staticmethod
    def parse(name: str) -> Tile:
        m = re.fullmatch(r"(\d+)x(\d+)-w(\d+)-s(\d+)-f(\d+)(-t)?", name)
        if m is None:
            raise ValueError(f"launch shape {name!r} is not BMxBL-wW-sS-fF[-t], e.g. '128x128-w4-s3-f2'")
        return Tile(*map(int, m.groups()[:5]), trans=m.group(6) is not None)


INTERPRETED = Tile(BM=16, BL=16, warps=1, stages=1, fill=1)


def _rp(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def _rows_per(M: int, L: int, t: Tile, device_t: torch.Tensor) -> tuple[int, int]:
    """(row groups, rows per group, a whole number of BM blocks) so that groups x column blocks >= fill x SMs."""
    mb = triton.cdiv(M, t.BM)
    if t.fill == 0:
        return mb, t.BM
    want = max(1, min(mb, triton.cdiv(t.fill * C.device_sms(device_t), triton.cdiv(L, t.BL))))
    per = triton.cdiv(mb, want) * t.BM
    return triton.cdiv(M, per), per


def _parts(g: torch.Tensor) -> torch.Tensor:
    return g if g.dim() == 3 else g.unsqueeze(0)


def _launch_tile(tile: Tile | None) -> Tile:
    return tile or (INTERPRETED if C.INTERPRET else Tile())


def _g_operand(g: torch.Tensor, tile: Tile | None) -> tuple[Tile, torch.Tensor, int, int, int]:
    """(launch shape, g as [P, M, r] partials, P, M, r) of a piece that reads g."""
    gp = _parts(g)
    return (_launch_tile(tile), gp, *gp.shape)


def grad_u(
    g: torch.Tensor,  # [M, r] (u's dtype) or [P, M, r] fp32 partials
    As: torch.Tensor,  # [r, K]
    out: torch.Tensor,  # [M, K] written, or added to (add)
    add: bool = False,
    tile: Tile | None = None,
) -> torch.Tensor:  # out
    t, gp, P, M, r = _g_operand(g, tile)
    K = As.shape[1]
    if M == 0 or K == 0:
        return out
    _grad_u_kernel[(triton.cdiv(M, t.BM) * triton.cdiv(K, t.BL),)](
        gp, As, out, M, K, r, P, *gp.stride(), *As.stride(), *out.stride(), ADD=add, ROUND=g.dim() == 3,
        **t.launch("BK", r, out.dtype))
    return out


def grad_a_partials(
    g: torch.Tensor,  # [M, r] (u's dtype) or [P, M, r] fp32 partials
    u: torch.Tensor,  # [M, K]
    tile: Tile | None = None,
) -> torch.Tensor:  # [G, r, K] fp32: g^T u's partial per row group
    t, gp, P, M, r = _g_operand(g, tile)
    K = u.shape[1]
    G, per = _rows_per(M, K, t, u)
    out = torch.empty(G, r, K, dtype=torch.float32, device=u.device)
    _grad_a_kernel[(G * triton.cdiv(K, t.BL),)](
        gp, u, out, M, K, r, P, per, *gp.stride(), *u.stride(), TRANS=t.trans, ROUND=g.dim() == 3,
        **t.launch("BK", r, u.dtype))
    return out


def grad_a(
    g: torch.Tensor,  # [M, r] (u's dtype) or [P, M, r] fp32 partials
    u: torch.Tensor,  # [M, K]
    tile: Tile | None = None,
) -> torch.Tensor:  # grad_A = g^T u [r, K] fp32
    if u.shape[0] == 0:
        return torch.zeros(_parts(g).shape[2], u.shape[1], dtype=torch.float32, device=u.device)
    p = grad_a_partials(g, u, tile)
    return p[0] if p.shape[0] == 1 else p.sum(0)


def x_pass(
    g: torch.Tensor,  # [M, r] u's dtype
    u: torch.Tensor,  # [M, K]
    As: torch.Tensor,  # [r, K] u's dtype
    tile: Tile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # grad_u = g As [M, K] (u's dtype), grad_A = g^T u [r, K] fp32
    """The gA and gu pieces in one pass (`_x_pass_kernel`): u read once, grad_u written beside it."""
    t = _launch_tile(tile)
    M, K = u.shape
    r = g.shape[1]
    out = torch.empty(M, K, dtype=u.dtype, device=u.device)
    if M == 0 or K == 0:
        return out, torch.zeros(r, K, dtype=torch.float32, device=u.device)
    G, per = _rows_per(M, K, t, u)
    parts = torch.empty(G, r, K, dtype=torch.float32, device=u.device)
    _x_pass_kernel[(G * triton.cdiv(K, t.BL),)](
        g, u, As, out, parts, M, K, r, per, *g.stride(), *u.stride(), *As.stride(), *out.stride(),
        **t.launch("BK", r, u.dtype))
    return out, (parts[0] if G == 1 else parts.sum(0))


FUSED_TILE = Tile(BM=128, BL=128, warps=8, stages=3, fill=2)  # x_pass's best at bench_train's layer shapes


def half_backward_fused(
    gy: torch.Tensor, u: torch.Tensor, h: torch.Tensor, W: torch.Tensor | None, As: torch.Tensor, Bs: torch.Tensor,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # grad_u (+ gy W), grad_A fp32, grad_B fp32
    """lora_train.lora_train_linear_backward_half (grad_u wanted) with grad_A and grad_u from one pass over u
    (`x_pass`): what eager CUDA steps run where u is large enough for GPU time to matter (train_ops). On an H100 at
    M = 8192, K = 4096 the pass takes 59 us against cuBLAS's 67-69 for the two GEMMs; at K = 14336, 175-180 against
    182 (benchmarks/probes/probe_x_pass.py)."""
    return lora_train_linear_backward_half(gy, u, h, W, As, Bs, scale, True, _fused_pass)


def _fused_pass(g: torch.Tensor, u: torch.Tensor, As: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x_pass(g, u, As, FUSED_TILE)


def gy_partials(
    gy: torch.Tensor,  # [M, N]
    h: torch.Tensor,  # [M, r]
    Bs: torch.Tensor,  # [N, r] (s B)
    tile: Tile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # g's partials [NB, M, r], gy^T h's partials [G, N, r], fp32
    t = _launch_tile(tile)
    M, N = gy.shape
    r = Bs.shape[1]
    nb = triton.cdiv(N, t.BL)
    G, per = _rows_per(M, N, t, gy)
    gp = torch.empty(nb, M, r, dtype=torch.float32, device=gy.device)
    gbp = torch.empty(G, N, r, dtype=torch.float32, device=gy.device)
    _gy_kernel[(G * nb,)](
        gy, Bs, h, gp, gbp, M, N, r, per, *gy.stride(), *Bs.stride(), *h.stride(), TRANS=t.trans,
        **t.launch("BN", r, gy.dtype))
    return gp, gbp


def gy_piece(
    gy: torch.Tensor,  # [M, N]
    h: torch.Tensor,  # [M, r]
    Bs: torch.Tensor,  # [N, r]
    scale: torch.Tensor,  # [] fp32
    tile: Tile | None = None,
    keep_partials: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # g [M, r] in gy's dtype (keep_partials: [NB, M, r] fp32), grad_B fp32
    M, N = gy.shape
    if M == 0:
        return gy.new_zeros(M, Bs.shape[1]), torch.zeros(Bs.shape, dtype=torch.float32, device=gy.device)
    gp, gbp = gy_partials(gy, h, Bs, tile)
    grad_B = (gbp[0] if gbp.shape[0] == 1 else gbp.sum(0)).mul_(scale)
    if keep_partials:
        return gp, grad_B
    g = gp[0] if gp.shape[0] == 1 else gp.sum(0)
    return g.to(gy.dtype), grad_B


def supports(u: torch.Tensor, r: int) -> bool:
    """Whether these kernels take a backward of rank r on u (else its caller runs cuBLAS)."""
    return r <= MAX_RANK and u.dtype in (torch.float16, torch.bfloat16, torch.float32)


# A plan's Triton entries: "tri:<Tile name>" (gy: "tri:...+p" keeps g's partials for Triton gA and gu pieces).
def gy_impl(spec: str):
    keep = spec.endswith("+p")
    t = Tile.parse(spec.removesuffix("+p"))
    return lambda gy, h, Bs, scale: gy_piece(gy, h, Bs, scale, t, keep)


def ga_impl(spec: str):
    t = Tile.parse(spec)
    return lambda g, u: grad_a(g, u, t)


def gu_impl(spec: str):
    t = Tile.parse(spec)

    def gu(g, As, gy, W):
        M, K = gy.shape[0], As.shape[1]
        if W is None:
            return grad_u(g, As, torch.empty(M, K, dtype=gy.dtype, device=gy.device), False, t)
        return grad_u(g, As, torch.mm(gy, W if W.dtype is gy.dtype else W.to(gy.dtype)), True, t)

    return gu


# --- plans: lora_train_linear_backward_half composed from one form per piece -------------------------------------
# {"gy": g and grad_B (one operand, gy), "gA": grad_A, "gu": grad_u} -> a name of HALF_PIECES' cuBLAS forms or
# "tri:<launch shape>", a kernel above (gy "tri:...+p" hands g's fp32 partials to Triton gA and gu pieces).
# benchmarks/probes/sweep_train_backward_parts.py times every candidate and every plan against the half path.


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`_mm_f32` batched."""
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def _split(t: torch.Tensor, S: int) -> torch.Tensor | None:
    """t [M, c] as [S, M / S, c] (a view), or None where M does not split evenly or t is not row-major."""
    M = t.shape[0]
    if M % S or not t.is_contiguous():
        return None
    return t.view(S, M // S, t.shape[1])


def _gy_mm(gy, h, Bs, scale, g_t=False, b_t=False, split=0):
    """(g, grad_B) by cuBLAS: g = gy Bs (g_t: as (Bs^T gy^T)^T), grad_B = s gy^T h (b_t: as (h^T gy)^T; split: as
    S row blocks' products in one batched GEMM, then their sum)."""
    g = torch.mm(Bs.t(), gy.t()).t() if g_t else torch.mm(gy, Bs)
    gys, hs = (_split(gy, split), _split(h, split)) if split else (None, None)
    if gys is not None and hs is not None:
        grad_B = _bmm_f32(gys.transpose(1, 2), hs).sum(0)
    else:
        grad_B = _mm_f32(h.t(), gy).t() if b_t else _mm_f32(gy.t(), h)
    return g, grad_B.mul_(scale)


def _ga_mm(g, u, t=False, split=0):
    """grad_A = g^T u by cuBLAS (t: as (u^T g)^T; split: S row blocks in one batched GEMM, then their sum)."""
    gs, us = (_split(g, split), _split(u, split)) if split else (None, None)
    if gs is not None and us is not None:
        return _bmm_f32(gs.transpose(1, 2), us).sum(0)
    return _mm_f32(u.t(), g).t() if t else _mm_f32(g.t(), u)


def _gu_mm(g, As, gy, W):
    grad_u = torch.mm(g, As)
    if W is not None:
        grad_u.addmm_(gy, _to(W, gy.dtype))
    return grad_u


HALF_PIECES = {  # piece -> cuBLAS implementation name -> function
    "gy": {"mm": _gy_mm, "mm_gt": lambda *a: _gy_mm(*a, g_t=True), "mm_bt": lambda *a: _gy_mm(*a, b_t=True),
           "mm_t": lambda *a: _gy_mm(*a, g_t=True, b_t=True), "bmm4": lambda *a: _gy_mm(*a, split=4),
           "bmm8": lambda *a: _gy_mm(*a, split=8)},
    "gA": {"mm": _ga_mm, "mm_t": lambda g, u: _ga_mm(g, u, t=True), "bmm4": lambda g, u: _ga_mm(g, u, split=4),
           "bmm8": lambda g, u: _ga_mm(g, u, split=8)},
    "gu": {"mm": _gu_mm},
}


def half_backward_plan(plan: dict[str, str]):
    """The backward composed from `plan` ({"gy": name, "gA": name, "gu": name}; a missing piece is "mm"), with
    `lora_train_linear_backward_half`'s signature. Raises ValueError naming the choices for an unknown name."""
    plan = {"gy": "mm", "gA": "mm", "gu": "mm", **plan}
    if set(plan) - set(HALF_PIECES):
        raise ValueError(f"unknown pieces {sorted(set(plan) - set(HALF_PIECES))}; the pieces are {list(HALF_PIECES)}")
    if plan["gy"].endswith("+p") and not (plan["gA"].startswith("tri:") and plan["gu"].startswith("tri:")):
        raise ValueError(f"gy={plan['gy']!r} keeps g's partials, which only Triton gA and gu pieces take")
    fns = {}
    for piece, name in plan.items():
        if name.startswith("tri:"):
            fns[piece] = globals()[piece.lower() + "_impl"](name[4:])
        elif name in HALF_PIECES[piece]:
            fns[piece] = HALF_PIECES[piece][name]
        else:
            raise ValueError(f"{piece}={name!r} is neither 'tri:<launch shape>' nor one of {list(HALF_PIECES[piece])}")
    gy_fn, ga_fn, gu_fn = fns["gy"], fns["gA"], fns["gu"]
    uses_triton = any(n.startswith("tri:") for n in plan.values())

    def backward(gy, u, h, W, As, Bs, scale, need_u=True):
        if uses_triton and Bs.shape[1] > 64:  # (lora_backward_parts.MAX_RANK: wider ranks do not fit its tiles)
            gy_f, ga_f, gu_f = _gy_mm, _ga_mm, _gu_mm
        else:
            gy_f, ga_f, gu_f = gy_fn, ga_fn, gu_fn
        g, grad_B = gy_f(gy, h, _to(Bs, u.dtype), scale)
        grad_A = ga_f(g, u)
        return (gu_f(g, As, gy, W) if need_u else None), grad_A, grad_B

    return backward
