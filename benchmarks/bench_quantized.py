"""LoRA over quantized bases (issue 27): one full-size Flux-dev transformer step, quantized base alone vs the same
base with fd-lora (1 adapter, a 4-blend), for torchao int8 / int4 / float8 weight-only and GGUF Q8_0.

Per kind: the transformer is built in bf16 on the GPU (random weights, the real config), four r16 LoRAs on every
Linear of its blocks are written with FluxPipeline.save_lora_weights (before quantizing), then the transformer is
quantized in place (torchao `quantize_`; GGUF: every Linear whose rows fit Q8_0 blocks becomes diffusers' GGUFLinear,
its bytes made on the GPU by `q8_0`, which equals gguf.quants.quantize bit for bit, checked in --smoke) and the
adapters load with `load_fd_lora`. Each fd-lora step is verified first against an oracle that needs no LoRA
library: forward hooks adding sum_i w_i (x A_i^T) B_i^T in fp32 to each quantized Linear's own output (rel err within
the dtype's tolerance and below half the LoRA's effect), and the merged-weight cache must hold nothing (no
dequantized copy). Then timed: medians of CUDA-event-timed steps; x_base is the ratio to the same quantized base.
Rows say which path the layers' blend calls took, as `merge_path` / `merge_paths` (fdlora.layers.quant.dequant; GGUF rows
also as `gguf_path` / `gguf_paths`): "fused-dequant-merge" is the Triton kernel that writes the dequantized weight
with the LoRA merged in (GGUF Q8_0: gguf_merge; torchao int8 / float8 per row or per tensor: dequant_merge);
"torch-dequant-merge" the base's own dequantization + addmm_; "base+delta" the per-call delta; "none" a layer whose
base no route applies to (torchao int4).

With GGUF Q8_0 on CUDA, "gguf_kernel" rows time that kernel alone on Flux's Linear shapes (bf16, r16, GPU time of
CUDA-graph replays):
diffusers' `dequantize_gguf_tensor(w).to(bf16)` (what GGUFLinear does per call), the kernel without the LoRA
(LORA=False: the dequantization alone) and with one r16 adapter / a 4-blend, so the LoRA's own cost on top of
dequantizing is told apart from the kernel's speed-up of the dequantization itself. Each is verified first: without
the LoRA the kernel equals diffusers' weight bit for bit, with it the fp32 sum within bf16's rounding.
With torchao int8 / float8 on CUDA, "torchao_kernel" rows do the same for dequant_merge over torchao's own per-row
weights: against torchao's per-call weight conversion (int8: `qdata.t().to(bf16)`, what its weight-only linear does
before the mm, without its scale and bias passes over y, which depend on M; float8: `dequantize()`), the kernel
without the LoRA (equal to torchao's `dequantize(bf16)` bit for bit) and with r16 / a 4-blend.

    python3 benchmarks/bench_quantized.py --out $OUT/breadth.json        # GPU; rows go under "quantized"
    python3 benchmarks/bench_quantized.py --smoke                        # tiny Flux on CPU (int8, float8, Q8_0)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fdlora  # noqa: E402
from benchmarks.bench_breadth import BLEND, NAMES, TOL, build, lora_dirs, step, timed  # noqa: E402
from fdlora.layers.modules.fused import _FusedLora  # noqa: E402
from fdlora.layers.quant import quantized  # noqa: E402

KINDS = ("torchao-int8", "torchao-int4", "torchao-float8", "gguf-Q8_0")
TARGET = 1.10  # fd-lora 1 adapter vs the same quantized base
# (K in, N out) of Flux-dev's Linears: attention projections, ff up, ff down, single blocks' proj_out
FLUX_SHAPES = ((3072, 3072), (3072, 12288), (12288, 3072), (15360, 3072))


def q8_0(w: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 bytes of `w` [N, K] (K % 32 == 0) on w's device: per block of 32, an fp16 scale then 32 int8, the
    rounding of ggml-quants.c (half away from zero), as gguf.quants.quantize writes them."""
    blocks = w.float().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    n = blocks * inv
    a = n.abs()
    qs = (torch.sign(n) * (a.floor() + (2 * (a - a.floor())).floor())).to(torch.int8)
    out = torch.cat([d.to(torch.float16).view(torch.uint8), qs.view(torch.uint8)], dim=1)
    return out.reshape(w.shape[0], -1)


