"""LLM serving with LoRA: Llama-3-8B-shaped decode and prefill, base vs PEFT vs fd-lora, in one run.

Model: Llama-3-8B widths (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256) at
reduced depth (4 layers), bf16, random weights built on the GPU. Adapters: r16 on all linears
(PEFT's "all-linear": every projection, not lm_head), random B. fd-lora serves them converted from
the same PEFT model (`fdlora.from_peft`), so weights are identical.

Cases (each verified against a float32 oracle of the PEFT model before it is timed):

    decode   32 sequences, one token per step, static KV cache after a 512-token prompt; the same
             step is replayed (same cache slot), CUDA-event time per step, median
             - 1 adapter, 4 adapters mixed by row (adapter_names, 8 rows each)
             - eager, and under CUDA graphs (one captured step, static inputs; fd-lora frozen with
               handle.freeze(); the base is captured the same way for its ratio)
    prefill  4096 tokens (batch 1), logits of the last position only, 1 adapter; and 4 x 1024
             tokens with 4 adapters mixed by row

Targets (PERF.md): decode <= 1.15x base with one adapter, <= 1.25x with 4 mixed; prefill <= 1.05x.

    python benchmarks/bench_llm.py --out benchmarks/results/<gpu>/llm.json
    python benchmarks/bench_llm.py --tiny           # CPU smoke run at toy widths (no graphs)
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fdlora  # noqa: E402
from fdlora.runtime.routing import adapter_rows  # noqa: E402

REAL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
            vocab_size=128256, num_hidden_layers=4, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, num_hidden_layers=2, max_position_embeddings=256)
TARGETS = {"decode_1": 1.15, "decode_4mixed": 1.25, "prefill_1": 1.05}


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="toy widths, small batch; runs on CPU")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    p.add_argument("--batch", type=int, default=None, help="decode sequences (default 32; tiny 4)")
    p.add_argument("--context", type=int, default=None, help="decode prompt length (default 512; tiny 16)")
    p.add_argument("--prefill", type=int, default=None, help="prefill tokens (default 4096; tiny 64)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 50 decode / 10 prefill)")
    p.add_argument("--layers", type=int, default=None, help="override the depth")
    p.add_argument("--profile", action="store_true",
                   help="also print where an eager fd-lora decode step spends host time (4 mixed, per-call)")
    return p.parse_args()


# --- model and adapters --------------------------------------------------------------------------
def build(a: argparse.Namespace, device: str, dtype: torch.dtype):
    """(base, PEFT model with adapters a0..a3, fd-lora model converted from a copy of it)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(**(TINY if a.tiny else REAL))
    if a.layers:
        cfg.num_hidden_layers = a.layers
    torch.manual_seed(0)
    with torch.device(device):
        base = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=a.rank, lora_alpha=2 * a.rank,
                                                                 target_modules="all-linear"), adapter_name="a0")
    for i in range(1, 4):
        peft_model.add_adapter(f"a{i}", LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules="all-linear"))
    g = torch.Generator(device).manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:  # PEFT initialises B to zero; a real adapter is not
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=p.dtype) * 0.02)
    peft_model.eval()
    peft_model.set_adapter("a0")
    fd = fdlora.from_peft(copy.deepcopy(peft_model))
    return base, peft_model, fd


