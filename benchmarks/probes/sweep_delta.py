# Measures: every candidate delta-kernel config per shape (the DELTA tables in fdlora/kernels/triton/config.py).
# Showed: the shipped delta-kernel configs (triton/config.py DELTA, split rule). sweep_delta*.json, sweep_s8*.json
"""Config sweep of the delta kernels: every candidate config timed on the GPU, per shape.

Diffusion shapes (fused blend kernel, lora_delta): GB/s of the delta on its minimal traffic
(x read once, y read and written once, A and B once) against a measured device-to-device copy.
Decode (per-row kernel, lora_delta_rows, 16 x 4096 -> 4096, 8 adapters mixed by row): time the
delta adds to the base GEMM inside one CUDA graph. Candidates: the shipped sets (config.DELTA)
plus the extra ones below; each is checked against the torch reference before it is timed.
Timing as in bench_delta.py (CUDA graph replay, L2 flushed before each replay, median).

    python benchmarks/probes/sweep_delta.py --out $OUT/results/sweep_delta.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_delta import SHAPES, Case, build, copy_bandwidth, gpu_us, ref_out  # noqa: E402

from fdlora.kernels.triton import config as C  # noqa: E402

cfg = C.cfg
# Session 8 candidates: PREFETCH 2 (first y / B tiles loaded before the shrink, tiles.first_tiles) and deeper
# pipelines (more K tiles in flight per program); session 7's extras are in sweep_delta.json / sweep_decode.json.
EXTRA_MANY = [
    cfg(2, 3, BM=16, BN=128, BK=128, PREFETCH=2, NSPLIT=64),
    cfg(2, 5, BM=16, BN=128, BK=128, PREFETCH=True, NSPLIT=64),
    cfg(2, 6, BM=16, BN=64, BK=256, PREFETCH=2, NSPLIT=64),
    cfg(4, 6, BM=16, BN=128, BK=128, PREFETCH=True, NSPLIT=64),
    cfg(4, 6, BM=16, BN=256, BK=128, PREFETCH=2, NSPLIT=64),
    cfg(4, 4, BM=32, BN=128, BK=256, PREFETCH=2, NSPLIT=64),
    cfg(4, 5, BM=32, BN=128, BK=128, PREFETCH=2, NSPLIT=64),
    cfg(8, 4, BM=64, BN=256, BK=128, PREFETCH=2, NSPLIT=1),
]
EXTRA_FEW = [  # WRAP: the N split's programs of one slot walk K from different starts (tiles.shrink_tile)
    cfg(4, 4, BM=16, BN=256, BK=256, PREFETCH=2, NSPLIT=16, WRAP=True),
    cfg(4, 4, BM=16, BN=256, BK=256, PREFETCH=False, NSPLIT=16, WRAP=True),
    cfg(4, 6, BM=16, BN=256, BK=256, PREFETCH=2, NSPLIT=16, WRAP=True),
    cfg(4, 6, BM=16, BN=256, BK=128, PREFETCH=2, NSPLIT=16, WRAP=True),
    cfg(4, 4, BM=16, BN=128, BK=256, PREFETCH=2, NSPLIT=32, WRAP=True),
    cfg(4, 3, BM=16, BN=128, BK=128, PREFETCH=2, NSPLIT=32, WRAP=True),
    cfg(4, 4, BM=16, BN=256, BK=256, PREFETCH=2, NSPLIT=8, WRAP=True),
    cfg(4, 4, BM=16, BN=64, BK=256, PREFETCH=2, NSPLIT=64, WRAP=True),
    cfg(2, 4, BM=16, BN=256, BK=256, PREFETCH=2, NSPLIT=16, WRAP=True),
    cfg(4, 4, BM=16, BN=256, BK=256, PREFETCH=2, NSPLIT=16),
]
EXTRA_WIDE = [  # rank 64 packed (r64, 4 x r16 blend) on Flux widths: bigger row blocks share A and B over more rows
    cfg(8, 4, BM=64, BN=256, BK=64, PREFETCH=True, NSPLIT=1),
    cfg(8, 3, BM=64, BN=128, BK=128, PREFETCH=True, NSPLIT=1),
    cfg(4, 3, BM=64, BN=128, BK=128, PREFETCH=True, NSPLIT=1),
    cfg(4, 4, BM=64, BN=128, BK=64, PREFETCH=True, NSPLIT=1),
    cfg(4, 3, BM=64, BN=64, BK=128, PREFETCH=True, NSPLIT=1),
    cfg(8, 3, BM=64, BN=512, BK=64, PREFETCH=True, NSPLIT=1),
    cfg(8, 3, BM=128, BN=128, BK=64, PREFETCH=True, NSPLIT=2),
    cfg(8, 3, BM=128, BN=256, BK=64, PREFETCH=True, NSPLIT=2),
    cfg(8, 4, BM=128, BN=128, BK=64, PREFETCH=True, NSPLIT=4),
    cfg(4, 3, BM=32, BN=256, BK=128, PREFETCH=True, NSPLIT=1),
    cfg(8, 3, BM=32, BN=256, BK=128, PREFETCH=True, NSPLIT=1),
    cfg(4, 3, BM=32, BN=128, BK=128, PREFETCH=True, NSPLIT=1),
]
R16 = Case("r16", "blend", 1, 16, (16,), (1.0,))
R64 = Case("r64", "blend", 1, 64, (64,), (1.0,))
BLEND4 = Case("blend4xr16", "blend", 4, 16, (16,) * 4, (0.4, 0.3, 0.2, 0.1))
ROWS = Case("rows8xr16", "rows", 8, 16, (16,) * 8, (1.0,) * 8)


def check(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    err = (got.double() - expected).abs().max().item()
    return err <= 4 * torch.finfo(dtype).eps * max(1.0, expected.abs().max().item())


def sweep_case(family, M, K, N, dtype, case, configs, copy_gbps, gen) -> dict:
    from fdlora.kernels.triton.forward import lora_delta, lora_delta_rows

    x, W, A, B, scale, gw, ranks, row_slot = build(M, K, N, dtype, case, gen)
    y = F.linear(x, W)
    expected = ref_out(case, y, x, A, B, scale, gw, ranks, row_slot).double()
    if case.mode == "rows":
        def run(yy, config=None):
            lora_delta_rows.launch_rows(yy, x, A, B, scale, row_slot, ranks, config=config)
    else:
        def run(yy, config=None):
            lora_delta.launch_fused(yy, x, A, B, scale, gw, ranks, config=config)
    T = sum(case.ranks)
    nbytes = x.element_size() * (M * K + 2 * M * N + T * (K + N))
    t_base = gpu_us(lambda: F.linear(x, W))
    out = {"family": family, "M": M, "K": K, "N": N, "case": case.name, "base_us": t_base, "configs": []}
    for config in [None, *configs]:
        name = "tuned" if config is None else str(config)
        try:
            got = y.clone()
            run(got, config)
            ok = check(got, expected, dtype)
            yt = y.clone()
            t = gpu_us(lambda yt=yt, config=config: run(yt, config))
            added = None
            if M <= 64:  # decode: what the delta adds to the base GEMM in one graph
                added = gpu_us(lambda config=config: run(F.linear(x, W), config)) - t_base
        except Exception as e:  # a config the compiler rejects (shared memory, registers)
            out["configs"].append({"config": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            continue
        row = {"config": name, "verified": ok, "us": t, "frac_copy": nbytes / (t * 1e-6) / 1e9 / copy_gbps}
        if added is not None:
            row["graph_added_us"] = added
        out["configs"].append(row)
    if case.mode == "rows":  # the floor of one launch: every program finds no row of its slot and exits
        none = torch.full_like(row_slot, -1)
        out["no_rows_graph_added_us"] = gpu_us(
            lambda: lora_delta_rows.launch_rows(F.linear(x, W), x, A, B, scale, none, ranks)) - t_base
    good = [c for c in out["configs"] if c.get("verified")]
    best = min(good, key=lambda c: c["us"]) if good else None
    out["best"] = best
    tuned = out["configs"][0]
    if best is None:
        print(f"{family} {M}x{K}->{N} {case.name}: no config ran: {tuned.get('error')}", flush=True)
        return out
    print(f"{family:5s} {M:6d}x{K:5d}->{N:5d} {case.name:10s} tuned {tuned.get('us', 0):7.1f} us "
          f"({tuned.get('frac_copy', 0):.2f} copy) | best {best['us']:7.1f} us ({best['frac_copy']:.2f} copy"
          + (f", +{best['graph_added_us']:.1f} us on base" if "graph_added_us" in best else "")
          + f") {best['config']}", flush=True)
    return out


def components(family, M, K, N, dtype, case, copy_gbps, gen) -> dict:
    """Where the fused kernel's time goes: the split path (shrink, then expand-add) and each half alone,
    next to torch's own streaming kernels on the same bytes (read x; read + write y)."""
    from fdlora.kernels.triton.forward import lora_delta, lora_expand_add, lora_shrink

    x, W, A, B, scale, gw, ranks, row_slot = build(M, K, N, dtype, case, gen)
    y = F.linear(x, W)
    expected = ref_out(case, y, x, A, B, scale, gw, ranks, row_slot).double()
    e = x.element_size()
    T = sum(case.ranks)

    def split(yy):
        lora_expand_add.launch_expand_add(yy, lora_shrink.launch_shrink(x, A, scale, ranks), B, scale, gw, ranks)

    got = y.clone()
    split(got)
    h = lora_shrink.launch_shrink(x, A, scale, ranks)
    yt = y.clone()
    t = {
        "fused": gpu_us(lambda: lora_delta.launch_fused(yt, x, A, B, scale, gw, ranks)),
        "split": gpu_us(lambda: split(yt)),
        "shrink": gpu_us(lambda: lora_shrink.launch_shrink(x, A, scale, ranks)),
        "expand": gpu_us(lambda: lora_expand_add.launch_expand_add(yt, h, B, scale, gw, ranks)),
        "torch_read_x": gpu_us(lambda: x.sum(dtype=torch.float32)),
        "torch_rmw_y": gpu_us(lambda: yt.mul_(1.0)),
    }
    minimal = e * (M * K + 2 * M * N + T * (K + N))
    traffic = {"fused": minimal, "split": minimal, "shrink": e * M * K, "expand": 2 * e * M * N,
               "torch_read_x": e * M * K, "torch_rmw_y": 2 * e * M * N}  # bytes each one must move
    frac = {k: traffic[k] / (t[k] * 1e-6) / 1e9 / copy_gbps for k in t}
    out = {"family": family, "M": M, "K": K, "N": N, "case": case.name, "split_ok": check(got, expected, dtype),
           "P": h.shape[0], "us": t, "frac_copy": frac}
    print(f"{family:5s} {M:6d}x{K:5d}->{N:5d} {case.name:10s} " + " ".join(
        f"{k} {t[k]:6.1f}us/{frac[k]:.2f}" for k in t), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="decode,diffusion")
    args = ap.parse_args()
    from triton.testing import do_bench

    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbps = copy_bandwidth(do_bench)
    print(f"copy {copy_gbps:.0f} GB/s", flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "copy_GBps": copy_gbps,
           "timing": "CUDA graph replay, L2 flushed, median", "rows": []}
    t0 = time.time()
    parts = args.parts.split(",")
    if "decode" in parts:
        res["rows"].append(sweep_case("llm", 16, 4096, 4096, torch.bfloat16, ROWS, C.DELTA["few"] + EXTRA_FEW,
                                      copy_gbps, gen))
    if "diffusion" in parts:
        for family, M, K, N, dtype in SHAPES:
            if family == "llm":
                continue
            cases = [R16, R64] if family == "flux" and N == 3072 else [R16]
            for case in cases:
                res["rows"].append(sweep_case(family, M, K, N, dtype, case, C.DELTA["many"] + EXTRA_MANY,
                                              copy_gbps, gen))
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(res, indent=1))
    if "wide" in parts:  # the 4-blend target (<= 1.3x one r16) on the Flux shapes where rank 64 is slowest
        for family, M, K, N, dtype in SHAPES:
            if family == "flux" and K == 3072:
                for case in (R16, BLEND4, R64):
                    res["rows"].append(sweep_case(family, M, K, N, dtype, case, C.DELTA["many"] + EXTRA_WIDE,
                                                  copy_gbps, gen))
    if "components" in parts:
        res["components"] = []
        for family, M, K, N, dtype in SHAPES:
            if family != "llm":
                for case in (R16, R64):
                    res["components"].append(components(family, M, K, N, dtype, case, copy_gbps, gen))
    res["seconds"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