def gguf_q8_0(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Every Linear whose rows fit Q8_0 blocks becomes diffusers' GGUFLinear over q8_0 bytes (what from_single_file
    with GGUFQuantizationConfig builds from a Q8_0 .gguf file)."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter, _replace_with_gguf_linear

    qt = gguf.GGMLQuantizationType.Q8_0
    floats = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.in_features % 32 == 0}
    sd = {n + ".weight": GGUFParameter(q8_0(m.weight.detach()), quant_type=qt) for n, m in floats.items()}
    bias = {n: m.bias for n, m in floats.items()}
    with torch.device("meta"):
        _replace_with_gguf_linear(model, compute_dtype, sd)
    for n in floats:
        m = model.get_submodule(n)
        m.weight = sd[n + ".weight"]
        m.bias = None if bias[n] is None else nn.Parameter(bias[n].detach(), requires_grad=False)


def quantize(model: nn.Module, kind: str, dt: torch.dtype) -> None:
    lib, _, what = kind.partition("-")
    if lib == "gguf":
        return gguf_q8_0(model, dt)
    from torchao.quantization import Float8WeightOnlyConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    config = {"int8": Int8WeightOnlyConfig, "float8": Float8WeightOnlyConfig,
              "int4": lambda: Int4WeightOnlyConfig(group_size=128)}[what]()
    quantize_(model, config)


def merge_paths(model: nn.Module) -> dict[str, int]:
    """Path of each quantized LoRA layer's last blend call (fdlora.layers.quant.dequant) -> how many layers took it."""
    return dict(Counter(m.__dict__.get("merge_path") or "none" for m in model.modules() if isinstance(m, _FusedLora)
                        and quantized.kind(m.base) and any(m.bank.used)))


def gguf_paths(model: nn.Module) -> dict[str, int]:
    """Path of each GGUF LoRA layer's last blend call (fdlora.layers.quant.gguf) -> how many layers took it."""
    return dict(Counter(m.__dict__.get("gguf_path") or "none" for m in model.modules() if isinstance(m, _FusedLora)
                        and (quantized.kind(m.base) or "").startswith("gguf ") and any(m.bank.used)))


def one_path(paths: dict[str, int]) -> str:
    return next(iter(paths)) if len(paths) == 1 else "mixed"


