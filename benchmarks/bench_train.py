"""Training step time and peak memory: fd-lora's trainable layers vs PEFT, same model, weights, batch, optimizer.

Cases (full size, GPU):
    llama   Llama-3-8B shape, 4 layers, bf16, batch 4 x 2048 tokens, all-linear r16
    vit     ViT-L/16 backbone, bitsandbytes nf4 (manual swap, classifier kept), batch 64 at 224^2, qkv+mlp r16
    sdxl    SDXL UNet, batch 1 at 1024^2 (128^2 latents), bf16 autocast, attention r16
plus `layer`: the LoRA part of one layer's backward as an eager step runs it (on CUDA, half precision: the backward of
fdlora.kernels.train_ops' Function, reusing what its forward kept; the registered op's time as `op_ms`) against the
PEFT-style torch path (four GEMMs and a scale: grad_B, g, grad_A, grad_x) at Llama-3-8B layer shapes: wall time of
one call synchronised on both sides (host launch time included: at N = 1024 the pieces are shorter on the GPU than
their launches), and on CUDA as GPU time too (CUDA graph replays, `fd_gpu_us` / `torch_gpu_us`: what the backward
adds to a GPU-bound step such as the llama case's), and what the LoRA part adds to the whole layer's backward
(`layer_lora_x_torch`; see layer_microbench).

Each case verifies first (one step's LoRA gradients of fd-lora vs PEFT on a small batch, relative error reported and
bounded), then times `--steps` rounds (default 30), each one optimizer step of PEFT, of fd-lora, of fd-lora with each
layer making its own casts through the Python Function (`fd_own_casts`), and of the floor, in turn (a shared host's
slow spells fall on all of them; `--blocked`: each run's steps together): median ms, the median of each round's
fd-lora / PEFT ratio, the process's CPU time per step enqueued (`cpu_ms`: the host's work, what a host-bound step
waits on), and the peak memory each step allocates above what was resident before it (activations, gradients). The
floor is the same base model with no adapter at all, frozen, its forward and the backward every LoRA training step
needs (the input gradient through every layer, from the first targeted block's input; no weight gradient, no
optimizer). No LoRA implementation can step faster than that, so `floor_x_peft` > 0.75 means the step target is out
of reach on that case. Targets (issue 23):
step time <= 0.75x PEFT's, peak memory <= PEFT's, layer backward <= 0.6x the torch path. `--smoke` runs every
code path on toy shapes on CPU.

    python benchmarks/bench_train.py --out benchmarks/results/<gpu>/train.json
    python benchmarks/bench_train.py --smoke --out /tmp/train.json

More than one GPU (`--ddp`, `--fsdp`, or both in one launch): fd-lora alone under `accelerate launch`, the global
batch split over the processes, the model replicated (DDP) or its frozen base sharded as `fdlora train` shards it
(FSDP2, fdlora.training.fsdp). A row per (case, mode, process count): median step ms of the slowest rank, peak GiB
per GPU (the largest rank's), the frozen base bytes each process holds. Rows merge into --out, so the launches of
each process count fill one file (benchmarks/gpu_session.sh train-multi runs them):

    L="accelerate launch --num_machines 1 --mixed_precision no --dynamo_backend no"
    $L --num_processes 1 benchmarks/bench_train.py --ddp --fsdp --cases llama sdxl vit --steps 5 \
        --out benchmarks/results/<gpu>/train_multigpu.json
    $L --multi_gpu --num_processes 2 benchmarks/bench_train.py --ddp --fsdp ... (the same --out)
    CUDA_VISIBLE_DEVICES= $L --multi_gpu --num_processes 2 benchmarks/bench_train.py --smoke --ddp --fsdp \
        --out /tmp/m.json      (CPU, gloo; `accelerate launch --cpu --num_processes 2` would start one process)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fdlora  # noqa: E402
from fdlora import env  # noqa: E402
from fdlora.fixtures import fullsize  # noqa: E402
from fdlora.integrations.transformers.trainable.adapters import state_of  # noqa: E402
from fdlora.testing import graphs_ms, median_ms  # noqa: E402

TARGETS = {"step_x_peft": 0.75, "peak_x_peft": 1.0, "layer_x_torch": 0.6}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _peft_lora(pm, name="default"):
    return {n[len("base_model.model."):]: m for n, m in pm.named_modules()
            if hasattr(m, "lora_A") and name in getattr(m, "lora_A", {})}


def _pair(build, lora_cfg, dev):
    """(peft model, fd-lora model) on copies of one base, with equal initial A and B (B random: every grad counts)."""
    from peft import get_peft_model

    base = build()
    pm = get_peft_model(copy.deepcopy(base), copy.deepcopy(lora_cfg))
    fm = fdlora.add_trainable_adapter(base, "default", copy.deepcopy(lora_cfg))
    theirs = _peft_lora(pm)
    with torch.no_grad():
        for path, (A, B) in fdlora.lora_parameters(fm, "default").items():
            pa, pb = theirs[path].lora_A["default"].weight, theirs[path].lora_B["default"].weight
            pb.normal_(0, 0.01)
            A.copy_(pa)
            B.copy_(pb)
    return pm.to(dev), fm.to(dev)


def _verify(pm, fm, loss_fn, small, autocast) -> float:
    """Worst relative error of fd-lora's A/B grads vs PEFT's after one backward on the small batch."""
    for m in (pm, fm):
        m.zero_grad(set_to_none=True)
        with autocast():
            loss_fn(m, small).backward()
    theirs, worst = _peft_lora(pm), 0.0
    for path, (A, B) in fdlora.lora_parameters(fm, "default").items():
        for mine, ref in ((A, theirs[path].lora_A["default"].weight), (B, theirs[path].lora_B["default"].weight)):
            err = ((mine.grad.float() - ref.grad.float()).abs().max() / ref.grad.float().abs().max().clamp_min(1e-30))
            worst = max(worst, float(err))
    for m in (pm, fm):
        m.zero_grad(set_to_none=True)
    return worst


def _time(model, loss_fn, batch, steps, dev, autocast, losses=None) -> tuple[float, float]:
    """(median step ms, peak GiB allocated above the resident baseline) of AdamW steps; the last step's loss is
    appended to `losses` if given."""
    return _time_runs({"": (model, None)}, loss_fn, batch, steps, dev, autocast, losses)[""][:2]


def _time_runs(runs, loss_fn, batch, steps, dev, autocast, losses=None, blocked=False) -> dict[str, tuple]:
    """{name: (median step ms, peak GiB allocated above what was resident before the step, every step's ms, every
    step's process CPU ms enqueued (before the final sync))} of AdamW steps of each run {name: (model, prepare or
    None, called before each of its steps)}, taken in turn one step each, so that a slow spell of a shared host falls
    on every run alike (blocked: each run's steps one after another, as before session 28; runs of one model share
    its optimizer). The last step's loss of each run is appended to `losses` if given."""
    opts = {}
    for model, _ in runs.values():
        if id(model) not in opts:
            params = [p for p in model.parameters() if p.requires_grad]
            opts[id(model)] = torch.optim.AdamW(params, lr=1e-5) if params else None  # the floor: nothing to train

    def step(model, prepare):
        if prepare is not None:
            prepare()
        with autocast():
            loss = loss_fn(model, batch)
        loss.backward()
        opt = opts[id(model)]
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    for model, prepare in runs.values():
        step(model, prepare)  # warm-up: optimizer state, kernels compiled
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    times, peaks, last, cpu = {n: [] for n in runs}, dict.fromkeys(runs, 0.0), {}, {n: [] for n in runs}
    order = [n for n in runs for _ in range(steps)] if blocked else [n for _ in range(steps) for n in runs]
    for name in order:
        model, prepare = runs[name]
        _sync(dev)
        if dev.type == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t, c = time.perf_counter(), time.process_time()
        last[name] = step(model, prepare)
        cpu[name].append((time.process_time() - c) * 1e3)
        _sync(dev)
        times[name].append((time.perf_counter() - t) * 1e3)
        if dev.type == "cuda":
            peaks[name] = max(peaks[name], (torch.cuda.max_memory_allocated() - base) / 2**30)
    if losses is not None:
        losses.extend(float(v) for v in last.values())
    for model, _ in runs.values():
        for p in model.parameters():
            p.grad = None
    return {n: (statistics.median(times[n]), peaks[n] if dev.type == "cuda" else float("nan"), times[n], cpu[n])
            for n in runs}


