"""LoRA delta per layer: cuBLAS base GEMM vs PEFT-style torch LoRA vs fd-lora's Triton delta.

Shapes from real models (SDXL fp16, Flux bf16, LLM bf16), cases: one adapter r16 / r64, a blend of
4 x r16, 4 x r16 by sample segments (one adapter per sample), 8 x r16 mixed by row (LLM). Every
case is first checked against the torch reference (same tolerance rule as the tests), then timed
as GPU time: each path captured in a CUDA graph, L2 flushed before every replay, median of the
replays (CUDA events), so host overhead is out and every column pays cold caches alike. The eager
fd-lora call is also timed with triton.testing.do_bench (median; host overhead included).
Decode shapes add "base + delta" graphs: what the delta adds to the layer. GB/s is the delta's
minimal traffic (x read once, y read and written once, live A and B once) over its time, next to
a measured device-to-device copy: a 1 GiB one (the asymptotic figure, `copy_GBps`) and one moving
the delta's own byte count, timed the same way (`fd_frac_same_size_copy`: that copy's time over the
delta's; kernels of 20-120 us do not reach the 1 GiB figure, and neither does a copy of that size).

    python benchmarks/bench_delta.py --out benchmarks/results/<gpu>/delta.json [--quick]

A full run takes 5-7 minutes on an H100, most of it the autotuner compiling and timing configs;
results are written after every case, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fdlora.kernels import ops as ref  # noqa: E402
from fdlora.testing import graph_ms  # noqa: E402

SHAPES = [  # name, M, K, N, dtype
    ("sdxl", 8192, 1280, 1280, torch.float16),
    ("sdxl", 16384, 640, 640, torch.float16),
    ("sdxl", 8192, 1280, 5120, torch.float16),
    ("sdxl", 8192, 5120, 1280, torch.float16),
    ("flux", 4608, 3072, 3072, torch.bfloat16),
    ("flux", 4608, 3072, 12288, torch.bfloat16),
    ("flux", 4608, 12288, 3072, torch.bfloat16),
    ("llm", 16, 4096, 4096, torch.bfloat16),
    ("llm", 256, 4096, 4096, torch.bfloat16),
]


@dataclass(frozen=True)
class Case:
    name: str
    mode: str  # blend | groups | rows
    S: int
    R: int
    ranks: tuple[int, ...]
    weights: tuple[float, ...]
    G: int = 1


CASES = [
    Case("r16", "blend", 1, 16, (16,), (1.0,)),
    Case("r64", "blend", 1, 64, (64,), (1.0,)),
    Case("blend4xr16", "blend", 4, 16, (16,) * 4, (0.4, 0.3, 0.2, 0.1)),
    Case("seg4xr16", "groups", 4, 16, (16,) * 4, (1.0,) * 4, G=4),
    Case("rows8xr16", "rows", 8, 16, (16,) * 8, (1.0,) * 8),
    Case("r16-in-8x64-bank", "blend", 8, 64, (16,) + (64,) * 7, (1.0,) + (0.0,) * 7),
]


def cases_for(family: str) -> list[Case]:
    if family == "llm":
        return CASES
    return [c for c in CASES if c.mode != "rows"]


def build(M, K, N, dtype, c: Case, gen):
    dev = "cuda"
    x = torch.randn(M, K, device=dev, generator=gen).to(dtype)
    W = (torch.randn(N, K, device=dev, generator=gen) * K**-0.5).to(dtype)
    A = torch.randn(c.S, c.R, K, device=dev, generator=gen) * K**-0.5
    B = torch.randn(N, c.S, c.R, device=dev, generator=gen) * c.R**-0.5
    for s, r in enumerate(c.ranks):
        A[s, r:] = 0
        B[:, s, r:] = 0
    A, B = A.to(dtype), B.to(dtype)
    scale = torch.tensor(c.weights, device=dev, dtype=torch.float32)
    ranks = torch.tensor(c.ranks, device=dev, dtype=torch.int32)
    if c.mode == "groups":
        gw = torch.eye(c.G, c.S, device=dev)
    else:
        gw = torch.ones(1, c.S, device=dev)
    row_slot = torch.randint(0, c.S, (M,), device=dev, generator=gen, dtype=torch.int32)
    return x, W, A, B, scale, gw, ranks, row_slot


def peft_delta_fn(c: Case, x, A, B, scale, gw, row_slot):
    """What PEFT's unmerged forward does per adapter: lora_B(lora_A(x)) * scaling, added to the result."""
    M = x.shape[0]
    live = [s for s, w in enumerate(c.weights) if w != 0]
    As = {s: A[s, : c.ranks[s]] for s in live}
    Bs = {s: B[:, s, : c.ranks[s]] for s in live}
    if c.mode == "blend":
        def f(y):
            for s in live:
                y = y + (x @ As[s].t()) @ Bs[s].t() * c.weights[s]
            return y
    elif c.mode == "groups":  # PEFT mixed batch: one sub-batch per adapter
        seg = M // c.G
        def f(y):
            y = y.clone()
            for s in live:
                sl = slice(s * seg, (s + 1) * seg)
                y[sl] += (x[sl] @ As[s].t()) @ Bs[s].t() * c.weights[s]
            return y
    else:
        idx = {s: (row_slot == s).nonzero().flatten() for s in live}  # PEFT computes these per forward
        def f(y):
            y = y.clone()
            for s in live:
                i = idx[s]
                y.index_add_(0, i, (x[i] @ As[s].t()) @ Bs[s].t() * c.weights[s])
            return y
    return f


