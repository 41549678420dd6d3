"""The reliability suite on CUDA (issue 28): the soak, concurrent calls, CUDA graphs and torch.compile, each over
many adapter loads, deletes, switches and slider moves. Outputs are checked against a float64 oracle (or the same
call run alone); GPU memory is read at the same point of two cycles, so whatever a cycle leaves behind shows as
growth. Figures go under "gpu" -> the device's name in the figures file (conftest.gpu_figures).
GPU-marked (skipped without CUDA).

Where memory is read (`_settle`), pending frees are collected and the device synchronized; torch's per-stream cuBLAS
workspaces are cleared only where threads may have made new ones, never while a captured graph is alive (its replays
use the workspace it captured). memory_reserved is read without emptying the cache: it grows only when the
allocator must map a new segment, which is what a leak or a fragmenting allocation pattern does. Every tensor these
tests make in a cycle is under 1 MiB, so it comes from the allocator's small pool, whose segments are 2 MiB: one
segment is the slack for reserved memory (RESERVED_SLACK). Allocated memory has no slack: at the same point of a
later cycle the same tensors are alive, and the allocator counts each block at its rounded size, so the count is the
same.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import json
import random
import shutil
import threading

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save
from support import loras, tiny
from support.threads import run_threads

import fdlora
from fdlora import LoraAdapter, ModuleLora
from fdlora.hub import load_adapters
from fdlora.runtime.scope import lock_of

from .conftest import scaled

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
DTYPE = torch.float16
PATHS = ("0", "2", "4")
N_SOAK, N_MOVES, N_COMPILED = 200, 200, 100
RESERVED_SLACK = 2 << 20  # one segment of the caching allocator's small pool (blocks up to 1 MiB)


# --- a tiny MLP, its adapters and its float64 oracle -------------------------------------------------------------


def _mlp(dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 384), torch.nn.GELU(), torch.nn.Linear(384, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 128)).to(dev, DTYPE).eval()


def _loras(base: torch.nn.Module, ranks: dict[str, int]) -> dict[str, loras.Lora]:
    shapes = tiny.shapes(base, PATHS)
    return {name: loras.make_lora(shapes, rank=r, seed=i + 1) for i, (name, r) in enumerate(ranks.items())}


def _adapter(lora: loras.Lora) -> LoraAdapter:
    return LoraAdapter({p: ModuleLora(A, B, alpha=lora.alpha(p)) for p, (A, B) in lora.weights.items()})


@torch.no_grad()
def _oracle(base: torch.nn.Module, x: torch.Tensor, blend: dict[str, float], los: dict[str, loras.Lora],
            dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The MLP's forward in `dtype`, each targeted layer plus sum_a w_a alpha_a / r_a (h A_a^T) B_a^T."""
    h = x.to(dtype)
    for name, mod in base.named_children():
        if not isinstance(mod, torch.nn.Linear):
            h = mod(h)
            continue
        y = F.linear(h, mod.weight.to(dtype), mod.bias.to(dtype))
        for a, w in blend.items():
            A, B = los[a].weights[name]
            y = y + (w * los[a].alpha(name) / A.shape[0]) * ((h @ A.to(h).T) @ B.to(h).T)
        h = y
    return h


def _samples_oracle(base, x, specs, los, dtype=torch.float64) -> torch.Tensor:
    """Per-sample calls: sample i under specs[i] (a name, None or {name: weight})."""
    blends = [{} if s is None else {s: 1.0} if isinstance(s, str) else s for s in specs]
    return torch.stack([_oracle(base, x[i:i + 1], b, los, dtype)[0] for i, b in enumerate(blends)])


def _check(got: torch.Tensor, want: torch.Tensor, eager: torch.Tensor, what: str) -> float:
    """`got` (fd-lora, fp16) against the float64 oracle `want`, within a bound derived from eager PyTorch's own error in
    fp16 (`eager`: the oracle's math run in fp16) plus about one fp16 ulp of the output's largest value; returns it."""
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    amax = float(want.abs().max())
    bound = 4 * float((eager.double() - want).abs().max()) + 1e-3 * amax
    err = float((got.double() - want).abs().max())
    assert err <= bound, f"{what}: max error {err:.3g} against the float64 oracle, bound {bound:.3g}"
    return bound


def _blend_check(got, base, x, blend, los, what) -> tuple[torch.Tensor, float]:
    want = _oracle(base, x, blend, los)
    return want, _check(got, want, _oracle(base, x, blend, los, DTYPE), what)