# ----------------------------------------------------------------------------------------------- cases
def llama_case(dev, smoke):
    import transformers
    from peft import LoraConfig

    cfg = dict(fullsize.LLAMA_TINY if smoke else {**fullsize.LLAMA3_8B, "num_hidden_layers": 4})
    dtype = torch.float32 if smoke else torch.bfloat16

    def build():
        torch.manual_seed(0)
        with fullsize.built_on(dev, dtype):
            return transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**cfg), dtype=dtype)

    B, T = (2, 16) if smoke else (4, 2048)
    ids = torch.randint(0, cfg["vocab_size"], (B, T), device=dev)
    batch, small = {"input_ids": ids, "labels": ids}, {"input_ids": ids[:1, :128], "labels": ids[:1, :128]}
    return build, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"), batch, small, \
        lambda m, b: m(**b).loss, dtype, lambda m: m.model.embed_tokens


def vit_case(dev, smoke):
    import transformers
    from peft import LoraConfig

    from fdlora.training.quant import QuantSpec, quantize_manual

    cfg = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=128, num_labels=10) if smoke else \
        transformers.ViTConfig(image_size=224, patch_size=16, hidden_size=1024, num_hidden_layers=24,
                               num_attention_heads=16, intermediate_size=4096, num_labels=1000)
    cd = "float32" if smoke else "bfloat16"

    def build():
        torch.manual_seed(0)
        m = transformers.ViTForImageClassification(cfg)
        quantize_manual(m, QuantSpec("nf4", cd, True, ["classifier"]), dev)
        return m.to(dev)

    B = 4 if smoke else 64
    x = torch.randn(B, 3, cfg.image_size, cfg.image_size, device=dev)
    y = torch.randint(0, cfg.num_labels, (B,), device=dev)
    return build, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "fc1", "fc2"]), \
        {"pixel_values": x, "labels": y}, {"pixel_values": x[:2], "labels": y[:2]}, lambda m, b: m(**b).loss, \
        torch.float32 if smoke else torch.bfloat16, lambda m: m.vit.embeddings


