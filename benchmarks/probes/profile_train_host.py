# Measures: host time and device-op count of one trainable LoRA layer vs PEFT and a frozen nn.Linear.
"""Host time of one trainable LoRA layer's forward + backward (eager, no torch.compile): fd-lora vs PEFT vs a frozen
nn.Linear, on CPU with tiny shapes so kernel time is negligible and what is left is Python, dispatch and autograd.

A stack of `--layers` frozen Linear(K, K) layers (every layer's input requires grad, as inside a UNet), each wrapped
by fd-lora's trainable layer (`fdlora.add_trainable_adapter`) or by PEFT's LoRA layer (same LoraConfig), or left a
plain frozen nn.Linear. Reported per layer: forward and forward + backward in us, the median over `--rounds` of the
median of `--repeats` steps of the whole stack divided by the layer count, and the best round (a shared host slows
some rounds); the ops per layer step that do device work (torch.profiler's leaf ops less views and allocations: on
CUDA each is a kernel launch, the host cost that CPU timings here understate); then, for fd-lora, cProfile's top
Python frames by own time and torch.profiler's top ops by self CPU time over one forward + backward.

    PYTHONPATH=. python benchmarks/probes/profile_train_host.py                     # fp32
    PYTHONPATH=. python benchmarks/probes/profile_train_host.py --autocast bf16     # as the SDXL step runs (CPU here)
    PYTHONPATH=. python benchmarks/probes/profile_train_host.py --autocast bf16 --half-pair  # and CUDA's eager pair
    PYTHONPATH=. python benchmarks/probes/profile_train_host.py --autocast bf16 --half-pair --base-dtype bf16  # SDXL's
    PYTHONPATH=. python benchmarks/probes/profile_train_host.py --autocast bf16 --half-pair --base nf4  # ViT QLoRA's
    PYTHONPATH=. python benchmarks/probes/profile_train_host.py --no-profile --out /tmp/host.json
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import fdlora  # noqa: E402


class Stack(nn.Module):
    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(k, k) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build(kind: str, n: int, k: int, r: int, dropout: float, base_dtype: torch.dtype = torch.float32,
          nf4: bool = False) -> nn.Module:
    """The stack as `kind` wraps it; with nf4 its layers are bitsandbytes nf4 Linear4bit ones (double-quantized,
    computing in base_dtype, biases fp32), swapped in by fdlora.training.quant.quantize_manual into the fp32 stack as
    bench_train's ViT case does."""
    from peft import LoraConfig, get_peft_model

    from fdlora.training.quant import QuantSpec, quantize_manual

    torch.manual_seed(0)
    base = Stack(n, k).requires_grad_(False)
    if nf4:
        quantize_manual(base, QuantSpec("nf4", "bfloat16" if base_dtype is torch.bfloat16 else "float32", True))
    else:
        base = base.to(base_dtype)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=r"layers\.\d+")
    if kind == "fd-lora":
        return fdlora.add_trainable_adapter(base, "default", cfg).train()
    if kind == "peft":
        return get_peft_model(base, copy.deepcopy(cfg)).train()
    return base.train()


def per_layer_us(model: nn.Module, x: torch.Tensor, n: int, repeats: int, autocast: torch.dtype | None,
                 backward: bool, clock=time.process_time) -> float:
    """Median over `repeats` of one forward (+ backward) of the stack, per layer; gradients are set to None between
    steps, untimed, as an optimizer step's zero_grad does."""
    params = [p for p in model.parameters() if p.requires_grad] + [x]

    def step():
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            y = model(x)
        if backward:
            y.float().sum().backward()

    times = []
    for i in range(repeats + 3):
        for p in params:
            p.grad = None
        t = clock()
        step()
        if i >= 3:  # warm-up
            times.append(clock() - t)
    return statistics.median(times) * 1e6 / n


# leaf ops that move no data: no kernel on CUDA (a leaf aten::to is a no-op one)
_METADATA = {"aten::to", "aten::t", "aten::transpose", "aten::view", "aten::reshape", "aten::_unsafe_view",
             "aten::as_strided", "aten::expand", "aten::detach", "detach", "aten::alias", "aten::resolve_conj",
             "aten::resolve_neg",
             "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::lift_fresh",
             "aten::result_type", "aten::promote_types", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
             "aten::squeeze", "aten::unsqueeze", "aten::slice", "aten::select", "aten::permute"}


_GEMMS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"}  # one launch each, whatever the
# CPU BLAS calls under them (a copy_ under addmm is one on CUDA too, for a 2-D input; for a 1-D bias CUDA fuses it)


def stepper(model: nn.Module, x: torch.Tensor, autocast: torch.dtype | None):
    """One training step of the stack (forward under autocast, backward of the sum), gradients cleared first."""
    params = [p for p in model.parameters() if p.requires_grad] + [x]

    def step():
        for p in params:
            p.grad = None
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            y = model(x)
        y.float().sum().backward()

    return step


def _under_bnb_kernel(e) -> bool:
    """Whether a profiler event runs inside an innermost bitsandbytes op (on CUDA one kernel, called from Python)."""
    p = e.cpu_parent
    while p is not None:
        if _bnb_kernel(p):
            return True
        p = p.cpu_parent
    return False


