# Measures: lora_merge_many on a full-size Flux-dev table against copy bandwidth (tiles, forms).
# Asks: how close to copy bandwidth is lora_merge_many on a full-size Flux-dev table (a slider move); do strips, a
# per-program layer table, the W add after the dot, or cuBLAS per layer get closer? Run 1 (session 21): strips and
# the table lookup lose; shipped 1.29x copy (1 slot active), 1.56x (4). Run 2: best bit-equal BN64 BK256 1.25x / 1.64x,
# add-after 1.18x / 1.83x (one rounding apart), cuBLAS addmm per layer 2.9x: no candidate is near the copy.
"""Sweep of the whole-model re-merge (fdlora.kernels.triton.merge.lora_merge_many) on Flux-dev's 418 targeted weights.

Every W of the table is a view into one flat buffer, every W' into another, so `copy_ms` (one flat copy of the
same bytes) is the floor for any kernel that reads W and writes W'. The shipped kernel runs against candidates of
`strip_kernel` below; each candidate's W' must equal the shipped one bit for bit. Timed with CUDA events, median
of 7, bf16; banks S=4 slots of rank 16 with one slot active (a slider on one adapter of four loaded) and all four.

    python benchmarks/probes/sweep_merge_many.py --out $OUT/sweep_merge_many.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fdlora.kernels.triton import config as C  # noqa: E402
from fdlora.kernels.triton.merge.lora_merge_many import MergeTable  # noqa: E402
from fdlora.kernels.triton.tiles import mma  # noqa: E402

D, F, P = 3072, 12288, 15360  # Flux-dev: hidden, MLP, single-block proj_out input
SHAPES = [(D, D)] * 8 * 19 + [(F, D), (D, F)] * 2 * 19 + [(D, D)] * 3 * 38 + [(F, D), (D, P)] * 38  # (N, K)


@triton.jit
def strip_kernel(prog_ptr, addr_ptr, dims_ptr, first_ptr, S: tl.constexpr, R: tl.constexpr, DTYPE: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, KT: tl.constexpr, ADD_AFTER: tl.constexpr = False):
    p = tl.program_id(0)
    lo = tl.load(prog_ptr + p)
    row = addr_ptr + lo.to(tl.int64) * 5
    out = tl.load(row).to(tl.pointer_type(DTYPE))
    w = tl.load(row + 1).to(tl.pointer_type(DTYPE))
    a = tl.load(row + 2).to(tl.pointer_type(DTYPE))
    b = tl.load(row + 3).to(tl.pointer_type(DTYPE))
    scale = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    d = dims_ptr + lo.to(tl.int64) * 6
    N, K = tl.load(d), tl.multiple_of(tl.load(d + 1), 16)
    swn, son = tl.multiple_of(tl.load(d + 2), 16), tl.multiple_of(tl.load(d + 4), 16)
    u = p - tl.load(first_ptr + lo)
    n_k = tl.cdiv(K, BK * KT)
    nn = (u // n_k) * BN + tl.arange(0, BN)
    n_in = nn < N
    nn = nn.to(tl.int64)
    k0 = (u % n_k) * (BK * KT)
    rr = tl.arange(0, 16)
    for kt in range(KT):
        kk = k0 + kt * BK + tl.arange(0, BK)
        k_in = kk < K
        inside = n_in[:, None] & k_in[None, :]
        wp = tl.max_contiguous(tl.multiple_of(w + nn[:, None] * swn + kk[None, :], [16, 16]), [1, BK])
        op = tl.max_contiguous(tl.multiple_of(out + nn[:, None] * son + kk[None, :], [16, 16]), [1, BK])
        w_t = tl.load(wp, mask=inside, other=0.0)
        acc = tl.zeros((BN, BK), tl.float32) if ADD_AFTER else w_t.to(tl.float32)
        for c in tl.static_range(0, S * R, 16):
            sc = tl.load(scale + c // R)
            if sc != 0.0:
                bt = tl.load(b + nn[:, None] * (S * R) + (c + rr)[None, :], mask=n_in[:, None], other=0.0)
                at = tl.load(a + (c + rr)[:, None] * K + kk[None, :], mask=k_in[None, :], other=0.0)
                acc = mma((bt.to(tl.float32) * sc).to(DTYPE), at, acc, False, False)
        if ADD_AFTER:  # the dot's layout converted once (the sum), not twice (W in, W' out)
            acc = w_t.to(tl.float32) + acc
        tl.store(op, acc.to(DTYPE), mask=inside)


def strip_tables(entries, BN, BK, KT, dev):
    addr, dims, first, prog = [], [], [0], []
    for i, (out, W, A, B, scale) in enumerate(entries):
        N, K = W.shape
        addr.append((out.data_ptr(), W.data_ptr(), A.data_ptr(), B.data_ptr(), scale.data_ptr()))
        dims.append((N, K, *W.stride(), *out.stride()))
        n = C.cdiv(N, BN) * C.cdiv(K, BK * KT)
        first.append(first[-1] + n)
        prog.extend([i] * n)
    t = lambda v, dt: torch.tensor(v, dtype=dt, device=dev)  # noqa: E731
    return t(prog, torch.int32), t(addr, torch.int64), t(dims, torch.int64), t(first, torch.int32), len(prog)


CANDIDATES = [(bn, bk, 1, w, 1, after) for bn, bk in ((64, 128), (64, 256), (128, 128), (32, 128)) for w in (4, 8)
              for after in (False, True)] + [(64, 128, 2, 4, 2, True)]


def addmm_all(entries, active):
    """W' = W + 0.7 B A per layer by cuBLAS (the probe's scales are all 0.7): the rounding differs from the kernel's
    (alpha applied to the fp32 product), so this row is timed, not compared bit for bit."""
    for out, W, A, B, _ in entries:
        n, s, r = B.shape
        torch.addmm(W, B[:, :active].reshape(n, active * r), A[:active].reshape(active * r, -1), alpha=0.7, out=out)


def candidate(row, name, go, flat_o, want, copy_ms):
    try:
        flat_o.zero_()
        t0 = time.perf_counter()
        go()
        torch.cuda.synchronize()
        same = bool(torch.equal(flat_o, want))
        close = 0.0 if same else max(float((o.float() - w.float()).abs().max())  # in chunks: 17 GB each side
                                     for o, w in zip(flat_o.split(1 << 28), want.split(1 << 28)))
        ms = event_ms(go)
    except Exception as exc:  # noqa: BLE001 (a candidate that does not compile is a row)
        print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return
    row["candidates"][name] = {"ms": ms, "x_copy": ms / copy_ms, "bit_equal": same, "max_abs_diff": close,
                               "first_call_s": time.perf_counter() - t0}
    print(f"  {name}: {ms:.2f} ms ({ms / copy_ms:.2f}x copy) equal={same} diff={close:.2e}", flush=True)


def event_ms(fn, reps=7):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dt, S, R = torch.device("cuda"), torch.bfloat16, 4, 16
    total = sum(n * k for n, k in SHAPES)
    flat_w = torch.empty(total, dtype=dt, device=dev).normal_()
    flat_o = torch.empty_like(flat_w)
    g = torch.Generator(device=dev).manual_seed(0)
    entries, off = [], 0
    for n, k in SHAPES:
        W, O = flat_w[off:off + n * k].view(n, k), flat_o[off:off + n * k].view(n, k)
        off += n * k
        A = (torch.randn(S, R, k, device=dev, generator=g) / k**0.5).to(dt)
        B = (torch.randn(n, S, R, device=dev, generator=g) / R**0.5).to(dt)
        entries.append((O, W, A, B, torch.zeros(S, device=dev)))
    gb = 2 * total * 2 / 1e9
    copy_ms = event_ms(lambda: flat_o.copy_(flat_w))
    print(f"{len(SHAPES)} layers, {total / 1e9:.2f} G elements; copy {copy_ms:.2f} ms = {gb / copy_ms:.2f} TB/s",
          flush=True)
    rows = []
    for active in (1, 4):
        for e in entries:
            e[4].zero_()
            e[4][:active] = 0.7
        table = MergeTable()
        shipped_ms = event_ms(functools.partial(table.launch, entries))
        want = flat_o.clone()
        print(f"active {active}: shipped {shipped_ms:.2f} ms ({shipped_ms / copy_ms:.2f}x copy)", flush=True)
        row = {"active": active, "copy_ms": copy_ms, "shipped_ms": shipped_ms, "candidates": {}}
        for BN, BK, KT, warps, stages, after in CANDIDATES:
            name = f"BN{BN} BK{BK} KT{KT} w{warps} s{stages}" + (" add-after" if after else "")
            prog, addr, dims, first, n = strip_tables(entries, BN, BK, KT, dev)
            go = functools.partial(strip_kernel[(n,)], prog, addr, dims, first, S=S, R=R, DTYPE=tl.bfloat16, BN=BN,
                                   BK=BK, KT=KT, ADD_AFTER=after, num_warps=warps, num_stages=stages)
            candidate(row, name, go, flat_o, want, copy_ms)
        candidate(row, "cuBLAS addmm per layer (alpha, one slot)" if active == 1 else "cuBLAS addmm per layer (all)",
                  functools.partial(addmm_all, entries, active), flat_o, want, copy_ms)
        rows.append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"probe": "sweep_merge_many", "gpu": torch.cuda.get_device_name(),
                                          "torch": torch.__version__, "triton": triton.__version__,
                                          "layers": len(SHAPES), "elements": total, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