def fd_fn(c: Case, ops, x, A, B, scale, gw, ranks, row_slot):
    if c.mode == "rows":
        return lambda y: ops.lora_delta_rows(y, x, A, B, scale, row_slot, ranks)
    return lambda y: ops.lora_delta(y, x, A, B, scale, gw, ranks)


def ref_out(c: Case, y, x, A, B, scale, gw, ranks, row_slot):
    out = y.clone()
    if c.mode == "rows":
        ref.lora_delta_rows(out, x, A, B, scale, row_slot, ranks)
    else:
        ref.lora_delta(out, x, A, B, scale, gw, ranks)
    return out


def count_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def gpu_us(fn, reps: int = 30) -> float:
    """Median GPU time of fn as a CUDA graph replay, L2 flushed before each replay (fdlora.testing.graph_ms)."""
    return statistics.median(graph_ms(fn, reps)) * 1e3


def tuned(kernels: dict, M: int) -> dict:
    """The config the autotuner picked for this M (and its timings of every config, if kept)."""
    from fdlora.kernels.triton import config as C

    k = C.pick(kernels, M)
    out = {"best": str(getattr(k, "best_config", None))}
    timings = getattr(k, "configs_timings", None)
    if timings:
        out["timings_ms"] = {str(c): t for c, t in timings.items()}
    return out


def copy_bandwidth(do_bench) -> float:
    """GB/s of a 1 GiB device-to-device copy, bytes read + written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / ms / 1e6


def same_size_copy_us(nbytes: int) -> float:
    """A device-to-device copy moving `nbytes` in all (nbytes / 2 read, nbytes / 2 written), timed like the
    kernels: what the fastest kernel moving the delta's bytes can take at this size (ramp-up and tail
    included, which a 1 GiB copy amortizes away)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return gpu_us(lambda: dst.copy_(src))