def _samples_check(got, base, x, specs, los, what) -> tuple[torch.Tensor, float]:
    want = _samples_oracle(base, x, specs, los)
    return want, _check(got, want, _samples_oracle(base, x, specs, los, DTYPE), what)


# --- memory ----------------------------------------------------------------------------------------------------


def _settle(dev: torch.device, workspaces: bool = False) -> tuple[int, int]:
    """(allocated, reserved) bytes once pending frees are done; (0, 0) off CUDA (a dry run of the logic)."""
    gc.collect()
    if dev.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(dev)
    if workspaces:  # per-(cuBLAS handle, stream) workspaces: a thread may take a handle no earlier call used
        getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
    return torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)


def _live_tensors(dev: torch.device) -> int:
    gc.collect()
    return sum(isinstance(o, torch.Tensor) and o.device.type == dev.type for o in gc.get_objects())


def _assert_flat(what: str, before: tuple[int, int], after: tuple[int, int]) -> tuple[int, int]:
    grown, reserved = after[0] - before[0], after[1] - before[1]
    assert grown <= 0, f"{what}: {grown} more bytes allocated"
    assert reserved <= RESERVED_SLACK, f"{what}: the allocator reserved {reserved} more bytes"
    return grown, reserved


# --- 1. the soak -------------------------------------------------------------------------------------------------


def soak(dev: torch.device, n: int, tmp_path) -> dict:
    """load (a file) -> blend -> eager call -> per-prompt calls (grouped, and per-row at decode size) -> delete, `n`
    times; two files of different ranks alternate into the same slot. Every cycle's outputs must be bit-identical to
    the first cycle's with that file; the first two are checked against the oracle; memory is read after `warm`
    cycles (two of each file: every kernel shape autotuned, every per-prompt copy made) and at the end."""
    model = _mlp(dev)
    base = copy.deepcopy(model)
    los = _loras(base, {"keeper": 4, "f8": 8, "f16": 16})
    files = []
    for name in ("f8", "f16"):
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(save(loras.peft_state(los[name])))
        files.append((name, p))
    h = fdlora.inject(model, list(PATHS), max_slots=4, max_rank=16)
    h.add_adapter(_adapter(los["keeper"]).to(device=dev, dtype=DTYPE), "keeper")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=g).to(dev, DTYPE)
    xs = torch.randn(4, 64, 256, generator=g).to(dev, DTYPE)  # per-prompt at diffusion size: per-blend copies
    xd = torch.randn(4, 1, 256, generator=g).to(dev, DTYPE)  # per-prompt at decode size: the per-row kernel
    first: dict[str, tuple[torch.Tensor, ...]] = {}

    def cycle(i: int) -> None:
        key, path = files[i % 2]
        name = f"cycle{i}"
        h.add_adapter(load_adapters(path, cache=None)[0]["model"], name, activate=False)
        blend = {"keeper": 0.5, name: 0.7}
        specs = ["keeper", name, None, blend]
        h.set_adapters(list(blend), list(blend.values()))
        with torch.no_grad():
            y = model(x)
            with fdlora.per_sample(model, specs):
                ys, yd = model(xs), model(xd)
        h.delete_adapter(name)
        if key not in first:
            first[key] = (y.clone(), ys.clone(), yd.clone())
        if i < 2:  # the first cycle of each file, against the oracle
            named = {**los, name: los[key]}
            want, bound = _blend_check(y, base, x, blend, named, f"cycle {i}: blend")
            effect = float((want - _oracle(base, x, {"keeper": 0.5}, named)).abs().max())
            assert effect > 20 * bound, f"the adapter's effect ({effect:.3g}) would hide in the bound ({bound:.3g})"
            _samples_check(ys, base, xs, specs, named, f"cycle {i}: per-prompt")
            _samples_check(yd, base, xd, specs, named, f"cycle {i}: per-prompt, decode size")
        for a, b, what in zip((y, ys, yd), first[key], ("blend", "per-prompt", "per-prompt at decode size")):
            assert torch.equal(a, b), f"cycle {i}: the {what} output of keeper + {key} changed"

    warm = min(4, n - 1)
    for i in range(warm):
        cycle(i)
    mem0, tensors0 = _settle(dev), _live_tensors(dev)
    for i in range(warm, n):
        cycle(i)
    mem1, tensors1 = _settle(dev), _live_tensors(dev)
    assert h.list_adapters() == ["keeper"]
    grown, reserved = _assert_flat(f"{n - warm} load/blend/call/delete cycles", mem0, mem1)
    assert tensors1 <= tensors0, f"{tensors1 - tensors0} more live {dev.type} tensors after {n - warm} cycles"
    h.restore()
    return {"cycles": n, "allocated_growth_bytes": grown, "reserved_growth_bytes": reserved,
            "live_tensor_growth": tensors1 - tensors0}