def sdxl_case(dev, smoke):
    from peft import LoraConfig

    dtype = torch.float32 if smoke else torch.bfloat16

    def build():
        return fullsize.sdxl_unet(dev, dtype, smoke)

    probe = build()
    inputs = fullsize.sdxl_inputs(probe, batch=1, tokens=fullsize.SDXL_TOKENS_TINY if smoke else 77)
    del probe
    target = torch.randn_like(inputs["sample"])

    def loss(m, b):
        return F.mse_loss(m(**b).sample.float(), target.float())

    return build, LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]), inputs, \
        inputs, loss, dtype, lambda m: m.conv_in


CASES = {"llama": llama_case, "vit": vit_case, "sdxl": sdxl_case}


def floor_model(build, first, dev):
    """The base alone (no adapter, every weight frozen) with the input gradient flowing back from `first`'s output
    through every layer after it: the forward and backward any LoRA training step of this model must run."""
    model = build().to(dev).train()
    model.requires_grad_(False)
    first(model).register_forward_hook(lambda mod, args, out: out.requires_grad_(True))
    return model


def run_case(name, dev, smoke, steps, blocked=False) -> dict:
    build, lora_cfg, batch, small, loss_fn, dtype, first = CASES[name](dev, smoke)
    pm, fm = _pair(build, lora_cfg, dev)
    pm.train(), fm.train()

    def autocast():
        if dtype == torch.float32:
            return torch.autocast(dev.type, enabled=False)
        return torch.autocast(dev.type, dtype=dtype)

    err = _verify(pm, fm, loss_fn, small, autocast)
    bound = 1e-4 if dtype == torch.float32 else 5e-2
    halves = state_of(fm).halves

    def casts(off):  # fd-lora's A / B copies made once per pass for all layers (off: by each layer, as before)
        return lambda: setattr(halves, "off", off)

    floor = floor_model(build, first, dev)  # resident beside the pair, so that its steps are taken in turn too
    t = _time_runs({"peft": (pm, None), "fd": (fm, casts(False)), "fd_own_casts": (fm, casts(True)),
                    "floor": (floor, None)}, loss_fn, batch, steps, dev, autocast, blocked=blocked)
    (peft_ms, peft_peak), (fd_ms, fd_peak), (own_ms, _), (floor_ms_, _) = (t[k][:2] for k in ("peft", "fd",
                                                                                               "fd_own_casts", "floor"))
    halves.off = False
    step_ms = {k: [round(v, 2) for v in r[2]] for k, r in t.items()}
    rounds = [f / p for f, p in zip(step_ms["fd"], step_ms["peft"])]  # each round's steps were taken together
    cpu = {k: statistics.median(r[3]) for k, r in t.items()}
    row = {"case": name, "fd_ms": fd_ms, "peft_ms": peft_ms, "step_x_peft": fd_ms / peft_ms,
           "round_ratio_median": statistics.median(rounds),
           "fd_own_casts_ms": own_ms, "own_casts_x_peft": own_ms / peft_ms,
           "timing": "blocked" if blocked else "in turn",
           "fd_peak_gib": fd_peak, "peft_peak_gib": peft_peak,
           "peak_x_peft": fd_peak / peft_peak if peft_peak == peft_peak and peft_peak > 0 else None,
           "grad_rel_err": err, "grad_bound": bound, "checked": err < bound,
           "trainable_params": sum(p.numel() for p in fdlora.trainable_parameters(fm)),
           "floor_ms": floor_ms_, "floor_x_peft": floor_ms_ / peft_ms, "fd_x_floor": fd_ms / floor_ms_,
           "cpu_ms": cpu, "cpu_x_peft": cpu["fd"] / cpu["peft"],
           "step_ms": step_ms}
    del pm, fm, floor
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _one_rank_group(dev) -> None:
    """FSDP needs a process group; `accelerate launch --num_processes 1` starts none: a 1-rank one in this process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


def _per_rank(values: list[float], dev) -> list[list[float]]:
    """`values` of every rank (all_gather; one list per rank, rank order)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def _base_bytes(model) -> tuple[int, int]:
    """(bytes of the frozen parameters this process holds, bytes of the whole frozen base): a sharded parameter
    counts its local shard."""
    from fdlora.training import fsdp

    local = total = 0
    for p in model.parameters():
        if not p.requires_grad:
            total += p.numel() * p.element_size()
            local += (p.to_local() if fsdp.is_sharded(p) else p).numel() * p.element_size()
    return local, total