def kernel_us(fn, reps: int = 20, rounds: int = 7) -> float:
    """GPU time of one call of `fn` in us: `reps` calls captured in a CUDA graph, the median over `rounds` replays
    (eager launches of the smaller shapes are host-bound: ~35 us of host time per launch on the H100 host)."""
    from fdlora.kernels.eager import graphed, warm_up

    warm_up(fn)
    graph, _ = graphed(lambda: [fn() for _ in range(reps)])
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def gguf_kernel_row(K: int, N: int, rank: int) -> dict:
    """The fused dequant + merge kernel against diffusers' dequantization on one [N, K] Q8_0 weight (bf16; the module
    docstring says what each time is), verified first."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    from fdlora.kernels.triton.merge import gguf_merge

    dev, dt, S = torch.device("cuda"), torch.bfloat16, len(BLEND)
    g = torch.Generator(dev).manual_seed(K + N)
    Wq = q8_0(torch.randn(N, K, generator=g, device=dev, dtype=dt) * 0.02)
    P = GGUFParameter(Wq, quant_type=gguf.GGMLQuantizationType.Q8_0)
    A = torch.randn(S, rank, K, generator=g, device=dev, dtype=dt) / K ** .5
    B = torch.randn(N, S, rank, generator=g, device=dev, dtype=dt) * 0.1
    ranks = torch.full((S,), rank, dtype=torch.int32, device=dev)
    ones = torch.ones(1, S, device=dev)
    one = torch.tensor([1.0] + [0.0] * (S - 1), device=dev)  # 1 adapter active of the 4 loaded (the step's case)
    blend = torch.tensor(BLEND, device=dev)
    out = torch.empty(N, K, device=dev, dtype=dt)

    def merge(scale, lora=True):
        return gguf_merge.gguf_q8_0_merge(Wq, A, B, scale, ones, ranks, dt, out=out, lora=lora)

    base = dequantize_gguf_tensor(P).to(dt)
    exact = torch.equal(merge(one, lora=False), base)
    want = base.float() + (B.float() * blend[None, :, None]).reshape(N, -1) @ A.float().reshape(-1, K)
    err = float((merge(blend).float() - want).abs().max() / want.abs().max())
    t = {"diffusers_dequant": kernel_us(lambda: dequantize_gguf_tensor(P).to(dt)),
         "kernel_nolora": kernel_us(lambda: merge(one, lora=False)),
         "kernel_r16": kernel_us(lambda: merge(one)), "kernel_blend4": kernel_us(lambda: merge(blend))}
    moved = N * K * (gguf_merge.QBYTES / gguf_merge.QK + 2)  # read the blocks, write W' (bf16)
    return dict(K=K, N=N, rank=rank, **{f"{k}_us": v for k, v in t.items()},
                lora_r16_us=t["kernel_r16"] - t["kernel_nolora"],
                lora_r16_pct=100 * (t["kernel_r16"] / t["kernel_nolora"] - 1),
                lora_blend4_us=t["kernel_blend4"] - t["kernel_nolora"],
                dequant_speedup=t["diffusers_dequant"] / t["kernel_nolora"],
                nolora_gbps=moved / t["kernel_nolora"] / 1e3, nolora_equals_diffusers=exact, rel_err_blend4=err,
                ok=exact and err < TOL[dt] / 10)


def torchao_kernel_row(what: str, K: int, N: int, rank: int) -> dict:
    """dequant_merge against torchao's own per-call weight conversion on one [N, K] weight quantized by torchao's
    quantize_ (per row, bf16; the module docstring says what each time is), verified first."""
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    from fdlora.kernels.triton.merge import dequant_merge

    dev, dt, S = torch.device("cuda"), torch.bfloat16, len(BLEND)
    g = torch.Generator(dev).manual_seed(K + N)
    lin = nn.Linear(K, N, bias=False, device=dev, dtype=dt)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g, device=dev, dtype=dt) * 0.02)
    quantize_(lin, {"int8": Int8WeightOnlyConfig, "float8": Float8WeightOnlyConfig}[what]())
    w = lin.weight
    q, qs = w.qdata, w.scale
    A = torch.randn(S, rank, K, generator=g, device=dev, dtype=dt) / K ** .5
    B = torch.randn(N, S, rank, generator=g, device=dev, dtype=dt) * 0.1
    ranks = torch.full((S,), rank, dtype=torch.int32, device=dev)
    ones = torch.ones(1, S, device=dev)
    one = torch.tensor([1.0] + [0.0] * (S - 1), device=dev)  # 1 adapter active of the 4 loaded (the step's case)
    blend = torch.tensor(BLEND, device=dev)
    out = torch.empty(N, K, device=dev, dtype=dt)

    def merge(scale, lora=True):
        return dequant_merge.dequant_merge(q, qs, A, B, scale, ones, ranks, dt, out=out, lora=lora)

    base = w.dequantize(dt)
    exact = torch.equal(merge(one, lora=False), base)
    want = base.float() + (B.float() * blend[None, :, None]).reshape(N, -1) @ A.float().reshape(-1, K)
    err = float((merge(blend).float() - want).abs().max() / want.abs().max())
    convert = (lambda: q.t().to(dt)) if what == "int8" else (lambda: w.dequantize())
    t = {"torchao_convert": kernel_us(convert), "kernel_nolora": kernel_us(lambda: merge(one, lora=False)),
         "kernel_r16": kernel_us(lambda: merge(one)), "kernel_blend4": kernel_us(lambda: merge(blend))}
    moved = N * K * (q.element_size() + 2)  # read the values, write W' (bf16)
    return dict(quant=what, K=K, N=N, rank=rank, **{f"{k}_us": v for k, v in t.items()},
                lora_r16_us=t["kernel_r16"] - t["kernel_nolora"],
                lora_r16_pct=100 * (t["kernel_r16"] / t["kernel_nolora"] - 1),
                lora_blend4_us=t["kernel_blend4"] - t["kernel_nolora"],
                convert_speedup=t["torchao_convert"] / t["kernel_nolora"],
                nolora_gbps=moved / t["kernel_nolora"] / 1e3, nolora_equals_torchao=exact, rel_err_blend4=err,
                ok=exact and err < TOL[dt] / 10)


def oracle_hooks(model: nn.Module, dirs: list[str], weights: list[float]) -> list:
    """Forward hooks adding each adapter's fp32 delta (scale 1: no alpha in the files, so alpha = r) to its Linear."""
    mods = dict(model.named_modules())
    hooks, per_path = [], {}
    for d, w in zip(dirs, weights):
        sd = load_file(str(Path(d) / "pytorch_lora_weights.safetensors"))
        for k, A in sd.items():
            if k.endswith("lora_A.weight"):
                path = k[len("transformer."):-len(".lora_A.weight")]
                per_path.setdefault(path, []).append((A.float(), sd[k.replace("lora_A", "lora_B")].float(), w))
    for path, terms in per_path.items():
        dev = next(t for t in mods[path].parameters()).device
        terms = [(A.to(dev), B.to(dev), w) for A, B, w in terms]

        def hook(m, args, out, terms=terms):
            x = args[0].float()
            return (out.float() + sum(w * (x @ A.t()) @ B.t() for A, B, w in terms)).to(out.dtype)
        hooks.append(mods[path].register_forward_hook(hook))
    return hooks


