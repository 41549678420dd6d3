# Measures: a two-stream chunked merge+GEMM per call vs merge + cuBLAS on the same shape.
# Showed: a two-stream chunked merge+GEMM does not beat merge + cuBLAS (not adopted). probe_pipe_merge.json
"""Probe: merge-on-the-fly pipelined with the GEMM, per call, against cuBLAS on the same shape.

The "merged" path writes W' = W + s B A (one pass over W's bytes, ~0.16 of a Flux 3072^2 GEMM) and then runs the
GEMM. Here W's output rows are split into c chunks: a side stream merges chunk j+1 while the GEMM of chunk j runs
on the main stream (into y[:, chunk], no copy), so only the first chunk's merge is exposed. Whether the rest hides
depends on the SMs a GEMM chunk leaves free (wave quantization) and on the block scheduler; variants: GEMM stream
priority, and cuBLAS's SM count target (cublasSetSmCountTarget on torch's handle) leaving SMs to the merge.
No bias (torch's cuBLASLt bias epilogue needs a contiguous output). Checked against a float64 oracle first.

    python benchmarks/probes/probe_pipe_merge.py --out results.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fused import ROTATE, SHAPES, graph_us, inputs, oracle_rows  # noqa: E402

from fdlora.kernels.triton.merge.lora_merge import launch_merge  # noqa: E402

_CUBLAS = None


def sm_target(n: int) -> None:
    """cublasSetSmCountTarget on torch's current handle (0 = cuBLAS's default)."""
    global _CUBLAS
    if _CUBLAS is None:
        for name in ("libcublas.so.13", "libcublas.so.12"):
            try:
                _CUBLAS = ctypes.CDLL(name)
                break
            except OSError:
                pass
    st = _CUBLAS.cublasSetSmCountTarget(ctypes.c_void_p(torch.cuda.current_blas_handle()), ctypes.c_int(n))
    assert st == 0, st


def bounds(N: int, c: int, align: int = 128) -> list[tuple[int, int]]:
    step = -(-N // c // align) * align
    return [(a, min(N, a + step)) for a in range(0, N, step)]


class Pipe:
    def __init__(self, N: int, K: int, c: int, hi: bool, target: int, device="cuda", dtype=torch.bfloat16):
        self.chunks = bounds(N, c)
        self.buf = torch.empty(N, K, device=device, dtype=dtype)
        self.side = torch.cuda.Stream()
        lo, hi_p = torch.cuda.Stream.priority_range()
        self.main = torch.cuda.Stream(priority=hi_p) if hi else None
        self.target = target

    def __call__(self, d: dict, y: torch.Tensor) -> torch.Tensor:
        x, W, A, B = d["x"], d["W"], d["A"], d["B"]
        cur = torch.cuda.current_stream()
        main = self.main or cur
        self.side.wait_stream(cur)
        main.wait_stream(cur)
        evs = []
        with torch.cuda.stream(self.side):
            for a, b in self.chunks:
                launch_merge(W[a:b], A, B[a:b], d["scale"], d["group_weight"], d["ranks"], out=self.buf[a:b][None])
                e = torch.cuda.Event()
                e.record(self.side)
                evs.append(e)
        with torch.cuda.stream(main):
            if self.target:
                sm_target(self.target)
            for (a, b), e in zip(self.chunks, evs):
                main.wait_event(e)
                torch.mm(x, self.buf[a:b].t(), out=y[:, a:b])
            if self.target:
                sm_target(0)
        cur.wait_stream(main)
        cur.wait_stream(self.side)
        return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--chunks", default="2,3,4,6,8")
    ap.add_argument("--targets", default="0,16,24,32")
    ap.add_argument("--shapes", default="")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_out, checks = [], []
    for model, M, K, N in SHAPES:
        if args.shapes and f"{model}_{K}_{N}" not in args.shapes.split(","):
            continue
        sets = [inputs(M, K, N, "r16", seed=i) for i in range(ROTATE)]
        for d in sets:
            d["bias"] = None
        ys = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in sets]
        orows, ref = oracle_rows(dict(sets[0], bias=torch.zeros(N, device="cuda")))
        _, ref_base = oracle_rows(dict(sets[0], bias=torch.zeros(N, device="cuda"), scale=sets[0]["scale"] * 0))
        variants = {
            "cublas": lambda d, y: torch.mm(d["x"], d["W"].t(), out=y),
            "merged": lambda d, y: torch.mm(d["x"], launch_merge(d["W"], d["A"], d["B"], d["scale"],
                                                                 d["group_weight"], d["ranks"])[0].t(), out=y),
        }
        for c in map(int, args.chunks.split(",")):
            variants[f"gemm_chunks{c}"] = (lambda cb: lambda d, y: [torch.mm(d["x"], d["W"][a:b].t(), out=y[:, a:b])
                                                                   for a, b in cb])(bounds(N, c))
            for hi in (False, True):
                for t in map(int, args.targets.split(",")):
                    if t and not hi:
                        continue
                    name = f"pipe{c}" + ("_hi" if hi else "") + (f"_sm{sms - t}" if t else "")
                    variants[name] = Pipe(N, K, c, hi, sms - t if t else 0)
        row = {"shape": f"{model}_{K}_{N}", "M": M, "K": K, "N": N, "us": {}, "err": {}}
        for name, fn in variants.items():
            y = ys[0].fill_(float("nan"))
            fn(sets[0], y)
            torch.cuda.synchronize()
            got = y[orows.cuda()].double().cpu()
            want = ref_base if name == "cublas" or name.startswith("gemm_chunks") else ref  # those have no LoRA
            err = (got - want).abs().max().item() / want.abs().max().item()
            row["err"][name] = err
            ok = err < 2e-2 and not got.isnan().any().item()
            checks.append((row["shape"], name, ok))
            if not ok:
                print("CHECK FAILED", row["shape"], name, err, flush=True)
                continue
            row["us"][name] = graph_us([partial(fn, d, y) for d, y in zip(sets, ys)])
        base = row["us"]["cublas"]
        row["over_cublas"] = {k: v / base for k, v in row["us"].items()}
        best = min((v, k) for k, v in row["over_cublas"].items() if k.startswith("pipe"))
        print(f"{row['shape']:18s} cublas {base:7.1f}us merged {row['over_cublas']['merged']:.3f} "
              f"best pipe {best[1]} {best[0]:.3f} | " + " ".join(
                  f"{k}={v:.3f}" for k, v in row["over_cublas"].items() if k not in ("cublas",)), flush=True)
        rows_out.append(row)
        del sets, ys, variants
        torch.cuda.empty_cache()
    out = {"benchmark": "probe_pipe_merge", "gpu": torch.cuda.get_device_name(0), "sms": sms,
           "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M"),
           "all_verified": all(ok for *_, ok in checks), "rows": rows_out}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