def run_case(family, M, K, N, dtype, c: Case, gen, ops, copy_gbps: float, sms: int) -> dict:
    from triton.testing import do_bench

    from fdlora.kernels.triton.forward import (
        delta_dispatch as dispatch,
    )
    from fdlora.kernels.triton.forward import (
        lora_delta,
        lora_delta_rows,
        lora_expand_add,
        lora_shrink,
    )

    x, W, A, B, scale, gw, ranks, row_slot = build(M, K, N, dtype, c, gen)
    y = F.linear(x, W)
    peft = peft_delta_fn(c, x, A, B, scale, gw, row_slot)
    fd = fd_fn(c, ops, x, A, B, scale, gw, ranks, row_slot)
    # verify: fd-lora vs reference (fp32 math), bound = 2 x PEFT-style error + 1 ulp
    expected = ref_out(c, y, x, A, B, scale, gw, ranks, row_slot).double()
    got = y.clone()
    fd(got)
    err = (got.double() - expected).abs().max().item()
    err_peft = (peft(y).double() - expected).abs().max().item()
    tol = 2 * err_peft + torch.finfo(dtype).eps * expected.abs().max().item()
    ok = bool(err <= tol) and not got.isnan().any().item()
    # time
    yt = y.clone()
    t_base = gpu_us(lambda: F.linear(x, W))
    t_peft = gpu_us(lambda: peft(y))
    t_fd = gpu_us(lambda: fd(yt))
    t_eager = do_bench(lambda: fd(yt), return_mode="median") * 1e3
    T = sum(r for r, w in zip(c.ranks, c.weights) if w != 0)
    e = x.element_size()
    nbytes = e * (M * K + 2 * M * N + T * (K + N))
    gbps = nbytes / (t_fd * 1e-6) / 1e9
    row = {
        "family": family, "M": M, "K": K, "N": N, "dtype": str(dtype).split(".")[-1], **asdict(c),
        "verified": ok, "max_err": err, "tol": tol,
        "base_us": t_base, "peft_us": t_peft, "fd_us": t_fd, "fd_eager_us": t_eager,
        "fd_GBps": gbps, "fd_frac_copy": gbps / copy_gbps,
        "copy_same_bytes_us": (t_copy := same_size_copy_us(nbytes)), "fd_frac_same_size_copy": t_copy / t_fd,
        "fd_over_peft": t_fd / t_peft, "base_plus_fd_over_base": (t_base + t_fd) / t_base,
        "base_plus_peft_over_base": (t_base + t_peft) / t_base,
    }
    if c.mode == "rows":
        row["config"] = tuned(lora_delta_rows._KERNELS, M)
    else:
        row["plan"] = dispatch.delta_plan(M, K, N, c.S, c.R, e, sms)
        if row["plan"] == "fused":
            row["config"] = tuned(lora_delta._KERNELS, M)
        else:
            row["config"] = {"shrink": tuned(lora_shrink._KERNELS, M), "expand": tuned(lora_expand_add._KERNELS, M)}
    if family != "llm":
        return row
    row["fd_kernels"] = count_kernels(lambda: fd(yt))

    def base_then(fn):
        def g():
            fn(F.linear(x, W))
        return g

    t_gb = gpu_us(lambda: F.linear(x, W))
    t_gfd = gpu_us(base_then(fd))
    t_gpeft = gpu_us(lambda: peft(F.linear(x, W)))
    row.update({"graph_base_us": t_gb, "graph_base_fd_us": t_gfd, "graph_base_peft_us": t_gpeft,
                "graph_fd_added_us": t_gfd - t_gb, "graph_peft_added_us": t_gpeft - t_gb})
    if c.mode == "blend":  # both paths, to check dispatch.py's rule

        def fused(yy):
            lora_delta.launch_fused(yy, x, A, B, scale, gw, ranks)

        def split(yy):
            h = lora_shrink.launch_shrink(x, A, scale, ranks)
            lora_expand_add.launch_expand_add(yy, h, B, scale, gw, ranks)

        for nm, fn in (("fused", fused), ("split", split)):
            chk = y.clone()
            fn(chk)
            row[f"{nm}_ok"] = bool((chk.double() - expected).abs().max().item() <= tol)
            row[f"{nm}_graph_added_us"] = gpu_us(base_then(fn)) - t_gb
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="first shape of each family only")
    ap.add_argument("--only", default="", help="comma-separated FAMILY or FAMILY:M, e.g. llm:16 (default: all)")
    ap.add_argument("--sha", default=None, help="git sha (the GPU machine may have no .git)")
    a = ap.parse_args()

    import triton
    from triton.testing import do_bench

    from fdlora.kernels import registry

    ops = registry.ops("triton")
    t_start = time.time()
    sha = a.sha
    if sha is None:
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            sha = "unknown"
    props = torch.cuda.get_device_properties(0)
    copy_gbps = copy_bandwidth(do_bench)
    print(f"{props.name}: copy {copy_gbps:.0f} GB/s (read+write), torch {torch.__version__}, "
          f"triton {triton.__version__}")

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    shapes = SHAPES if not a.quick else [s for i, s in enumerate(SHAPES) if i in (0, 4, 7)]
    if a.only:
        want = set(a.only.split(","))
        shapes = [s for s in shapes if s[0] in want or f"{s[0]}:{s[1]}" in want]
    for family, M, K, N, dtype in shapes:
        for c in cases_for(family):
            row = run_case(family, M, K, N, dtype, c, gen, ops, copy_gbps, props.multi_processor_count)
            rows.append(row)
            write(a.out, props, sha, copy_gbps, t_start, rows)  # partial results survive a timeout
            print(f"{family:5s} {M:6d}x{K:5d}->{N:5d} {c.name:17s} ok={row['verified']!s:5s} "
                  f"base {row['base_us']:7.1f} peft {row['peft_us']:7.1f} fd {row['fd_us']:7.1f} us "
                  f"(eager {row['fd_eager_us']:6.1f}) "
                  f"{row['fd_GBps']:5.0f} GB/s ({row['fd_frac_copy']:4.0%}; same-size copy "
                  f"{row['fd_frac_same_size_copy']:4.0%}) fd/peft {row['fd_over_peft']:5.2f} "
                  f"(b+fd)/b {row['base_plus_fd_over_base']:5.3f}"
                  + (f"  graph +fd {row['graph_fd_added_us']:.1f} us, +peft {row['graph_peft_added_us']:.1f} us, "
                     f"{row['fd_kernels']} kernel(s)" if family == "llm" else ""), flush=True)

    summarize(write(a.out, props, sha, copy_gbps, t_start, rows))