FSDP_QUANT_NOTE = ("not run: FSDP does not shard bitsandbytes 4-bit weights (packed uint8 Params4bit with a quant "
                   "state; `fdlora train` refuses quantization with FSDP, fdlora.training.trainer.parallelism)")


def multi_case(name, mode, acc, smoke, steps) -> dict | None:
    """fd-lora alone under `accelerate launch [--multi_gpu] --num_processes N`, the global batch split over the N
    processes; `mode` ddp: the model replicated (accelerate's DDP wrapper; none at N=1), fsdp: the frozen base sharded
    as `fdlora train` shards it (fdlora.training.fsdp.shard, units from _no_split_modules; the model is built on the
    device, then sharded). Times are per rank, the row keeps the slowest; memory the largest rank's. Verification
    vs PEFT is the single-GPU run's job; this checks the losses are finite and (ddp) the replicas stay equal.
    Returns the row on the main process, None on the others."""
    from fdlora.training import fsdp

    dev, n, r = acc.device, acc.num_processes, acc.process_index
    cuda = dev.type == "cuda"
    row = {"case": name, "mode": mode, "processes": n, "smoke": smoke}
    if mode == "fsdp" and name == "vit":
        return {**row, "note": FSDP_QUANT_NOTE} if acc.is_main_process else None
    build, lora_cfg, batch, _, loss_fn, dtype, _ = CASES[name](dev, smoke)
    model = fdlora.add_trainable_adapter(build(), "default", lora_cfg).to(dev)
    if mode == "fsdp":
        _one_rank_group(dev)
        fsdp.shard(model, dev, n)
        dmodel = model
    model.train()
    opt = torch.optim.AdamW(fdlora.trainable_parameters(model), lr=1e-5)
    if mode == "ddp":
        dmodel, opt = acc.prepare(model, opt)
    B = next(iter(batch.values())).shape[0]
    per = max(1, B // n)  # a batch smaller than the process count (SDXL's 1): each process runs it (weak scaling)
    local = {k: (v[r * per:(r + 1) * per] if B >= n and torch.is_tensor(v) and v.dim() and v.shape[0] == B else v)
             for k, v in batch.items()}

    def autocast():
        return torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32)

    held, whole = _base_bytes(model)
    if cuda:
        _sync(dev)
        torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated() / 2**30 if cuda else float("nan")
    losses = []
    ms, above = _time(dmodel, loss_fn, local, steps, dev, autocast, losses)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")  # since _time's reset: the steps
    check = float(sum(float(p.detach().double().sum()) for p in fdlora.trainable_parameters(model))) \
        if mode == "ddp" else 0.0  # ddp: every replica holds the same A / B after the steps
    ranks = _per_rank([ms, peak, above, resident, held, losses[-1], check], dev)

    def worst(i):  # the largest over the ranks; None where no rank measured it (memory on CPU)
        vals = [x[i] for x in ranks if x[i] == x[i]]
        return max(vals) if vals else None

    row.update(per_process_batch=per, global_batch=per * n, fd_ms=worst(0), fd_ms_ranks=[x[0] for x in ranks],
               samples_per_s=per * n / worst(0) * 1e3, peak_gib=worst(1), peak_above_resident_gib=worst(2),
               resident_gib=worst(3), base_bytes_per_gpu=int(worst(4)), base_bytes_total=whole,
               base_share=worst(4) / whole if whole else None,
               losses_finite=all(x[5] == x[5] and abs(x[5]) != float("inf") for x in ranks), last_loss=ranks[0][5])
    if mode == "ddp":
        row["replicas_equal"] = all(x[6] == ranks[0][6] for x in ranks)
    if mode == "fsdp":
        from torch.distributed.fsdp import FSDPModule

        row["fsdp_units"] = sum(1 for m in model.modules() if isinstance(m, FSDPModule))
    if n == 1:
        row["note"] = ("1 process: no DDP wrapper (accelerate prepares a plain model)" if mode == "ddp" else
                       "1 process: FSDP over a 1-rank group (every unit whole; the sharding machinery's own cost)")
    elif B < n:
        row["note"] = f"batch {B} < {n} processes: each process runs the whole batch (weak scaling)"
    del model, dmodel, opt, local, batch
    acc.free_memory()
    if cuda:
        torch.cuda.empty_cache()
    return row if acc.is_main_process else None