# --- timing ----------------------------------------------------------------------------------------
def timer(device: str, reps: int):
    def median_ms(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    return median_ms


def graphed(step):
    """Capture one call of `step` in a CUDA graph; returns a replay function."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


# --- decode ----------------------------------------------------------------------------------------
class Decoder:
    """One decode step of a model on a static KV cache holding a `context`-token prompt."""

    def __init__(self, model, batch: int, context: int, device: str, vocab: int, adapter_names=None) -> None:
        from transformers import StaticCache

        g = torch.Generator(device).manual_seed(2)
        self.model, self.names = model, adapter_names
        # transformers 5.17's StaticCache advances its own write position on every step: leave room
        self.cache = StaticCache(config=model.config, max_cache_len=context + 1024)
        prompt = torch.randint(0, vocab, (batch, context), generator=g, device=device)
        kw = {} if adapter_names is None else {"adapter_names": adapter_names}
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=self.cache, use_cache=True, logits_to_keep=1,
                  cache_position=torch.arange(context, device=device), **kw)
        self.ids = torch.randint(0, vocab, (batch, 1), generator=g, device=device)
        self.pos = torch.full((1,), context, device=device, dtype=torch.long)
        self.position_ids = torch.full((batch, 1), context, device=device, dtype=torch.long)
        self.kw = kw
        self.logits = None

    def step(self):
        with torch.no_grad():
            out = self.model(input_ids=self.ids, past_key_values=self.cache, cache_position=self.pos,
                             position_ids=self.position_ids, use_cache=True, **self.kw)
        self.logits = out.logits
        return self.logits


def check(name: str, ours: torch.Tensor, peft: torch.Tensor, oracle: torch.Tensor, dtype) -> dict:
    """fd-lora's error vs the oracle must stay within 4x PEFT's (plus a few ulps of the output)."""
    eps = {torch.bfloat16: 7.9e-3, torch.float16: 9.8e-4, torch.float32: 1.2e-7}[dtype]
    ref = oracle.double()
    peft_err = float((peft.double() - ref).abs().max())
    fd_err = float((ours.double() - ref).abs().max())
    limit = 4 * peft_err + 4 * eps * float(ref.abs().max())
    ok = bool(torch.isfinite(ours).all()) and fd_err <= limit
    print(f"  verify {name:28s} fd-lora err {fd_err:.3g}  PEFT err {peft_err:.3g}  limit {limit:.3g}  "
          f"{'OK' if ok else 'MISMATCH'}")
    return {"fd_err": fd_err, "peft_err": peft_err, "limit": limit, "ok": ok}


def oracle_of(peft_model):
    """The PEFT model in float32 (bf16 runs on the GPU) or float64 (fp32 runs on the CPU)."""
    dtype = next(peft_model.parameters()).dtype
    return copy.deepcopy(peft_model).to(torch.float64 if dtype == torch.float32 else torch.float32)


def run_decode(a, base, peft_model, fd, device, dtype, vocab) -> tuple[dict, dict]:
    B, T = a.batch, a.context
    mixed = [f"a{i % 4}" for i in range(B)]
    median = timer(device, a.reps or 50)
    times, verify = {}, {}
    oracle = oracle_of(peft_model)
    for label, names in (("1", None), ("4mixed", mixed)):
        steps = {
            "peft": Decoder(peft_model, B, T, device, vocab, names),
            "fd": Decoder(fd, B, T, device, vocab, names),
            "oracle": Decoder(oracle, B, T, device, vocab, names),
        }
        outs = {k: d.step() for k, d in steps.items()}
        verify[f"decode_{label}"] = check(f"decode {label}", outs["fd"], outs["peft"], outs["oracle"], dtype)
        del steps["oracle"]
        times[f"peft_{label}"] = median(steps["peft"].step)
        times[f"fd_{label}"] = median(steps["fd"].step)
        if names is None:  # the same without the merged-weight cache (fdlora.layers.fastpath.merged)
            fdlora.set_merge_cache(0)
            times[f"fd_percall_{label}"] = median(steps["fd"].step)
            fdlora.set_merge_cache("auto")
    del oracle
    times["base"] = median(Decoder(base, B, T, device, vocab).step)
    if device == "cuda":
        graphs = {}
        try:
            graphs["base"] = median(graphed(Decoder(base, B, T, device, vocab).step))
            fdlora.handle(fd).freeze()
            graphs["fd_1"] = median(graphed(Decoder(fd, B, T, device, vocab).step))
            d = Decoder(fd, B, T, device, vocab)
            with adapter_rows(fd, mixed, (d.ids,), {}):
                graphs["fd_4mixed"] = median(graphed(d.step))
        except Exception as e:  # record, do not lose the eager numbers
            graphs["error"] = f"{type(e).__name__}: {e}"[:500]
        fdlora.handle(fd).unfreeze()  # the graphs are not replayed again: eager prefill follows
        times["cuda_graphs"] = graphs
    return times, verify


# --- prefill ---------------------------------------------------------------------------------------
def profile_decode(a, fd, device, vocab) -> None:
    """cProfile (host, by own time) and torch.profiler (ops, by self CPU time) of eager decode steps."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    mixed = [f"a{i % 4}" for i in range(a.batch)]
    for label, names, cache in (("4 mixed", mixed, "auto"), ("1 adapter per-call", None, 0)):
        fdlora.set_merge_cache(cache)
        d = Decoder(fd, a.batch, a.context, device, vocab, names)
        for _ in range(3):
            d.step()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            d.step()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        print(f"== cProfile of 5 eager decode steps, fd-lora {label}\n{s.getvalue()[:5000]}")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts) as prof:
            d.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    fdlora.set_merge_cache("auto")


