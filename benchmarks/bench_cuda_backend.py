"""The CUDA C++ backend per op against the Triton backend and cuBLAS: max error vs the float64 reference, GPU time,
and host time per call (what issuing one call costs the CPU), at full-size layer shapes.

    python3 benchmarks/bench_cuda_backend.py --out $OUT/cuda_backend.json      (GPU, ~1 min plus the first build)

GPU time: median of CUDA-event-timed calls. Host time: the wall time of issuing 200 calls back to back without a
sync, divided by 200, for a shape whose kernels are shorter than their launch (so the CPU is what is measured);
and the same for one FusedLoraLinear forward without the merged-weight cache (the per-layer host budget of
PERF.md: what nn.Linear costs plus <= 20 us).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fdlora.kernels import ops as ref  # noqa: E402
from fdlora.kernels import registry  # noqa: E402
from fdlora.kernels.ops.lora_merge import lora_merge as ref_merge  # noqa: E402

# name, M, K, N, S, R, live ranks, weights, dtype, mode
SHAPES = [
    ("sdxl-attn 8192x1280->1280 r64x4 blend fp16", 8192, 1280, 1280, 4, 64, [64, 16, 32, 8], [0.5, 0.0, 0.8, 1.0],
     torch.float16, "blend"),
    ("sdxl-ff 8192x1280->10240 r64 blend fp16", 8192, 1280, 10240, 2, 64, [64, 32], [1.0, 0.5], torch.float16,
     "blend"),
    ("sdxl per-prompt 8192x640->640 r16 G2 fp16", 8192, 640, 640, 2, 16, [16, 16], [1.0, 0.7], torch.float16,
     "groups"),
    ("flux 4608x3072->3072 r16x4 blend bf16", 4608, 3072, 3072, 4, 16, [16] * 4, [0.3, 0.3, 0.2, 0.2],
     torch.bfloat16, "blend"),
    ("llama prefill 2048x4096->14336 r16 blend bf16", 2048, 4096, 14336, 2, 16, [16, 16], [1.0, 0.0],
     torch.bfloat16, "blend"),
    ("llama decode 16x4096->4096 r16x8 rows bf16", 16, 4096, 4096, 8, 16, [16] * 8, [1.0] * 8, torch.bfloat16,
     "rows"),
    ("llama decode 32x4096->14336 r16 blend bf16", 32, 4096, 14336, 4, 16, [16] * 4, [1.0, 0.0, 0.0, 0.0],
     torch.bfloat16, "blend"),
]


def gpu_ms(fn, reps: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def host_us(fn, calls: int = 100) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def inputs(M, K, N, S, R, ranks, weights, dtype, mode):
    g = torch.Generator(device="cuda").manual_seed(0)
    A = torch.randn(S, R, K, device="cuda", generator=g) * K**-0.5
    B = torch.randn(N, S, R, device="cuda", generator=g) * R**-0.5
    for s, r in enumerate(ranks):
        A[s, r:], B[:, s, r:] = 0, 0
    x = torch.randn(M, K, device="cuda", generator=g)
    W = torch.randn(N, K, device="cuda", generator=g) * K**-0.5
    d = dict(x=x.to(dtype), A=A.to(dtype), B=B.to(dtype), W=W.to(dtype), y=torch.zeros(M, N, device="cuda",
             dtype=dtype), scale=torch.tensor(weights, device="cuda"),
             ranks=torch.tensor(ranks, dtype=torch.int32, device="cuda"))
    if mode == "rows":
        d["row_slot"] = torch.arange(M, device="cuda", dtype=torch.int32) % (S + 1) - 1
    else:
        G = 2 if mode == "groups" else 1
        d["gw"] = torch.rand(G, S, device="cuda", generator=g) if G > 1 else torch.ones(1, S, device="cuda")
    return d


def calls(ops, d, mode):
    """name -> zero-argument call of this backend's op on d (y written in place)."""
    out = {}
    if mode == "rows":
        out["lora_delta_rows"] = lambda: ops.lora_delta_rows(d["y"], d["x"], d["A"], d["B"], d["scale"], d["row_slot"],
                                                             d["ranks"])
        return out
    out["lora_delta"] = lambda: ops.lora_delta(d["y"], d["x"], d["A"], d["B"], d["scale"], d["gw"], d["ranks"])
    out["lora_linear"] = lambda: ops.lora_linear(d["x"], d["W"], None, d["A"], d["B"], d["scale"], d["gw"],
                                                 d["ranks"])
    out["lora_shrink"] = lambda: ops.lora_shrink(d["x"], d["A"])
    wm = torch.empty_like(d["W"])
    out["lora_merge"] = lambda: ops.lora_merge(wm, d["W"], d["A"], d["B"], d["scale"], d["ranks"])
    return out


def reference(d, mode, name):
    x, A, B, y = d["x"].double(), d["A"].double(), d["B"].double(), d["y"].double().zero_()
    if name == "lora_delta_rows":
        ref.lora_delta_rows(y, x, A, B, d["scale"].double(), d["row_slot"], d["ranks"])
        return y
    if name == "lora_delta":
        ref.lora_delta(y, x, A, B, d["scale"].double(), d["gw"].double(), d["ranks"])
        return y
    if name == "lora_linear":
        y = x @ d["W"].double().t()
        ref.lora_delta(y, x, A, B, d["scale"].double(), d["gw"].double(), d["ranks"])
        return y
    if name == "lora_shrink":
        return ref.lora_shrink(x, A)
    return ref_merge(torch.empty_like(d["W"], dtype=torch.float64), d["W"].double(), A, B, d["scale"].double(),
                     d["ranks"])