def merge_rows(path: Path, rows: list[dict], meta: dict) -> dict:
    """`rows` into the JSON at `path` (created if missing): a row replaces an earlier one of the same (case, mode,
    processes, smoke), so successive launches (1 process, 2 processes) fill one file."""
    doc = json.loads(path.read_text()) if path.exists() else {}
    if doc.get("device") not in (None, meta["device"]):
        raise SystemExit(f"bench_train: {path} holds rows measured on {doc['device']!r}, this run is on "
                         f"{meta['device']!r}; fix: --out benchmarks/results/<this gpu>/train_multigpu.json")

    def key(r):
        return r["case"], r["mode"], r["processes"], r.get("smoke", False)

    new = {key(r) for r in rows}
    kept = [r for r in doc.get("rows", []) if key(r) not in new]
    order = list(CASES)
    doc = {**doc, **meta, "rows": sorted(kept + rows, key=lambda r: (order.index(r["case"]) if r["case"] in order
                                                                      else len(order), *key(r)[1:]))}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    return doc


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def run_multi(a) -> int:
    """The multi-process mode: one row per (mode, case), each merged into --out as soon as it is measured (a launch
    cut short keeps the rows it finished). The nf4 ViT runs after the others (bitsandbytes weights under DDP are the
    least tried path). A case that raises leaves a row with its error and the launch goes on; the exit status is then
    1 (a failed collective may instead hang until the caller's timeout: the rows before it are in --out)."""
    import gc
    import traceback

    from fdlora.training import fsdp

    acc = fsdp.accelerator(cpu=a.smoke or not torch.cuda.is_available())
    modes = [m for m in ("ddp", "fsdp") if getattr(a, m)]
    cases = [c for c in a.cases if c in CASES]
    pairs = [(m, c) for m in modes for c in cases if c != "vit"] + [(m, "vit") for m in modes if "vit" in cases]
    steps = a.steps or (2 if a.smoke else 10)
    meta, failed = None, False
    if acc.is_main_process:
        e = environment(acc.device)
        meta = {"device": e["device"], "git_sha": e["git_sha"], "gpus": torch.cuda.device_count(), "env": e}
    for mode, name in pairs:
        try:
            row = multi_case(name, mode, acc, a.smoke, steps)
        except Exception as err:  # recorded in the row; the other cases still run
            traceback.print_exc()
            failed = True
            row = {"case": name, "mode": mode, "processes": acc.num_processes, "smoke": a.smoke,
                   "error": f"{type(err).__name__}: {err}"[:2000]} if acc.is_main_process else None
            del err
            acc.free_memory()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if row is None:
            continue
        row["steps"], row["git_sha"] = steps, meta["git_sha"]
        if "fd_ms" in row:
            peak = "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.2f} GiB"
            print(f"{name} {mode}: {row['processes']} processes x batch {row['per_process_batch']}: "
                  f"{row['fd_ms']:.1f} ms/step (slowest rank), peak {peak} per GPU, frozen base held "
                  f"{_size(row['base_bytes_per_gpu'])} of {_size(row['base_bytes_total'])} per process", flush=True)
        else:
            print(f"{name} {mode}: {row.get('error') or row['note']}", flush=True)
        if a.out:
            merge_rows(a.out, [row], meta)
    if a.out and acc.is_main_process:
        print(f"wrote {a.out}")
    acc.wait_for_everyone()
    return 1 if failed else 0