def bench_kind(kind: str, a) -> tuple[list[dict], list[str]]:
    dev = torch.device("cpu" if a.smoke else "cuda")
    dt = torch.float32 if a.smoke else torch.bfloat16
    pipe, inputs = build("flux", a.smoke, dev, dt)
    x = inputs(1)
    dirs = lora_dirs(pipe, a.rank)
    tr = pipe.transformer
    try:
        quantize(tr, kind, dt)
        base_y = step(tr, x)
    except Exception as e:  # a kind this machine's torchao cannot run: the row says why
        return [dict(kind=kind, case="base", error=f"{type(e).__name__}: {str(e)[:300]}")], []
    n_quant = sum(quantized.kind(m) is not None for m in tr.modules() if isinstance(m, nn.Linear))
    base_ms = timed(lambda: step(tr, x), dev, a.rounds)
    rows = [dict(kind=kind, case="base", ms=base_ms, x_base=1.0, quantized_linears=n_quant)]
    bad = []
    for name, d in zip(NAMES, dirs):
        pipe.load_fd_lora(d, adapter_name=name, max_rank=a.rank)
    for case, k, w in (("fdlora_1", 1, [1.0]), ("fdlora_blend4", 4, BLEND)):
        fdlora.set_adapters(tr, NAMES[:k], w)
        y = step(tr, x)
        paths = merge_paths(tr)
        gpaths = gguf_paths(tr) if kind.startswith("gguf") else None
        fdlora.disable(tr)  # the quantized base alone, plus the oracle's hooks on each layer
        hooks = oracle_hooks(tr, dirs[:k], w)
        try:
            ref = step(tr, x)
        finally:
            for h in hooks:
                h.remove()
            fdlora.enable(tr)
        err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
        effect = float((ref.float() - base_y.float()).abs().max() / ref.float().abs().max())
        copies = [m.path for m in tr.modules() if isinstance(m, _FusedLora) and quantized.kind(m.base)
                  and (m.merged.buf is not None or m.merged.groups)]
        ok = err < TOL[dt] and err < effect / 2 and not copies
        ms = timed(lambda: step(tr, x), dev, a.rounds)
        row = dict(kind=kind, case=case, ms=ms, x_base=ms / base_ms, rel_err=err, lora_effect=effect,
                   dequantized_copies=len(copies), merge_cache_bytes=fdlora.merge_cache_bytes(), ok=ok,
                   **({"target": TARGET} if case == "fdlora_1" else {}))
        row.update(merge_path=one_path(paths), merge_paths=paths)
        if gpaths is not None:
            row.update(gguf_path=one_path(gpaths), gguf_paths=gpaths)
        rows.append(row)
        if not ok:
            bad.append(f"{kind} {case}: rel err {err:.3g} (effect {effect:.3g}), {len(copies)} dequantized copies")
    pipe.transformer = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows, bad


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="*", help=f"default: {' '.join(KINDS)} (smoke: no int4, which needs CUDA)")
    p.add_argument("--smoke", action="store_true", help="tiny Flux on CPU (fp32)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--out", help="breadth.json to write the rows into (under 'quantized'; other keys kept)")
    a = p.parse_args()
    a.rounds = a.rounds or (2 if a.smoke else 10)
    if a.smoke:  # the GPU quantizer equals gguf's own, byte for byte
        import gguf

        w = torch.randn(64, 96) * torch.logspace(-3, 1, 96)
        want = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
        assert torch.equal(q8_0(w), torch.from_numpy(want)), "q8_0 differs from gguf.quants.quantize"
    rows, bad, kernel_rows, ao_rows = [], [], [], []
    kinds = a.kinds or [k for k in KINDS if not (a.smoke and k == "torchao-int4")]
    if "gguf-Q8_0" in kinds and not a.smoke:  # CUDA only: the Triton kernel on Flux's shapes
        kernel_rows = [gguf_kernel_row(K, N, a.rank) for K, N in FLUX_SHAPES]
        bad = [f"gguf kernel K={r['K']} N={r['N']}: equal to diffusers without LoRA: {r['nolora_equals_diffusers']},"
               f" rel err {r['rel_err_blend4']:.3g}" for r in kernel_rows if not r["ok"]]
        for r in kernel_rows:
            print(f"gguf kernel K={r['K']:<5} N={r['N']:<5} diffusers {r['diffusers_dequant_us']:7.1f} us  "
                  f"kernel {r['kernel_nolora_us']:7.1f} us ({r['nolora_gbps']:.0f} GB/s)  +r16 "
                  f"{r['lora_r16_us']:+6.1f} us ({r['lora_r16_pct']:+.1f}%)  +blend4 {r['lora_blend4_us']:+6.1f} us"
                  + ("" if r["ok"] else "  WRONG"), flush=True)
    for what in ("int8", "float8"):  # CUDA only: dequant_merge on Flux's shapes over torchao's own weights
        if f"torchao-{what}" in kinds and not a.smoke:
            ao = [torchao_kernel_row(what, K, N, a.rank) for K, N in FLUX_SHAPES]
            bad += [f"torchao {what} kernel K={r['K']} N={r['N']}: equal to torchao without LoRA: "
                    f"{r['nolora_equals_torchao']}, rel err {r['rel_err_blend4']:.3g}" for r in ao if not r["ok"]]
            for r in ao:
                print(f"torchao {what:<6} kernel K={r['K']:<5} N={r['N']:<5} torchao {r['torchao_convert_us']:7.1f} us "
                      f"kernel {r['kernel_nolora_us']:7.1f} us ({r['nolora_gbps']:.0f} GB/s)  +r16 "
                      f"{r['lora_r16_us']:+6.1f} us ({r['lora_r16_pct']:+.1f}%)  +blend4 {r['lora_blend4_us']:+6.1f} us"
                      + ("" if r["ok"] else "  WRONG"), flush=True)
            ao_rows += ao
    for kind in kinds:
        r, b = bench_kind(kind, a)
        rows, bad = rows + r, bad + b
        for row in r:
            print(f"{row['kind']:<16} {row['case']:<14} " + (f"{row['ms']:9.2f} ms  x{row['x_base']:.3f}"
                  + ("" if row.get("ok", True) else "  WRONG") if "ms" in row else row["error"])
                  + (f"  {row['merge_path']}" if "merge_path" in row else ""), flush=True)
    meta = {"device": "cpu (smoke)" if a.smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
            "rank": a.rank, "rounds": a.rounds, "model": "Flux-dev transformer (19 + 38 blocks), bf16 compute"}
    if a.out:
        path = Path(a.out)
        data = json.loads(path.read_text()) if path.exists() else {}
        data["quantized"] = {"meta": meta, "rows": rows, "gguf_kernel": kernel_rows, "torchao_kernel": ao_rows,
                             "failures": bad}
        path.write_text(json.dumps(data, indent=1))
    for b in bad:
        print("WRONG:", b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
