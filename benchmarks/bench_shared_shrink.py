"""One shrink for layers that read the same input (fdlora.layers.modules.shared_shrink) vs one delta per layer.

    separate: y_i += (x A_i^T * w) B_i^T          lora_delta (or lora_delta_rows) once per member: x read n times
    grouped:  h = x [A_1; ...; A_n]^T once         lora_shrink (Triton: lora_shrink_split, partial sums kept) over
                                                   the members' stacked live slots, then
              y_i += (h_i * w) B_i^T               lora_expand_add per member on its columns of h
    per row (Triton), what ShrinkGroup runs: the stack slot-major [S, n*R, K] (shared.stack_by_slot), each row
    computed for its own slot only (lora_shrink_split's row_slot), each member's expand on its strided [P, M, S, R]
    view; the one-hot row weights (row_slot == slot numbers) built outside the timed call, as the layers' state
    keeps them for every group while the row slots stay the same (ModelState.row_onehot).

Shapes from real models: Flux double-block q/k/v (3072 -> 3072 x3, 4096 + 512 tokens) and single-block
q/k/v/proj_mlp (3072 -> 3072 x3, 12288), Llama-3-8B q/k/v (4096 -> 4096, 1024, 1024) and gate/up
(4096 -> 14336 x2) at decode (32 rows) and prefill (2048 rows); one adapter r16 in a bank of 4 slots
(blend), and 4 adapters r16 by row (LLM mixed batches). Every case is checked against the torch
reference first (float64-derived bound), then timed as GPU time: CUDA graph replays, L2 flushed before each,
median (bench_delta.gpu_us), in ROUNDS alternating rounds of each form (the median round is reported, every round
in runs_us). The ratio is what production runs / separate, the number to read; the issue's target
for q/k/v is <= 0.75. A per-row case of at most shared.FEW_ROWS rows is one production declines (decode: the members'
own launches run), so its ratio is 1 ("declined"), and the grouped form is still checked and timed beside it
(grouped_us, grouped_ratio).

    python benchmarks/bench_shared_shrink.py [--out benchmarks/results/<gpu>/shared_shrink.json]
    python benchmarks/bench_shared_shrink.py --smoke --out /tmp/s.json    # CPU, torch backend, seconds
    TRITON_INTERPRET=1 python benchmarks/bench_shared_shrink.py --smoke --backend triton --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fdlora.kernels import registry  # noqa: E402
from fdlora.layers.modules import shared_shrink as shared  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    M: int
    K: int
    Ns: tuple[int, ...]
    target: float | None  # the bound on grouped / separate, where it set one


SHAPES = [
    Shape("flux-double-qkv", 4608, 3072, (3072, 3072, 3072), 0.75),
    Shape("flux-single-qkv-mlp", 4608, 3072, (3072, 3072, 3072, 12288), None),
    Shape("llama8b-qkv-decode32", 32, 4096, (4096, 1024, 1024), 0.75),
    Shape("llama8b-qkv-prefill2048", 2048, 4096, (4096, 1024, 1024), 0.75),
    Shape("llama8b-gate-up-decode32", 32, 4096, (14336, 14336), None),
    Shape("llama8b-gate-up-prefill2048", 2048, 4096, (14336, 14336), None),
]
SMOKE = [Shape("smoke-qkv", 24, 64, (64, 32, 32), 0.75), Shape("smoke-gate-up", 8, 64, (96, 96), None),
         Shape("smoke-qkv-prefill", 80, 64, (64, 32, 32), 0.75)]  # per row above shared.FEW_ROWS: not declined
# mode, slots S, rank R, live slots; "sharedA": one A for every member (kohya Flux qkv), stacked once
# "-seq": each adapter's rows one run (an LLM prefill batch: every request's tokens are consecutive), else drawn
# at random per row (a decode batch: one row per request)
ROUNDS = 5  # each form timed this many times, alternating with the other; the median of each is reported
MODES = {"blend-r16": ("blend", 4, 16, 1), "blend-r16-sharedA": ("blend", 4, 16, 1), "rows-4xr16": ("rows", 4, 16, 4),
         "rows-4xr16-seq": ("rows", 4, 16, 4)}


def bytes_floor(s: Shape, r: int, shared_a: bool, h_cols: int | None = None) -> float:
    """grouped / separate in elements each must move at least (the ratio at equal bandwidth; launches not counted):
    separate reads x, A_i and B_i and reads and writes y_i per member; grouped reads x and the stacked A once, writes
    and re-reads h (h_cols columns a row per member: r, or a slot's rank when computed by row), then reads B_i and
    reads and writes y_i per member. Every y must still be read and written, so for
    q/k/v of equal width it is (1 + 2n) / 3n of x-sized passes, 0.78 for three. It is not a bound on the measured
    ratio: the separate deltas run below the bandwidth the grouped form reaches (H100, session 24: Flux q/k/v 0.632
    against 0.782), so it says how much of a ratio comes from bytes and how much from kernel efficiency."""
    n, M, K = len(s.Ns), s.M, s.K
    ys = sum(2 * M * N for N in s.Ns)
    Bs = sum(N * r for N in s.Ns)
    separate = n * (M * K + r * K) + ys + Bs
    h = r if h_cols is None else h_cols
    grouped = M * K + (1 if shared_a else n) * r * K + 2 * M * (1 if shared_a else n) * h + ys + Bs
    return grouped / separate


def build(s: Shape, mode: str, S: int, R: int, live: int, dtype, device, gen, shared_a: bool = False,
          runs: bool = False):
    x = torch.randn(s.M, s.K, generator=gen).to(device, dtype)
    As = [torch.zeros(S, R, s.K) for _ in s.Ns]
    Bs = [torch.zeros(n, S, R) for n in s.Ns]
    for A, B in zip(As, Bs):
        A[:live] = torch.randn(live, R, s.K, generator=gen) * s.K ** -0.5
        B[:, :live] = torch.randn(B.shape[0], live, R, generator=gen) * R ** -0.5
    As = [A.to(device, dtype) for A in As]
    Bs = [B.to(device, dtype) for B in Bs]
    ranks = torch.tensor([R] * live + [0] * (S - live), dtype=torch.int32, device=device)
    scale = torch.tensor([2.0 / R] * live + [0.0] * (S - live), device=device)
    gw = torch.ones(1, S, device=device)
    row_slot = torch.randint(-1, live, (s.M,), generator=gen, dtype=torch.int32).to(device)
    if runs:  # adapter i on rows [i M / live, (i + 1) M / live)
        row_slot = (torch.arange(s.M) * live // s.M).to(torch.int32).to(device)
    ys = [torch.randn(s.M, n, generator=gen).to(device, dtype) for n in s.Ns]
    # what ShrinkGroup._stacked holds: each member's slots up to the last live one (blend: the active adapters'
    # range; per row: the slots up to the last one used), a shared A once
    A_stack = torch.cat([A[:live] for A in As]).contiguous()
    if shared_a:
        As = [As[0]] * len(As)
        A_stack = As[0][:live].contiguous()
    return x, As, Bs, ranks, scale, gw, row_slot, ys, A_stack


def separate_fn(ops, mode, x, As, Bs, ranks, scale, gw, row_slot):
    if mode == "rows":
        return lambda ys: [ops.lora_delta_rows(y, x, A, B, scale, row_slot, ranks) for y, A, B in zip(ys, As, Bs)]
    return lambda ys: [ops.lora_delta(y, x, A, B, scale, gw, ranks) for y, A, B in zip(ys, As, Bs)]


def by_row(ops, mode: str) -> bool:
    """Whether ShrinkGroup shrinks by row here: per-row mode on a backend whose lora_shrink_split takes a row_slot."""
    return mode == "rows" and hasattr(ops, "lora_shrink_split")


def grouped_fn(ops, mode, x, As, Bs, scale, gw, row_slot, A_stack, U: int):
    """What ShrinkGroup.delta runs for the members of one input: one shrink over the stack (its K-split partial sums
    where the backend keeps them: lora_shrink_split), then each member's expand on its columns of h, over the stack's
    U slots (the live range; per-row weights as a [M, U] one-hot group weight, which the state keeps while the row
    slots stay the same: built outside the timed call, ModelState.row_onehot). Per row on Triton
    the stack is slot-major and the shrink computes each row's own slot only (module docstring)."""
    S, R = Bs[0].shape[1:]
    shrink = getattr(ops, "lora_shrink_split", ops.lora_shrink)
    Bu, su = [B[:, :U] for B in Bs], scale[:U]
    ids = torch.arange(U, dtype=torch.int32, device=x.device)
    w = (row_slot[:, None] == ids).float() if mode == "rows" else gw[:, :U]
    if by_row(ops, mode):
        A_rows, cols = shared.stack_by_slot([A[:U] for A in As])
        W = A_rows.shape[1]

        def f(ys):
            h = shrink(x, A_rows, row_slot).unflatten(-1, (U, W))
            for y, B, c in zip(ys, Bu, cols):
                ops.lora_expand_add(y, h[..., c:c + R], B, su, w)
        return f
    width = U * R
    one = A_stack.shape[0] == U  # a shared A: every member reads the same columns

    def f(ys):
        h = shrink(x, A_stack)
        for i, (y, B) in enumerate(zip(ys, Bu)):
            c = 0 if one else i * width
            ops.lora_expand_add(y, h[..., c:c + width], B, su, w)
    return f


def chosen() -> dict[str, str]:
    """Every Triton config the autotuner has chosen so far in this process, as "kernel key" -> config: the
    separate and grouped kernels' choices, which can differ between runs and move the ratio (session 26: the
    per-row prefill group took 60.7 us on one H100 and 67.8 on another, its separate deltas 87.7 and 87.9)."""
    try:
        from fdlora.kernels.triton import config as TC
    except ImportError:
        return {}
    return {f"{getattr(getattr(t.fn, 'fn', t.fn), '__name__', '?')} {k}": str(c) for (t, k), c in TC._CHOSEN.items()}


def wall_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def run_case(s: Shape, mode_name: str, ops, dtype, device, timer) -> dict:
    mode, S, R, live = MODES[mode_name]
    gen = torch.Generator().manual_seed(0)
    x, As, Bs, ranks, scale, gw, row_slot, ys0, A_stack = build(s, mode, S, R, live, dtype, device, gen,
                                                             mode_name.endswith("sharedA"), mode_name.endswith("seq"))
    sep = separate_fn(ops, mode, x, As, Bs, ranks, scale, gw, row_slot)
    grp = grouped_fn(ops, mode, x, As, Bs, scale, gw, row_slot, A_stack, live)
    # verify first: both against a float64 oracle, bound from eager torch's own error in this dtype
    w = ((row_slot.long()[:, None] == torch.arange(S, device=device)).double() if mode == "rows"
         else gw.double()) * scale.double()  # [M or 1, S]
    want = [y.double() + ((x.double() @ A.double().reshape(S * R, -1).t()).view(-1, S, R) * w[:, :, None])
            .reshape(s.M, S * R) @ B.double().reshape(B.shape[0], S * R).t() for y, A, B in zip(ys0, As, Bs)]
    eager = [y + ((x @ A.reshape(S * R, -1).t()).view(-1, S, R) * w.to(dtype)[:, :, None]).reshape(s.M, S * R)
             @ B.reshape(B.shape[0], S * R).t() for y, A, B in zip(ys0, As, Bs)]
    errs = {}
    for name, fn in (("separate", sep), ("grouped", grp)):
        got = [y.clone() for y in ys0]
        fn(got)
        errs[name] = max(float((g.double() - w).abs().max()) for g, w in zip(got, want))
    eager_err = max(float((e.double() - w).abs().max()) for e, w in zip(eager, want))
    bound = 4 * eager_err + 1e-6 * max(float(w.abs().max()) for w in want)
    ok = all(e <= bound for e in errs.values())
    work = [y.clone() for y in ys0]
    runs = {"separate": [], "grouped": []}
    for _ in range(ROUNDS if device == "cuda" else 1):  # alternating: a drift of the GPU's speed moves both alike
        runs["separate"].append(timer(lambda: sep(work)))
        runs["grouped"].append(timer(lambda: grp(work)))
    us_sep, us_grp = statistics.median(runs["separate"]), statistics.median(runs["grouped"])
    declined = mode == "rows" and s.M <= shared.FEW_ROWS  # ShrinkGroup.delta runs the separate deltas here
    us_prod = us_sep if declined else us_grp
    h_cols = R if by_row(ops, mode) else None
    row = {"case": s.name, "mode": mode_name, "M": s.M, "K": s.K, "Ns": list(s.Ns), "S": S, "R": R, "live": live,
           "separate_us": round(us_sep, 2), "grouped_us": round(us_grp, 2), "ratio": round(us_prod / us_sep, 3),
           "grouped_ratio": round(us_grp / us_sep, 3), "declined": declined, "by_row": by_row(ops, mode),
           "bytes_floor_ratio": round(bytes_floor(s, live * R, mode_name.endswith("sharedA"), h_cols), 3),
           "target": s.target, "err_separate": errs["separate"], "err_grouped": errs["grouped"], "bound": bound,
           "checked": ok, "runs_us": {k: [round(t, 2) for t in v] for k, v in runs.items()}}
    flag = "" if ok else "  WRONG"
    meets = "" if s.target is None or device == "cpu" else (
        "  (meets target)" if us_prod <= s.target * us_sep else "  (misses target)")
    note = f"  declined: runs separate (grouped x{us_grp / us_sep:.3f})" if declined else ""
    print(f"{s.name:30s} {mode_name:14s} separate {us_sep:9.1f} us  grouped {us_grp:9.1f} us  "
          f"x{us_prod / us_sep:.3f}{note}{meets}{flag}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/<gpu>/shared_shrink.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, torch backend, toy shapes: the code paths in seconds")
    ap.add_argument("--backend", default=None, help="ops backend (default: triton on CUDA, torch with --smoke)")
    ap.add_argument("--sha", default=None, help="git sha (the GPU machine may have no .git)")
    ap.add_argument("--only", default=None, help="cases whose 'name mode' contains this text")
    a = ap.parse_args()
    if a.smoke:
        device, dtype, shapes, backend = "cpu", torch.float32, SMOKE, a.backend or "torch"
        gpu = "cpu"

        def timer(fn):  # the code paths, not their speed: two timed runs (the Triton interpreter is slow)
            return wall_us(fn, 2)
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_shared_shrink: needs CUDA (or --smoke for the CPU code paths)")
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_delta import gpu_us

        device, dtype, shapes, backend = "cuda", torch.bfloat16, SHAPES, a.backend or "triton"
        gpu = torch.cuda.get_device_name().lower().replace(" ", "-")
        timer = gpu_us
    out = a.out or ROOT / "benchmarks" / "results" / gpu / "shared_shrink.json"
    ops = registry.ops(backend)
    sha = a.sha or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                  cwd=ROOT).stdout.strip()
    info = {"device": gpu if device == "cpu" else torch.cuda.get_device_name(), "backend": backend,
            "dtype": str(dtype), "torch": torch.__version__, "python": platform.python_version(), "git_sha": sha}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    rows = []
    for s in shapes:
        for mode_name in MODES:
            if mode_name.startswith("rows") and not s.name.startswith(("llama", "smoke")):
                continue
            if mode_name.endswith("sharedA") and not s.name.startswith(("flux", "smoke-qkv")):
                continue
            if a.only and a.only not in f"{s.name} {mode_name}":
                continue
            before = set(chosen())
            rows.append(run_case(s, mode_name, ops, dtype, device, timer))
            rows[-1]["tuned"] = {k: v for k, v in chosen().items() if k not in before}  # configs autotuned here
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({**info, "cases": rows}, indent=1) + "\n")  # partial results survive a timeout
    if not all(r["checked"] for r in rows):
        sys.exit("bench_shared_shrink: a case did not match the reference (WRONG above)")


if __name__ == "__main__":
    main()