def layer_inputs(dev, dtype, M: int, K: int, N: int) -> tuple[torch.Tensor, ...]:
    """(gy [M, N], x [M, K], A [16, K] fp32, B [N, 16] fp32, s): one layer's backward inputs, seeded."""
    g = torch.Generator(dev).manual_seed(0)
    gy = torch.randn(M, N, device=dev, dtype=dtype, generator=g)
    x = torch.randn(M, K, device=dev, dtype=dtype, generator=g)
    A = torch.randn(16, K, device=dev, generator=g) / K ** 0.5
    B = torch.randn(N, 16, device=dev, generator=g) / 4
    return gy, x, A, B, torch.tensor(2.0, device=dev)


def layer_microbench(dev, smoke, repeats) -> list[dict]:
    """LoRA backward of one layer: what an eager training step runs (on CUDA with half activations the backward of
    fdlora.kernels.train_ops' Function, from the hs = s h, A and s B its forward kept; else the registered op) vs the
    PEFT-style torch path; `op_ms` times the registered op (what torch.compile traces) too.

    Two measures. `gpu_x_torch`: the LoRA products alone, grad_x's LoRA part returned as its own tensor on both
    sides. `layer_lora_x_torch`: what the LoRA part adds to the whole layer's backward, each side's layer backward
    less the frozen base's alone (grad_x = gy W, one GEMM): fd-lora's layer adds gy W into its grad_x by the base
    GEMM itself (addmm_, reading grad_x once more), PEFT's autograd sums the base's and the LoRA branch's grad_x of
    the shared input (an add over [M, K], reading two and writing one), which the first measure leaves out."""
    from fdlora.kernels import train_ops
    from fdlora.kernels.ops import lora_train

    dtype = torch.float32 if smoke else torch.bfloat16
    M = 64 if smoke else 8192
    shapes = [(64, 96)] if smoke else [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]
    rows = []
    for K, N in shapes:
        gy, x, A, B, s = layer_inputs(dev, dtype, M, K, N)
        W = torch.randn(N, K, device=dev, dtype=dtype, generator=torch.Generator(dev).manual_seed(1)) / K ** 0.5
        h = (x.float() @ A.t())

        def op(gy=gy, x=x, h=h, A=A, B=B, s=s, W=None):  # the registered op (what torch.compile traces)
            return torch.ops.fdlora.lora_train_linear_backward(gy, x, h, W, A, B, s)

        Ab, Bb, hb = A.to(dtype), B.to(dtype), h.to(dtype)
        half = dev.type == "cuda" and dtype != torch.float32 and env.train_backward() != "triton"
        if half:  # what an eager step's forward kept (fdlora.kernels.train_ops._Linear with half_casts)
            Ac, sA, _, sB = lora_train.half_casts(A, B, s, dtype)
            hs = torch.nn.functional.linear(x, sA)

            def fd(gy=gy, x=x, hs=hs, Ac=Ac, sB=sB, W=None):
                return train_ops.half_backward(gy, x, hs, W, Ac, sB, None)
        else:
            fd = op

        def torch_path(gy=gy, x=x, s=s, hb=hb, Ab=Ab, Bb=Bb):  # autograd's work for lora_B(lora_A(x)) * s
            gys = gy * s.to(dtype)
            gB = gys.t() @ hb
            gh = gys @ Bb
            gA = gh.t() @ x
            gx = gh @ Ab
            return gx, gA, gB

        def base(gy=gy, W=W):  # a frozen layer's backward: its input gradient alone
            return gy @ W

        def fd_layer(W=W, fd=fd):
            return fd(W=W)

        def torch_layer(gy=gy, W=W):  # the base's grad_x plus the LoRA branch's, summed as autograd sums them
            gx, gA, gB = torch_path()
            return (gy @ W).add_(gx), gA, gB

        a, b = fd(), torch_path()
        err = max(float((p.float() - q.float()).abs().max() / q.float().abs().max()) for p, q in zip(a, b))
        a, b = fd_layer(), torch_layer()
        err_layer = max(float((p.float() - q.float()).abs().max() / q.float().abs().max()) for p, q in zip(a, b))
        t_fd = median_ms(fd, repeats, dev.type)
        t_torch = median_ms(torch_path, repeats, dev.type)
        t_op = median_ms(op, repeats, dev.type) if half else t_fd
        row = {"M": M, "K": K, "N": N, "r": 16, "dtype": str(dtype).split(".")[-1], "fd_ms": t_fd,
               "torch_ms": t_torch, "layer_x_torch": t_fd / t_torch, "op_ms": t_op, "rel_err_vs_torch": err,
               "layer_rel_err_vs_torch": err_layer,
               "fd_backward": env.train_backward() if dev.type == "cuda" else "reference"}
        if dev.type == "cuda" and importlib.util.find_spec("triton") is not None:  # the opt-in fused kernels too
            from fdlora.kernels.triton.train.lora_backward import lora_backward

            t_tri = median_ms(lambda a=(gy, x, h, None, A, B, s): lora_backward(*a), repeats, dev.type)
            row.update(triton_ms=t_tri, triton_x_torch=t_tri / t_torch)
        if dev.type == "cuda":  # GPU time (CUDA graph replays, L2 flushed): what the backward adds to a GPU-bound step
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from bench_delta import gpu_us

            g_fd, g_torch = gpu_us(fd), gpu_us(torch_path)
            rounds = [list(r) for r in zip(*(  # replays in turn (the GPU's clocks drift), us
                [t * 1e3 for t in ts] for ts in graphs_ms([base, fd_layer, torch_layer], 60)))]
            g_base, g_fd_layer, g_torch_layer = (statistics.median(r[i] for r in rounds) for i in range(3))
            row.update(fd_gpu_us=g_fd, torch_gpu_us=g_torch, gpu_x_torch=g_fd / g_torch, base_gpu_us=g_base,
                       fd_layer_gpu_us=g_fd_layer, torch_layer_gpu_us=g_torch_layer,
                       layer_lora_x_torch=statistics.median((f - b) / (t - b) for b, f, t in rounds),
                       layer_whole_x_torch=g_fd_layer / g_torch_layer,
                       layer_rounds_us=[[round(v, 1) for v in r] for r in rounds])
        rows.append(row)
        del gy, x, W
    return rows