def _bnb_kernel(e) -> bool:
    """A bitsandbytes op with no bitsandbytes op under it (dequantize_blockwise, dequantize_4bit: one CUDA launch
    each, a C call or torch ops on CPU); gemm_4bit is not one: on CUDA it runs them, an add and a GEMM."""
    return e.name.startswith("bitsandbytes::") and not any(c.name.startswith("bitsandbytes::") for c in e.cpu_children)


def device_ops(model: nn.Module, x: torch.Tensor, n: int, autocast: torch.dtype | None) -> tuple[float, dict]:
    """Ops per layer step that do device work (GEMMs, leaf aten ops less metadata ones, innermost bitsandbytes ops
    counted as one, not by the aten ops their CPU kernels run), and their counts by name."""
    step = stepper(model, x, autocast)
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    names = [e.name for e in prof.events() if _bnb_kernel(e) or ((e.name in _GEMMS or (
        e.name.startswith("aten::") and not e.cpu_children and e.name not in _METADATA)) and not _under_bnb_kernel(e))]
    counts = {k: round(names.count(k) / n, 2) for k in sorted(set(names))}
    return len(names) / n, counts


def profile(model: nn.Module, x: torch.Tensor, autocast: torch.dtype | None, top: int) -> None:
    step = stepper(model, x, autocast)
    step()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        step()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    print("-- cProfile (5 steps), top Python frames by own time")
    print("\n".join(s.getvalue().splitlines()[4:]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    print("-- torch.profiler (1 step), top ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1,
                    help="x is [batch, tokens, K] as in a UNet's attention (0: a 2-D [tokens, K] input)")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--autocast", choices=["bf16"], default=None)
    ap.add_argument("--half-pair", action="store_true",
                    help="with --autocast: run the eager half-precision pair that CUDA runs (fdlora.kernels.train_ops."
                         "_half_pair) on CPU too, to time its host cost here")
    ap.add_argument("--base-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="the frozen base's dtype (bf16: as bench_train's SDXL UNet, trained under bf16 autocast; the "
                         "adapters stay fp32 in both fd-lora and PEFT)")
    ap.add_argument("--base", choices=["linear", "nf4"], default="linear",
                    help="nf4: the layers are bitsandbytes nf4 Linear4bit (QLoRA; --base-dtype is then their compute "
                         "dtype: --autocast bf16 --half-pair --base-dtype bf16 is bench_train's ViT case on CUDA); the "
                         "linear kind then times the frozen 4-bit layers with their input gradient")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: the process's CPU time (steadier on a shared host; with one thread it is the host time "
                         "a step spends), wall: perf_counter")
    ap.add_argument("--kinds", nargs="+", default=["linear", "peft", "fd-lora"])
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    autocast = torch.bfloat16 if a.autocast == "bf16" else None
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    if a.half_pair:
        from fdlora.kernels import train_ops

        train_ops._half_pair = lambda u: u.dtype in (torch.float16, torch.bfloat16)
    x = torch.randn(*([a.batch] if a.batch else []), a.tokens, a.features, requires_grad=True)
    result = {k: getattr(a, k) for k in ("layers", "features", "rank", "tokens", "batch", "dropout", "autocast",
                                         "half_pair", "clock", "base_dtype", "base")}
    result.update(torch=torch.__version__, rows={})
    base_dtype = torch.bfloat16 if a.base_dtype == "bf16" else torch.float32
    models = {k: build(k, a.layers, a.features, a.rank, a.dropout, base_dtype, a.base == "nf4") for k in a.kinds}
    samples = {k: ([], []) for k in models}
    for _ in range(a.rounds):  # the kinds interleaved, so a slow spell of a shared host hits them alike
        for kind, model in models.items():
            for i, backward in enumerate((False, True)):
                samples[kind][i].append(per_layer_us(model, x, a.layers, a.repeats, autocast, backward, clock))
    for kind, (fwd, both) in samples.items():  # best: the round least slowed by anything else on the host
        row = {"fwd_us": statistics.median(fwd), "fwd_bwd_us": statistics.median(both), "fwd_best_us": min(fwd),
               "fwd_bwd_best_us": min(both)}
        result["rows"][kind] = {k: round(v, 1) for k, v in row.items()}
        print(f"{kind:<8} forward {row['fwd_us']:6.1f} (best {row['fwd_best_us']:6.1f}) us/layer   forward+backward "
              f"{row['fwd_bwd_us']:6.1f} (best {row['fwd_bwd_best_us']:6.1f}) us/layer")
    for kind, model in models.items():
        ops, by_name = device_ops(model, x, a.layers, autocast)
        result["rows"][kind].update(device_ops=round(ops, 2), device_ops_by_name=by_name)
        print(f"{kind:<8} device-work ops per layer step {ops:5.2f}: "
              + ", ".join(f"{k.removeprefix('aten::')} {v:g}" for k, v in by_name.items()))
    if "peft" in result["rows"] and "fd-lora" in result["rows"]:
        rows = result["rows"]
        ratio = rows["fd-lora"]["fwd_bwd_us"] / rows["peft"]["fwd_bwd_us"]
        best = rows["fd-lora"]["fwd_bwd_best_us"] / rows["peft"]["fwd_bwd_best_us"]
        result["fdlora_x_peft"], result["fdlora_x_peft_best"] = round(ratio, 3), round(best, 3)
        print(f"fd-lora / peft (forward+backward): {ratio:.2f} (best rounds {best:.2f})")
    if not a.no_profile and "fd-lora" in models:
        profile(models["fd-lora"], x, autocast, a.top)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
