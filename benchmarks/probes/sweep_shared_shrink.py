# Measures: where a shared q/k/v shrink's time goes: separate, grouped, wide-rank, K-split forms.
"""Where a shared shrink's time goes (bench_shared_shrink's q/k/v shapes, one adapter r16 in banks of 4 slots, blend):
the separate deltas, the bench's grouped form (the stack over all 4 slots of each member), the form ShrinkGroup.delta
runs in blend mode (the stack over the active slot only), that stack read as one wide-rank slot with its K-split
partial sums handed to the expands (no sum launch), and a cuBLAS shrink; each kernel alone too. Every form is
checked against the separate deltas first.

Per row (Llama q/k/v and gate/up, 4 adapters r16 by row): the separate lora_delta_rows, the member-major group
(the wide shrink over every slot of every member, S*R-wide expands: ShrinkGroup before the by-row shrink) and the
by-row group ShrinkGroup runs now (bench_shared_shrink.grouped_fn), with the by-row shrink, the one-hot weights and
each expand alone.

Splits (the few-row shapes, blend): the shipped shrink's K-split partial sums (summed first above SPLIT_KEEP) against
the shrink capped at P partials, wide and member-major stacks, each with its expands and alone.

    python benchmarks/probes/sweep_shared_shrink.py --out $OUT/sweep_shared_shrink.json     # GPU
    python benchmarks/probes/sweep_shared_shrink.py --parts splits rows --out ...            # some sections only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_delta import gpu_us  # noqa: E402
from bench_shared_shrink import MODES, SHAPES, build, grouped_fn  # noqa: E402

from fdlora.kernels import registry  # noqa: E402
from fdlora.kernels.triton.forward.lora_expand_add import launch_expand_add  # noqa: E402
from fdlora.kernels.triton.forward.lora_shrink import launch_shrink  # noqa: E402
from fdlora.layers.modules import shared_shrink as shared  # noqa: E402


def run_case(s, ops, dev, dt) -> dict:
    gen = torch.Generator().manual_seed(0)
    x, As, Bs, ranks, scale, gw, _, ys0, A_stack = build(s, "blend", 4, 16, 1, dt, dev, gen)
    n = len(As)
    live = torch.cat([A[:1] for A in As]).contiguous()  # [n, 16, K]: ShrinkGroup's stack over slot 0
    wide = live.view(1, n * 16, s.K)
    B1 = [B[:, :1] for B in Bs]
    sc1, gw1 = scale[:1].contiguous(), gw[:, :1].contiguous()
    flat = live.view(n * 16, s.K)

    def separate(ys):
        for y, A, B in zip(ys, As, Bs):
            ops.lora_delta(y, x, A, B, scale, gw, ranks)

    def bench_grouped(ys):
        h = ops.lora_shrink(x, A_stack)
        for i, (y, B) in enumerate(zip(ys, Bs)):
            ops.lora_expand_add(y, h[:, i * 64:(i + 1) * 64], B, scale, gw)

    def prod(ys):
        h = ops.lora_shrink(x, live)
        for i, (y, B) in enumerate(zip(ys, B1)):
            ops.lora_expand_add(y, h[:, i * 16:(i + 1) * 16], B, sc1, gw1)

    def wide_partials(ys):
        h = launch_shrink(x, wide)  # [P, M, n*16]
        for i, (y, B) in enumerate(zip(ys, B1)):
            launch_expand_add(y, h[:, :, i * 16:(i + 1) * 16], B, sc1, gw1)

    def cublas_shrink(ys):
        h = torch.mm(x, flat.t(), out_dtype=torch.float32)
        for i, (y, B) in enumerate(zip(ys, B1)):
            launch_expand_add(y, h[:, i * 16:(i + 1) * 16], B, sc1, gw1)

    forms = {"separate": separate, "bench_grouped": bench_grouped, "prod": prod, "wide_partials": wide_partials,
             "cublas_shrink": cublas_shrink}
    row = {"case": s.name, "M": s.M, "K": s.K, "Ns": list(s.Ns), **_time_forms(forms, ys0)}
    h = torch.mm(x, flat.t(), out_dtype=torch.float32)
    work = [y.clone() for y in ys0]
    parts = {
        "shrink_bench": lambda: ops.lora_shrink(x, A_stack),
        "shrink_prod": lambda: ops.lora_shrink(x, live),
        "shrink_wide": lambda: launch_shrink(x, wide),
        "shrink_cublas": lambda: torch.mm(x, flat.t(), out_dtype=torch.float32),
        **{f"expand_{i}": (lambda i=i, y=y: launch_expand_add(y, h[:, i * 16:(i + 1) * 16], B1[i], sc1, gw1))
           for i, y in enumerate(work)},
        **{f"delta_{i}": (lambda i=i, y=y: ops.lora_delta(y, x, As[i], Bs[i], scale, gw, ranks))
           for i, y in enumerate(work)},
    }
    row["parts_us"] = {k: gpu_us(f) for k, f in parts.items()}
    row["ratio"] = {k: v / row["us"]["separate"] for k, v in row["us"].items()}
    print(f"{s.name}: " + "  ".join(f"{k} {v:.1f}us (x{row['ratio'][k]:.3f})" for k, v in row["us"].items()),
          flush=True)
    print("    parts: " + "  ".join(f"{k} {v:.1f}" for k, v in row["parts_us"].items()), flush=True)
    print("    max abs diff vs separate: " + "  ".join(f"{k} {v:.2e}" for k, v in row["err"].items()), flush=True)
    return row


def _time_forms(forms: dict, ys0: list) -> dict:
    """{"err": each form's max abs difference from forms["separate"], "us": its GPU time}, each run on fresh copies of
    the outputs ys0."""
    want = [y.clone() for y in ys0]
    forms["separate"](want)
    out = {"us": {}, "err": {}}
    for name, fn in forms.items():
        got = [y.clone() for y in ys0]
        fn(got)
        out["err"][name] = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))
        work = [y.clone() for y in ys0]
        out["us"][name] = gpu_us(lambda fn=fn, work=work: fn(work))
    return out


def run_rows_case(s, ops, dev, dt) -> dict:
    _, S, R, live = MODES["rows-4xr16"]
    gen = torch.Generator().manual_seed(0)
    x, As, Bs, ranks, scale, gw, row_slot, ys0, A_stack = build(s, "rows", S, R, live, dt, dev, gen)

    def separate(ys):
        for y, A, B in zip(ys, As, Bs):
            ops.lora_delta_rows(y, x, A, B, scale, row_slot, ranks)

    forms = {"separate": separate, "member_major": _member_major(ops, x, Bs, scale, row_slot, A_stack, live),
             "by_row": grouped_fn(ops, "rows", x, As, Bs, scale, gw, row_slot, A_stack, live)}
    row = {"case": s.name, "mode": "rows-4xr16", "M": s.M, "K": s.K, "Ns": list(s.Ns),
           "declined": s.M <= shared.FEW_ROWS, **_time_forms(forms, ys0)}
    A_rows, cols = shared.stack_by_slot([A[:live] for A in As])
    h = ops.lora_shrink_split(x, A_rows, row_slot).unflatten(-1, (live, A_rows.shape[1]))
    ids = torch.arange(live, dtype=torch.int32, device=dev)
    w = (row_slot[:, None] == ids).float()
    work = [y.clone() for y in ys0]
    parts = {
        "shrink_member_major": lambda: ops.lora_shrink_split(x, A_stack),
        "shrink_by_row": lambda: ops.lora_shrink_split(x, A_rows, row_slot),
        "onehot": lambda: (row_slot[:, None] == ids).float(),
        **{f"expand_by_row_{i}": (lambda i=i, y=y: ops.lora_expand_add(y, h[..., cols[i]:cols[i] + R],
                                                                       Bs[i][:, :live], scale[:live], w))
           for i, y in enumerate(work)},
        **{f"delta_rows_{i}": (lambda i=i, y=y: ops.lora_delta_rows(y, x, As[i], Bs[i], scale, row_slot, ranks))
           for i, y in enumerate(work)},
    }
    row["parts_us"] = {k: gpu_us(f) for k, f in parts.items()}
    row["ratio"] = {k: v / row["us"]["separate"] for k, v in row["us"].items()}
    print(f"{s.name} rows: " + "  ".join(f"{k} {v:.1f}us (x{row['ratio'][k]:.3f})" for k, v in row["us"].items())
          + ("  (declined in production)" if row["declined"] else ""), flush=True)
    print("    parts: " + "  ".join(f"{k} {v:.1f}" for k, v in row["parts_us"].items()), flush=True)
    print("    max abs diff vs separate: " + "  ".join(f"{k} {v:.2e}" for k, v in row["err"].items()), flush=True)
    return row


def _member_major(ops, x, Bs, scale, row_slot, A_stack, U: int):
    """ShrinkGroup's per-row form before the by-row shrink: the wide shrink over every member's U slots, each expand
    over all U*R columns of its block (one-hot weights mask the other slots)."""
    R = Bs[0].shape[2]
    ids = torch.arange(U, dtype=torch.int32, device=x.device)

    def f(ys):
        h = ops.lora_shrink_split(x, A_stack)
        w = (row_slot[:, None] == ids).float()
        for i, (y, B) in enumerate(zip(ys, Bs)):
            ops.lora_expand_add(y, h[..., i * U * R:(i + 1) * U * R], B[:, :U], scale[:U], w)
    return f


def run_splits_case(s, ops, dev, dt) -> dict:
    """Blend at few rows: how many K-split partial sums the group's shrink should hand the expands. The shipped
    lora_shrink_split (k_splits' count; more than SPLIT_KEEP are summed first, one launch more) against the shrink
    capped at P partials (no sum), over the wide stack [1, n*R, K] and the member-major one [n, R, K]."""
    gen = torch.Generator().manual_seed(0)
    x, As, Bs, ranks, scale, gw, _, ys0, A_stack = build(s, "blend", 4, 16, 1, dt, dev, gen)
    B1 = [B[:, :1] for B in Bs]
    sc1, gw1 = scale[:1].contiguous(), gw[:, :1].contiguous()

    def separate(ys):
        for y, A, B in zip(ys, As, Bs):
            ops.lora_delta(y, x, A, B, scale, gw, ranks)

    def grouped(shrink):
        def f(ys):
            h = shrink()
            for i, (y, B) in enumerate(zip(ys, B1)):
                ops.lora_expand_add(y, h[..., i * 16:(i + 1) * 16], B, sc1, gw1)
        return f

    wide = A_stack.view(1, -1, s.K)
    shrinks = {"prod": lambda: ops.lora_shrink_split(x, A_stack),
               **{f"wide_p{p}": (lambda p=p: launch_shrink(x, wide, most=p)) for p in (1, 2, 4, 8)},
               **{f"member_p{p}": (lambda p=p: launch_shrink(x, A_stack, most=p)) for p in (2, 4)}}
    forms = {"separate": separate, **{k: grouped(f) for k, f in shrinks.items()}}
    row = {"case": s.name, "mode": "blend-r16", "M": s.M, "K": s.K, "Ns": list(s.Ns), **_time_forms(forms, ys0),
           "partials": {k: f().shape[0] for k, f in shrinks.items()},
           "shrink_us": {k: gpu_us(f) for k, f in shrinks.items()}}
    row["ratio"] = {k: v / row["us"]["separate"] for k, v in row["us"].items()}
    print(f"{s.name} splits: " + "  ".join(f"{k} {v:.1f}us (x{row['ratio'][k]:.3f}, P={row['partials'].get(k, '-')})"
                                           for k, v in row["us"].items()), flush=True)
    print("    shrink alone: " + "  ".join(f"{k} {v:.1f}" for k, v in row["shrink_us"].items()), flush=True)
    print("    max abs diff vs separate: " + "  ".join(f"{k} {v:.2e}" for k, v in row["err"].items()), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--parts", nargs="*", default=["blend", "rows", "splits"], choices=["blend", "rows", "splits"])
    a = ap.parse_args()
    ops, dev, dt = registry.ops("triton"), "cuda", torch.bfloat16
    rows = [run_case(s, ops, dev, dt) for s in SHAPES if s.target is not None] if "blend" in a.parts else []
    per_row = ([run_rows_case(s, ops, dev, dt) for s in SHAPES if s.name.startswith("llama")]
               if "rows" in a.parts else [])
    splits = ([run_splits_case(s, ops, dev, dt) for s in SHAPES if s.M <= shared.FEW_ROWS]
              if "splits" in a.parts else [])
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "per_row": per_row,
           "splits": splits}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