def run_prefill(a, base, peft_model, fd, device, dtype, vocab) -> tuple[dict, dict]:
    median = timer(device, a.reps or 10)
    g = torch.Generator(device).manual_seed(3)
    cases = {"1": (torch.randint(0, vocab, (1, a.prefill), generator=g, device=device), None),
             "4mixed": (torch.randint(0, vocab, (4, a.prefill // 4), generator=g, device=device),
                        ["a0", "a1", "a2", "a3"])}
    times, verify = {}, {}
    oracle = oracle_of(peft_model)

    def call(model, ids, names):
        kw = {} if names is None else {"adapter_names": names}
        return lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1, **kw).logits

    with torch.no_grad():
        for label, (ids, names) in cases.items():
            outs = {k: call(m, ids, names)() for k, m in (("peft", peft_model), ("fd", fd), ("oracle", oracle))}
            verify[f"prefill_{label}"] = check(f"prefill {label}", outs["fd"], outs["peft"], outs["oracle"], dtype)
            times[f"base_{label}"] = median(call(base, ids, None))
            times[f"peft_{label}"] = median(call(peft_model, ids, names))
            times[f"fd_{label}"] = median(call(fd, ids, names))
            if names is None:  # the same without the merged-weight cache (fdlora.layers.fastpath.merged)
                fdlora.set_merge_cache(0)
                times[f"fd_percall_{label}"] = median(call(fd, ids, names))
                fdlora.set_merge_cache("auto")
    return times, verify


# --- report ----------------------------------------------------------------------------------------
def environment(device: str) -> dict:
    import peft
    import transformers

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except OSError:
        sha = "unknown"
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    return {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_v,
            "transformers": transformers.__version__, "peft": peft.__version__, "fdlora": fdlora.__version__,
            "git_sha": sha, "python": platform.python_version()}


def ratios(decode: dict, prefill: dict) -> dict:
    r = {"decode_peft_1": decode["peft_1"] / decode["base"], "decode_fd_1": decode["fd_1"] / decode["base"],
         "decode_fd_percall_1": decode["fd_percall_1"] / decode["base"],
         "decode_peft_4mixed": decode["peft_4mixed"] / decode["base"],
         "decode_fd_4mixed": decode["fd_4mixed"] / decode["base"],
         "prefill_peft_1": prefill["peft_1"] / prefill["base_1"], "prefill_fd_1": prefill["fd_1"] / prefill["base_1"],
         "prefill_fd_percall_1": prefill["fd_percall_1"] / prefill["base_1"],
         "prefill_peft_4mixed": prefill["peft_4mixed"] / prefill["base_4mixed"],
         "prefill_fd_4mixed": prefill["fd_4mixed"] / prefill["base_4mixed"]}
    g = decode.get("cuda_graphs", {})
    for k in ("fd_1", "fd_4mixed"):
        if k in g and "base" in g:
            r[f"decode_graphs_{k}"] = g[k] / g["base"]
    return r


def main() -> int:
    a = args()
    device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a.batch = a.batch or (4 if a.tiny else 32)
    a.context = a.context or (16 if a.tiny else 512)
    a.prefill = a.prefill or (64 if a.tiny else 4096)
    if a.tiny:
        a.reps = a.reps or 3
    t0 = time.time()
    base, peft_model, fd = build(a, device, dtype)
    vocab = base.config.vocab_size
    print(f"bench_llm on {device} ({dtype}): {fdlora.handle(fd)}")
    if a.profile:
        profile_decode(a, fd, device, vocab)
    decode, v1 = run_decode(a, base, peft_model, fd, device, dtype, vocab)
    prefill, v2 = run_prefill(a, base, peft_model, fd, device, dtype, vocab)
    r = ratios(decode, prefill)
    targets = {"decode_fd_1": TARGETS["decode_1"], "decode_fd_4mixed": TARGETS["decode_4mixed"],
               "decode_graphs_fd_1": TARGETS["decode_1"], "decode_graphs_fd_4mixed": TARGETS["decode_4mixed"],
               "prefill_fd_1": TARGETS["prefill_1"]}
    targets = {k: t for k, t in targets.items() if k in r}
    result = {
        "benchmark": "llm", "env": environment(device),
        "shape": {**(TINY if a.tiny else REAL), "layers": base.config.num_hidden_layers, "dtype": str(dtype),
                  "rank": a.rank, "decode_batch": a.batch, "decode_context": a.context, "prefill_tokens": a.prefill},
        "backend": repr(next(iter(fdlora.handle(fd).layers.values())).selection),
        "verify": {**v1, **v2}, "decode_ms": decode, "prefill_ms": prefill, "ratios_to_base": r,
        "targets": {k: {"target": t, "measured": r[k], "met": r[k] <= t} for k, t in targets.items()},
        "seconds": time.time() - t0,
    }
    print(json.dumps({"decode_ms": decode, "prefill_ms": prefill, "ratios_to_base": r}, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return 0 if all(v["ok"] for v in result["verify"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