def write(out: Path, props, sha: str, copy_gbps: float, t_start: float, rows: list[dict]) -> dict:
    import triton

    result = {
        "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(), "git_sha": sha,
        "copy_GBps": copy_gbps,
        "timing": "*_us: CUDA-graph replay, L2 flushed, median; fd_eager_us: triton do_bench median",
        "seconds": time.time() - t_start, "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def summarize(res: dict) -> None:
    rows = res["rows"]
    diff = [r for r in rows if r["family"] != "llm"]
    print("\ntargets:")
    r16 = [r for r in diff if r["name"] == "r16"]
    if r16:
        worst = min(r["fd_frac_copy"] for r in r16)
        print(f"  diffusion r16 delta >= 75% of copy bandwidth: worst {worst:.0%} "
              f"({'met' if worst >= 0.75 else 'missed'}) against the 1 GiB copy")
        same = min(r["fd_frac_same_size_copy"] for r in r16)
        print(f"  diffusion r16 delta >= 75% of copy bandwidth: worst {same:.0%} "
              f"({'met' if same >= 0.75 else 'missed'}) against a copy of the delta's own byte count")
    worst_ratio = max((r["fd_over_peft"] for r in diff), default=float("nan"))
    print(f"  diffusion delta <= 0.5x PEFT-style, every shape and case: worst {worst_ratio:.2f}x "
          f"({'met' if worst_ratio <= 0.5 else 'missed'})")
    dec = [r for r in rows if r["family"] == "llm" and r["M"] == 16 and r["name"] == "rows8xr16"]
    for r in dec:
        print(f"  decode 16x4096 8 adapters by row: {r['fd_kernels']} kernel(s), +{r['graph_fd_added_us']:.1f} us "
              f"over base in a graph ({'met' if r['fd_kernels'] == 1 and r['graph_fd_added_us'] <= 10 else 'missed'})")
    for shape in sorted({(r["M"], r["K"], r["N"]) for r in rows}):
        one = [r for r in rows if (r["M"], r["K"], r["N"]) == shape and r["name"] == "r16"]
        four = [r for r in rows if (r["M"], r["K"], r["N"]) == shape and r["name"] == "blend4xr16"]
        if one and four:
            q = four[0]["fd_us"] / one[0]["fd_us"]
            print(f"  blend 4 x r16 / 1 x r16 at {shape}: {q:.2f} ({'met' if q <= 1.3 else 'missed'})")
    bad = [f"{r['family']} {r['M']}x{r['K']}->{r['N']} {r['name']}" for r in rows if not r["verified"]]
    print(f"  verification: {'all cases match the reference' if not bad else 'FAILED: ' + ', '.join(bad)}")


if __name__ == "__main__":
    main()