def test_soak_on_cuda(gpu_figures, tmp_path):
    gpu_figures["soak"] = soak(CUDA, scaled(N_SOAK), tmp_path)


# --- 2. threads --------------------------------------------------------------------------------------------------


def _louder(src: str, dst, k: float) -> str:
    """A copy of the PEFT folder `src` whose alphas are `k` times larger (its delta k times larger)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["lora_alpha"] *= k
    cfg["alpha_pattern"] = {p: a * k for p, a in (cfg.get("alpha_pattern") or {}).items()}
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def threads(dev: torch.device, tmp_path) -> dict:
    """test_concurrency's scenario on a Transformers model served by fd-lora on `dev`: threads of per-row calls
    (adapter_names), of per-row blends (fd_lora_adapters), of generates and of blends for one call (set, called and
    undone under the model's lock, as a server scopes them: adapter_names rows apply an active adapter at its blend
    weight), while another thread loads and deletes an adapter no call names.

    Each output is compared with the same call run alone, within 1% of the logits' scale: the churned adapter
    changes how many bank slots the kernels walk, so their tiles may sum in another order (on the CPU every output
    is bit-exact), while another row's adapters would be off by over 10% (asserted). The first threaded round makes
    each thread's cuBLAS handle and workspace (pooled: later threads reuse them); memory is read after it and after
    a second round."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from integrations.transformers.models import built, ids

    b = built("llama")
    # test_concurrency's adapters, "two" (one module kind) 8x as loud: its effect on the logits then stands well
    # clear of the tolerance (a louder "one" overflows fp16)
    dirs = {"one": b.dirs["one"], "two": _louder(b.dirs["two"], tmp_path / "two", 8.0)}
    model = fdlora.load_fd_lora(copy.deepcopy(b.base).to(dev, DTYPE), dirs["one"], "one")
    fdlora.load_fd_lora(model, dirs["two"], "two")
    model.generation_config.pad_token_id = 0
    rng = random.Random(0)
    names = ["one", "two", "__base__"]
    blends = ["one", "two", None] + [{"one": w, "two": 1 - w} for w in (0.25, 0.5, 0.75)]

    def batch(rows, seq):
        return ids(rows, seq, seed=rng.randrange(1000)).to(dev)

    calls = {  # kind -> per thread: [(input ids, spec)]
        "adapter_names": [[(batch(3, 5), [rng.choice(names) for _ in range(3)]) for _ in range(20)] for _ in range(3)],
        "fd_lora_adapters": [[(batch(3, 5), [rng.choice(blends) for _ in range(3)]) for _ in range(20)]],
        "set_adapters": [[(batch(2, 5), rng.choice([(["one"], [0.6]), (["two"], [1.0]), (["one", "two"], [0.3, 0.9])]))
                          for _ in range(20)]],
        "generate": [[(batch(2, 4), [rng.choice(names) for _ in range(2)]) for _ in range(4)]],
    }

    def call(kind, x, spec):
        if kind == "adapter_names":
            return model(x, adapter_names=spec).logits
        if kind == "fd_lora_adapters":
            return model(x, fd_lora_adapters=spec).logits
        if kind == "generate":
            return model.generate(x, adapter_names=spec, max_new_tokens=4, do_sample=False)
        with lock_of(model):
            saved = dict(fdlora.handle(model).state.active)
            fdlora.set_adapters(model, *spec)
            try:
                return model(x).logits
            finally:
                fdlora.set_adapters(model, list(saved), list(saved.values()))

    def alone():
        with torch.no_grad():
            return {k: [[call(k, x, s) for x, s in work] for work in per] for k, per in calls.items()}

    want = alone()
    assert all(torch.isfinite(y).all() for per in want.values() for ys in per for y in ys)
    probe = batch(1, 5)  # the adapters' effects, against which a bleed would have to hide
    with torch.no_grad():
        outs = [model(probe, adapter_names=[n]).logits.double() for n in names]
    tol = 1e-2 * max(float(o.abs().max()) for o in outs)
    effect = min(float((outs[i] - outs[j]).abs().max()) for i in range(3) for j in range(i))
    assert effect > 10 * tol, f"the adapters' effects ({effect:.3g}) would hide in the tolerance ({tol:.3g})"
    stats = {"calls": 0, "bit_exact": 0, "bleed": []}

    def compare(got, label):
        for k in calls:
            for t, (g, w) in enumerate(zip(got[k], want[k])):
                for i, (a, e) in enumerate(zip(g, w)):
                    stats["calls"] += 1
                    stats["bit_exact"] += bool(torch.equal(a, e))
                    if a.shape != e.shape or float((a.double() - e.double()).abs().max()) > tol:
                        stats["bleed"].append((label, k, t, i))

    model.load_adapter(b.dirs["two"], "churn")  # every call alone with it loaded too: whatever that allocates once
    compare(alone(), "churn loaded")
    model.delete_adapter("churn")

    def worker(kind, t, got):
        def run():
            with torch.no_grad():
                got[kind][t] = [call(kind, x, s) for x, s in calls[kind][t]]
        return run

    churned = [0]

    def churn(stop):
        while not stop.is_set():
            model.load_adapter(b.dirs["two"], "churn")
            model.delete_adapter("churn")
            churned[0] += 1

    def threaded(label):
        got = {k: [None] * len(per) for k, per in calls.items()}
        stop = threading.Event()
        ch = threading.Thread(target=churn, args=(stop,))
        ch.start()
        try:
            run_threads([worker(k, t, got) for k, per in calls.items() for t in range(len(per))])
        finally:
            stop.set()
            ch.join(timeout=60)
        compare(got, label)

    threaded("first round")
    mem0 = _settle(dev, workspaces=True)
    threaded("second round")
    mem1 = _settle(dev, workspaces=True)
    assert not stats["bleed"], f"{len(stats['bleed'])} calls got other adapters: {stats['bleed'][:5]}"
    assert churned[0] > 0 and sorted(fdlora.handle(model).list_adapters()) == ["one", "two"]
    grown, reserved = _assert_flat("a threaded round", mem0, mem1)
    n = sum(len(w) for per in calls.values() for w in per)
    return {"concurrent_requests": 2 * n, "bleed": len(stats["bleed"]), "bit_exact": stats["bit_exact"],
            "compared": stats["calls"], "churn_cycles": churned[0], "allocated_growth_bytes": grown,
            "reserved_growth_bytes": reserved}