def cublas(d, name):
    """The cuBLAS work an op stands beside: the base GEMM for lora_linear, one GEMM of the op's shape otherwise."""
    x, W, A = d["x"], d["W"], d["A"]
    if name == "lora_linear":
        return lambda: F.linear(x, W)
    if name == "lora_shrink":
        return lambda: x @ A.reshape(-1, A.shape[-1]).t()
    if name == "lora_merge":
        return lambda: torch.addmm(W, d["B"].reshape(W.shape[0], -1), A.reshape(-1, W.shape[1]))
    return lambda: torch.addmm(d["y"], x @ A.reshape(-1, A.shape[-1]).t(), d["B"].reshape(W.shape[0], -1).t())


def layer_host_us(backend: str) -> float:
    """Host us per FusedLoraLinear forward, eager blend, merged-weight cache off, tiny shape (launch-bound)."""
    import fdlora
    from fdlora import LoraAdapter, ModuleLora

    with fdlora.use_backend(backend):
        lin = torch.nn.Sequential(torch.nn.Linear(256, 256)).cuda().half()
        fdlora.inject(lin, ["0"], max_slots=4, max_rank=16)
        fdlora.add_adapter(lin, LoraAdapter({"0": ModuleLora(torch.randn(16, 256) * 0.1, torch.randn(256, 16) * 0.1,
                                                             alpha=16.0)}, name="a").to(device="cuda",
                                                                                       dtype=torch.float16))
        fdlora.set_adapters(lin, ["a"], [0.7])
        previous = fdlora.merge_cache_bytes() if hasattr(fdlora, "merge_cache_bytes") else None
        fdlora.set_merge_cache(0)
        x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
        try:
            with torch.no_grad():
                return host_us(lambda: lin(x))
        finally:
            fdlora.set_merge_cache("auto")
            del previous


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON file; with --shapes, its rows for other shapes are kept")
    ap.add_argument("--shapes", help="comma-separated label prefixes to measure (default: all); skips the host table")
    args = ap.parse_args()
    only = tuple(args.shapes.split(",")) if args.shapes else None
    kept = json.loads(args.out.read_text()) if only and args.out and args.out.exists() else {}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cuda_ops, triton_ops = registry.ops("cuda"), registry.ops("triton")
    print(f"library ready in {time.time() - t0:.1f} s", flush=True)
    layer = kept.get("layer_host_us", {})
    rows = [r for r in kept.get("ops", []) if not r["shape"].startswith(only or ())]
    if only is None:
        layer = host_table(cuda_ops)
    for (label, M, K, N, S, R, ranks, weights, dtype, mode) in SHAPES:
        if only is not None and not label.startswith(only):
            continue
        measure_shape(cuda_ops, triton_ops, label, M, K, N, S, R, ranks, weights, dtype, mode, rows, layer, args.out)
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                  ops=rows, layer_host_us=layer)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


def host_table(cuda_ops) -> dict:
    """Host us per layer call: the fused layer on each backend, nn.Linear / F.linear, the bound and unbound op."""
    layer = {b: layer_host_us(b) for b in ("cuda", "triton", "torch")}
    linear = torch.nn.Linear(256, 256).cuda().half()
    xs = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    t = inputs(64, 256, 256, 4, 16, [16, 0, 0, 0], [0.7, 0, 0, 0], torch.float16, "blend")
    bound = cuda_ops.prepare_linear(t["x"], t["W"], None, t["A"], t["B"], t["scale"], t["ranks"], 0)
    with torch.no_grad():
        layer["nn.Linear"] = host_us(lambda: linear(xs))
        layer["F.linear"] = host_us(lambda: F.linear(xs, linear.weight))
        layer["cuda op, bound (prepare_linear)"] = host_us(lambda: bound(t["x"]))
        layer["cuda op, through torch.ops"] = host_us(lambda: torch.ops.fdlora_cuda.lora_linear(
            t["x"], t["W"], None, t["A"], t["B"], t["scale"], t["gw"], t["ranks"]))
    print("host us per layer call (eager blend, no merge cache):", {k: round(v, 1) for k, v in layer.items()},
          flush=True)
    return layer


def measure_shape(cuda_ops, triton_ops, label, M, K, N, S, R, ranks, weights, dtype, mode, rows, layer, out) -> None:
    d = inputs(M, K, N, S, R, ranks, weights, dtype, mode)
    tiny = inputs(min(M, 16), 256, 256, S, R, ranks, weights, dtype, mode)
    for name, call in calls(cuda_ops, d, mode).items():
        if out:  # what was measured so far survives a time limit
            out.write_text(json.dumps(dict(ops=rows, layer_host_us=layer), indent=1))
        expected = reference(d, mode, name)
        d["y"].zero_()
        got = call()
        got = d["y"] if got is None else got
        scale = expected.abs().max().item() or 1.0
        err = (got.double() - expected).abs().max().item() / scale
        trit = calls(triton_ops, d, mode)[name]
        d["y"].zero_()
        t_got = trit()
        t_got = d["y"] if t_got is None else t_got
        t_err = (t_got.double() - expected).abs().max().item() / scale
        row = dict(shape=label, op=name, rel_err_cuda=err, rel_err_triton=t_err, ms_cuda=gpu_ms(call),
                   ms_triton=gpu_ms(trit), ms_cublas=gpu_ms(cublas(d, name)),
                   host_us_cuda=host_us(calls(cuda_ops, tiny, mode)[name]),
                   host_us_triton=host_us(calls(triton_ops, tiny, mode)[name]))
        rows.append(row)
        print(f"{label:48s} {name:16s} err {err:.1e}/{t_err:.1e}  ms cuda {row['ms_cuda']:.3f} triton "
              f"{row['ms_triton']:.3f} cublas {row['ms_cublas']:.3f}  host us {row['host_us_cuda']:.1f} / "
              f"{row['host_us_triton']:.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
