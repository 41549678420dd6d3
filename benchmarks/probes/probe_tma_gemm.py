# Measures: a Hopper TMA Triton GEMM, with and without the in-loop LoRA shrink, vs cuBLAS at Flux shapes.
# Showed: a TMA Triton GEMM gets 0.84-0.94 of cuBLAS, 0.67-0.73 with LoRA: kept non-TMA. probe_tma.json
"""Probe: how close does a Hopper TMA GEMM in Triton get to cuBLAS on the Flux shapes, with and without
an in-loop LoRA shrink (r16) and its expand in the epilogue? Decides whether lora_linear moves to TMA.

Variants: persistent (one program per SM, tiles in grouped order) or one tile per program; with or
without tl.range warp specialization; with LoRA in the loop or a plain GEMM. Timing as in
bench_delta.py (CUDA graph replay, L2 flushed, median).

    python benchmarks/probes/probe_tma_gemm.py --out $OUT/results/probe_tma.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_delta import gpu_us  # noqa: E402

SHAPES = [(4608, 3072, 3072), (4608, 3072, 12288), (4608, 12288, 3072)]


@triton.jit
def _pid(tile_id, per_group, num_pid_m, GROUP_M: tl.constexpr):
    first_m = (tile_id // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile_id % per_group) % group_rows, (tile_id % per_group) // group_rows


@triton.jit
def gemm_tma(x_desc, w_desc, y_desc, a_desc, b_desc, M, N, K, programs,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
             LORA: tl.constexpr, RC: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr):
    dtype: tl.constexpr = y_desc.dtype
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    per_group = GROUP_M * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, programs, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = _pid(tile_id, per_group, num_pid_m, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        h = tl.zeros((BM, RC), dtype=tl.float32)
        for ki in range(k_tiles):
            ok = ki * BK
            xt = x_desc.load([om, ok])
            wt = w_desc.load([on, ok])
            acc = tl.dot(xt, wt.T, acc)
            if LORA:
                at = a_desc.load([0, ok])
                h = tl.dot(xt, at.T, h)
        if LORA:
            bt = b_desc.load([on, 0])
            acc = tl.dot(h.to(dtype), bt.T, acc)
        y_desc.store([om, on], acc.to(dtype))


def run_variant(x, W, A, B, y, cfg: dict, sms: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    N = W.shape[0]
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    xd = TensorDescriptor.from_tensor(x, [BM, BK])
    wd = TensorDescriptor.from_tensor(W, [BN, BK])
    yd = TensorDescriptor.from_tensor(y, [BM, BN])
    ad = TensorDescriptor.from_tensor(A, [16, BK])
    bd = TensorDescriptor.from_tensor(B, [BN, 16])
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    programs = min(tiles, sms) if cfg["persistent"] else tiles

    def fn():
        gemm_tma[(programs,)](xd, wd, yd, ad, bd, M, N, K, programs, BM=BM, BN=BN, BK=BK, GROUP_M=8,
                              LORA=cfg["lora"], RC=16, WS=cfg["ws"], FLATTEN=cfg["flatten"],
                              num_warps=cfg["warps"], num_stages=cfg["stages"])
    return fn


TILES = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dt = torch.bfloat16
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    for M, K, N in SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=dt)
        W = (torch.randn(N, K, device="cuda") * K**-0.5).to(dt)
        A = (torch.randn(16, K, device="cuda") * K**-0.5).to(dt)
        B = (torch.randn(N, 16, device="cuda") * 0.25).to(dt)
        ref = (x.float() @ W.float().t() + (x.float() @ A.float().t()).to(dt).float() @ B.float().t())
        flops = 2.0 * M * N * K
        t_cublas = gpu_us(lambda x=x, W=W: torch.mm(x, W.t()))
        print(f"{M}x{K}->{N}: cuBLAS {t_cublas:.1f} us ({flops / t_cublas / 1e6:.0f} TF)", flush=True)
        row = {"M": M, "K": K, "N": N, "cublas_us": t_cublas, "variants": []}
        for BM, BN, BK, warps, stages in TILES:
            for persistent, ws, flatten in ((True, False, True), (True, False, False), (True, True, False),
                                            (False, False, False)):
                for lora in (False, True):
                    cfg = dict(BM=BM, BN=BN, BK=BK, warps=warps, stages=stages, persistent=persistent, ws=ws,
                               flatten=flatten, lora=lora)
                    y = torch.empty(M, N, device="cuda", dtype=dt)
                    try:
                        fn = run_variant(x, W, A, B, y, cfg, sms)
                        fn()
                        torch.cuda.synchronize()
                        want = ref if lora else x.float() @ W.float().t()
                        err = ((y.float() - want).abs().max() / want.abs().max()).item()
                        t = gpu_us(fn)
                    except Exception as e:
                        row["variants"].append({**cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                        print(f"  {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    v = {**cfg, "us": t, "tflops": flops / t / 1e6, "over_cublas": t / t_cublas, "rel_err": err}
                    row["variants"].append(v)
                    print(f"  {BM}x{BN}x{BK} w{warps} s{stages} pers={int(persistent)} ws={int(ws)} "
                          f"flat={int(flatten)} lora={int(lora)}: {t:7.1f} us {v['tflops']:4.0f} TF "
                          f"x{v['over_cublas']:.3f} err {err:.1e}", flush=True)
        res["rows"].append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