def test_threads_on_cuda_never_bleed(gpu_figures, tmp_path):
    gpu_figures["threads"] = threads(CUDA, tmp_path)


# --- 3. CUDA graphs and compiled graphs --------------------------------------------------------------------------


def _moves(n: int, seed: int) -> list[dict[str, float]]:
    """`n` blends of adapters a and b, each weight at least 0.2 away from the previous move's (so a move the next
    call missed shows as an error well over the bound)."""
    rng, out, prev = random.Random(seed), [], {}
    grid = [round(-1 + 0.1 * k, 1) for k in range(21)]
    for i in range(n):
        names = (["a"], ["b"], ["a", "b"])[i % 3]
        out.append(prev := {a: rng.choice([w for w in grid if abs(w - prev.get(a, 9)) >= 0.2 and w]) for a in names})
    return out


def _adapted_mlp(dev: torch.device):
    model = _mlp(dev)
    base = copy.deepcopy(model)
    los = _loras(base, {"a": 8, "b": 16, "c": 4})
    for name in ("a", "b"):
        fdlora.add_adapter(model, _adapter(los[name]).to(device=dev, dtype=DTYPE), name, max_rank=16)
    return model, base, los


def captured(dev: torch.device, n: int, mechanism=None) -> dict:
    """fdlora.capture_steps: `n` blend moves between replays (a per-prompt call with new weights every fourth), each
    replay equal to the oracle and unlike the previous move's oracle; no capture after the first of each mode, and
    GPU memory and the merge-cache budget flat from the end of the first round on."""
    model, base, los = _adapted_mlp(dev)
    runner = fdlora.capture_steps(model, mechanism=mechanism)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, 256, generator=g).to(dev, DTYPE)
    xs = torch.randn(4, 64, 256, generator=g).to(dev, DTYPE)
    moves = _moves(n, seed=2)
    prev: dict[str, torch.Tensor] = {}

    def step(i: int) -> None:
        blend = moves[i]
        fdlora.set_adapters(model, list(blend), list(blend.values()))
        with torch.no_grad():
            y = model(x)
        want, bound = _blend_check(y, base, x, blend, los, f"move {i}: {blend}")
        if "blend" in prev:
            missed = float((y.double() - prev["blend"]).abs().max())
            assert missed > bound, f"move {i}: the replay still matches the previous move's blend"
        prev["blend"] = want
        if i % 4 == 0:
            w = (0.3, 0.8)[i // 4 % 2]  # the per-prompt blend moves too
            specs = ["a", None, {"a": w, "b": -w}, "b"]
            with torch.no_grad(), fdlora.per_sample(model, specs):
                ys = model(xs)
            want, bound = _samples_check(ys, base, xs, specs, los, f"move {i}: per-prompt {specs}")
            if "samples" in prev:
                assert float((ys.double() - prev["samples"]).abs().max()) > bound, f"move {i}: per-prompt missed"
            prev["samples"] = want

    warm = min(4, n - 1)  # one of each kind: both modes captured
    for i in range(warm):
        step(i)
    graphs0, mem0, cache0 = runner.captures, _settle(dev), fdlora.merge_cache_bytes(dev)
    assert graphs0 == 2 and len(runner.graphs) == 2, f"{runner.captures} captures for 2 modes of one shape"
    for i in range(warm, n):
        step(i)
    graphs1, mem1, cache1 = runner.captures, _settle(dev), fdlora.merge_cache_bytes(dev)
    assert graphs1 == graphs0 and len(runner.graphs) == graphs0, f"{graphs1 - graphs0} captures after the first"
    assert runner.replays == n + len(range(0, n, 4))  # every call: a capture is replayed too
    assert cache1 == cache0, f"the merge-cache budget grew by {cache1 - cache0} bytes"
    grown, reserved = _assert_flat(f"{n - warm} moves between replays", mem0, mem1)
    fdlora.release_steps(model)
    return {"moves": n, "captures_before": graphs0, "captures_after": graphs1, "replays": runner.replays,
            "allocated_growth_bytes": grown, "reserved_growth_bytes": reserved}


def test_cuda_graphs_do_not_grow_over_switches(gpu_figures):
    gpu_figures["cuda_graphs"] = captured(CUDA, scaled(N_MOVES))


def compiled(dev: torch.device, n: int, backend: str = "inductor") -> dict:
    """torch.compile(fullgraph=True) of the frozen MLP: `n` blend moves, with a load into a free slot and its delete
    every tenth, each call equal to the oracle and unlike the previous move's; error_on_recompile is set and the
    count of unique graphs is the same after the moves as after the first call."""
    from torch._dynamo.utils import counters

    model, base, los = _adapted_mlp(dev)
    h = fdlora.handle(model)
    h.freeze()
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(8, 16, 256, generator=torch.Generator().manual_seed(1)).to(dev, DTYPE)
    moves = _moves(n, seed=3)
    prev = None
    try:
        with torch.no_grad():
            fn(x)
            graphs0 = counters["stats"]["unique_graphs"]
            with torch._dynamo.config.patch(error_on_recompile=True):
                for i, blend in enumerate(moves):
                    if i % 10 == 5:
                        h.add_adapter(_adapter(los["c"]).to(device=dev, dtype=DTYPE), "c", activate=False)
                        blend = {**blend, "c": 0.8}
                    h.set_adapters(list(blend), list(blend.values()))
                    y = fn(x)
                    want, bound = _blend_check(y, base, x, blend, los, f"move {i}: {blend}")
                    if prev is not None:
                        assert float((y.double() - prev).abs().max()) > bound, f"move {i}: the call missed the move"
                    prev = want
                    if "c" in blend:
                        h.delete_adapter("c")
        graphs1 = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs0 >= 1 and graphs1 == graphs0, f"{graphs1 - graphs0} graphs compiled after the first call"
    h.restore()
    return {"moves": n, "loads": len(range(5, n, 10)), "backend": backend, "graphs_before": graphs0,
            "graphs_after": graphs1}


def test_compiled_graphs_do_not_grow_over_switches(gpu_figures):
    backend = "inductor" if importlib.util.find_spec("triton") else "aot_eager"  # inductor's CUDA code is Triton
    gpu_figures["compiled"] = compiled(CUDA, scaled(N_COMPILED), backend)