def environment(dev) -> dict:
    import diffusers
    import peft
    import transformers

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        sha = None
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    return {"device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": tv, "diffusers": diffusers.__version__, "peft": peft.__version__,
            "transformers": transformers.__version__, "git_sha": sha}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="toy shapes on CPU: every code path, no meaningful numbers")
    p.add_argument("--cases", nargs="*", default=list(CASES) + ["layer"])
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps per framework")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--ddp", action="store_true", help="under accelerate launch: fd-lora step time with the global "
                   "batch split over the processes, the model replicated (DDP); rows merged into --out")
    p.add_argument("--fsdp", action="store_true", help="under accelerate launch: the same with the frozen base "
                   "sharded as `fdlora train` shards it (FSDP2); with --ddp, both modes in one launch")
    p.add_argument("--blocked", action="store_true", help="time each run's steps one after another instead of in "
                   "turn (the order before session 28; a shared host's slow spells then fall on one run)")
    a = p.parse_args(argv)
    if a.ddp or a.fsdp:
        return run_multi(a)
    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    steps = a.steps or (2 if a.smoke else 30)
    result = {"env": environment(dev), "smoke": a.smoke, "targets": TARGETS, "cases": [], "layer": []}
    for name in a.cases:
        if name == "layer":
            result["layer"] = layer_microbench(dev, a.smoke, 3 if a.smoke else 50)
            for r in result["layer"]:
                print(f"layer M={r['M']} K={r['K']} N={r['N']}: fd {r['fd_ms']:.3f} ms (op {r['op_ms']:.3f}), "
                      f"torch {r['torch_ms']:.3f} ms"
                      f" ({r['layer_x_torch']:.2f}x, target <= {TARGETS['layer_x_torch']}; {r['fd_backward']})"
                      + (f"; triton kernels {r['triton_ms']:.3f} ms ({r['triton_x_torch']:.2f}x)" if "triton_ms" in r
                         else "")
                      + (f"; GPU time fd {r['fd_gpu_us']:.0f} us, torch {r['torch_gpu_us']:.0f} us "
                         f"({r['gpu_x_torch']:.2f}x); in the layer: base {r['base_gpu_us']:.0f} us, fd "
                         f"{r['fd_layer_gpu_us']:.0f}, torch {r['torch_layer_gpu_us']:.0f}, LoRA part "
                         f"{r['layer_lora_x_torch']:.2f}x" if "fd_gpu_us" in r else ""), flush=True)
            continue
        row = run_case(name, dev, a.smoke, steps, a.blocked)
        result["cases"].append(row)
        print(f"{name}: fd-lora {row['fd_ms']:.1f} ms/step vs PEFT {row['peft_ms']:.1f} "
              f"({row['step_x_peft']:.2f}x, per round {row['round_ratio_median']:.2f}x; each layer casting its own "
              f"{row['own_casts_x_peft']:.2f}x; host CPU per step {row['cpu_x_peft']:.2f}x); "
              f"peak {row['fd_peak_gib']:.2f} vs {row['peft_peak_gib']:.2f} GiB; "
              f"grads vs PEFT {row['grad_rel_err']:.1e} ({'ok' if row['checked'] else 'MISMATCH'}); "
              f"floor (no LoRA) {row['floor_ms']:.1f} ms = {row['floor_x_peft']:.2f}x PEFT", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return 0 if all(r["checked"] for r in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
