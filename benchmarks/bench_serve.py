"""Serving under load: `fdlora serve` against a diffusers + PEFT server, images/s, tail latency, faults, and every
image checked against the same request run alone on the idle server.

One run, bounded by `--budget-s` (request counts and phase time limits are scaled from it and from the measured
time of one image; loopback only):

1. The fd-lora server: 8 random rank-16 adapters (safetensors files in a temporary folder) over 4 slots
   (`adapters_per_replica: 4`, so adapters are evicted and come back), per-request adapters batched into one
   per-prompt call. With Ray Serve importable this is `fdlora serve` (fdlora.serve.deployment) on a local Ray
   cluster; without it, the replica engine (fdlora.serve.engine) behind the same HTTP app (FastAPI + uvicorn, or
   a stdlib threaded server where those are missing) in this process, batched the way `@serve.batch` batches;
   the JSON says which (`ray`, `ray_reason`, `http`).
2. A pool of distinct requests (one adapter or a two-adapter blend each, seeded) run alone on the idle server:
   the reference images. Load requests draw from the pool at random (seeded), and every response is compared
   with its reference (<= 1/255 per pixel after PNG); mismatches are counted.
3. Closed loop with 16, 1 and 4 clients (16 measures saturation, first, so a slow host still gets it), then
   open-loop Poisson arrivals at 50%, 70% and 100% of the saturated rate.
   Before the load runs, one batch of every size up to `--max-batch` (the shapes a server meets once), so the
   memory figures compare like with like.
4. Faults: a batch out of device memory (CUDA: a per-process memory cap between one image's need and a
   batch's; CPU: a UNet hook refusing the same sizes), re-run one by one, one oversized request failing alone
   with a 507; clients disconnecting mid-generation and while queued; an adapter file corrupted on disk after
   start-up, failing only the requests that name it. A request afterwards must be served.
5. The baseline: the same HTTP app and pipeline with diffusers + PEFT (`load_lora_weights` of the same files,
   `set_adapters` per request, one request at a time under a lock), closed loop with 1 and 4 clients, in a fresh
   process of its own. The load runs' callers run in another process, so the RSS figures are the server's.

Reported: sent / served / failed by reason / lost (no answer) per run and in total, throughput, p50/p99 latency,
torch.cuda.memory_allocated and RSS before and after the load runs (with the parts of the RSS that are bounded caches:
the in-RAM adapter cache and torch's pinned host blocks), the base pipeline's images/s at the largest batch (the
ceiling of any LoRA server here), device and versions.

    python benchmarks/bench_serve.py --model sdxl --budget-s 540 --out $OUT/serve.json   # one H200, 9 min
    (alone on its host: the eager SDXL step is host-bound; below ~500 s the 16-client run does not fit and is skipped)
    python benchmarks/bench_serve.py --model tiny --budget-s 20 --out /tmp/serve.json    # CPU, the whole flow
    python benchmarks/bench_serve.py --model sdxl --budget-s 560 --soak --steps 5 --max-requests 1000 --out soak.json
    (one 16-client run as long as the budget allows, memory read every 15 s, then the faults; `--faults-only`: the
    faults alone)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_harness import (  # noqa: E402
    MEMORY_KEYS,
    LocalServer,
    RayServer,
    compare,
    disconnecting,
    max_diff,
    post,
)

PROMPTS = ["a castle on a hill", "a cat in a hat", "a red bicycle by a lake", "an old lighthouse at dusk"]
MODELS = {"sdxl": dict(size=1024, steps=20, dtype="float16"), "tiny": dict(size=64, steps=2, dtype="float32")}


def args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="sdxl")
    ap.add_argument("--budget-s", type=float, default=480, help="wall-clock budget of the whole run")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=4, help="adapters_per_replica")
    ap.add_argument("--max-batch", type=int, default=8, help="requests gathered into one batch")
    ap.add_argument("--max-call", type=int, default=None, help="images per pipeline call (default: --max-batch)")
    ap.add_argument("--batch-wait-s", type=float, default=0.05)
    ap.add_argument("--pool", type=int, default=8, help="distinct requests (each run alone once for reference)")
    ap.add_argument("--max-requests", type=int, default=64, help="cap on the requests of one load run")
    ap.add_argument("--no-ray", action="store_true", help="the in-process engine even where Ray Serve imports")
    ap.add_argument("--http", choices=["auto", "fastapi", "stdlib"], default="auto")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps of every request (default: the "
                    "model's, 20 for sdxl); fewer steps fit more requests into one budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults-only", action="store_true", help="the idle references, the warm-up and the faults only")
    ap.add_argument("--soak", action="store_true", help="the references, the warm-up, one 16-client run until the "
                    "budget's end or --max-requests with memory read every 15 s, then the faults")
    return ap.parse_args(argv)


# --- pipelines and adapters ---------------------------------------------------------------------------------------
def sdxl_pipeline(device, dtype, seed: int = 0):
    """SDXL base 1.0 from its configs with random weights (UNet, CLIP-L, OpenCLIP bigG, VAE), built on the device."""
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from fdlora.fixtures import fullsize
    from fdlora.fixtures.tiny_pipeline import clip_tokenizer

    unet = fullsize.sdxl_unet(device, dtype, seed=seed)
    text = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                hidden_act="gelu")
    with fullsize.built_on(device, dtype):
        te1 = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                           num_hidden_layers=12, **text))
        te2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, intermediate_size=5120,
                                                         num_attention_heads=20, num_hidden_layers=32,
                                                         projection_dim=1280, **text))
        vae = AutoencoderKL(block_out_channels=[128, 256, 512, 512], in_channels=3, out_channels=3, latent_channels=4,
                            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                            layers_per_block=2, sample_size=1024, scaling_factor=0.13025, force_upcast=True)
    sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                   steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(vae=vae.eval(), text_encoder=te1.eval(), text_encoder_2=te2.eval(),
                                     tokenizer=clip_tokenizer(), tokenizer_2=clip_tokenizer(), unet=unet,
                                     scheduler=sched, force_zeros_for_empty_prompt=True)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(seed)
    return pipe


def make_pipeline(model: str, device: str):
    import torch

    dtype = getattr(torch, MODELS[model]["dtype"])
    if model == "sdxl":
        return sdxl_pipeline(device, dtype)
    from fdlora.fixtures import tiny_pipeline as tiny

    pipe = tiny.sdxl().to(device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def write_adapters(pipe, folder: Path, n: int, rank: int) -> dict[str, Path]:
    """`n` random diffusers-layout LoRA files (UNet attention, both text encoders' attention), as
    `save_lora_weights` writes them, named a0..a<n-1>."""
    import torch
    from safetensors.torch import save

    targets = {"unet": ("to_q", "to_k", "to_v", "to_out.0"), "text_encoder": ("q_proj", "k_proj", "v_proj", "out_proj"),
               "text_encoder_2": ("q_proj", "k_proj", "v_proj", "out_proj")}
    paths = {}
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + i)
        sd, meta = {}, {}
        for comp, ends in targets.items():
            model = getattr(pipe, comp)
            for name, m in model.named_modules():
                if isinstance(m, torch.nn.Linear) and name.endswith(ends):
                    a = torch.randn(rank, m.in_features, generator=g) / m.in_features ** 0.5
                    sd[f"{comp}.{name}.lora_A.weight"] = a.to(torch.float16)
                    sd[f"{comp}.{name}.lora_B.weight"] = (torch.randn(m.out_features, rank, generator=g) * 0.05).half()
            meta.update({f"{comp}.r": rank, f"{comp}.lora_alpha": rank, f"{comp}.target_modules": list(ends)})
        paths[f"a{i}"] = folder / f"a{i}.safetensors"
        paths[f"a{i}"].write_bytes(save(sd, {"format": "pt", "lora_adapter_metadata": json.dumps(meta)}))
    return paths


def request_pool(names: list[str], n: int, size: int, steps: int, seed: int) -> list[dict]:
    """Distinct requests: even ones a single adapter, odd ones a two-adapter blend; every adapter named."""
    rng = random.Random(seed)
    pool = []
    for i in range(n):
        first = names[i % len(names)]
        adapters = {first: round(rng.uniform(0.7, 1.0), 2)}
        if i % 2:
            adapters[rng.choice([x for x in names if x != first])] = round(rng.uniform(0.3, 0.6), 2)
        pool.append({"prompt": PROMPTS[i % len(PROMPTS)], "adapters": adapters, "seed": 100 + i,
                     "num_inference_steps": steps, "height": size, "width": size})
    return pool


# --- load runs -------------------------------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]


class Load:
    """One bounded run against a server: `n` requests at most, none sent after `limit_s`; closed loop (`clients`
    callers back to back) or open loop (Poisson arrivals at `rate` per second, each on its own thread)."""

    def __init__(self, url: str, pool: list[dict], refs: list[bytes] | None, n: int, limit_s: float,
                 timeout_s: float, seed: int) -> None:
        self.url, self.pool, self.refs, self.n, self.limit_s, self.timeout_s = url, pool, refs, n, limit_s, timeout_s
        self.rng = random.Random(seed)
        self.draws = [self.rng.randrange(len(pool)) for _ in range(n)]
        self.results: list[dict] = []
        self._lock = threading.Lock()

    def one(self, k: int) -> None:
        i = self.draws[k]
        t = time.perf_counter()
        status, body = post(self.url, self.pool[i], self.timeout_s)
        r = {"pool": i, "status": status, "latency_s": time.perf_counter() - t, "done": time.perf_counter()}
        if status == 200 and self.refs is not None:
            r["match"] = compare(body, self.refs[i])
        elif status not in (200, None):
            r["reason"] = _reason(body)
        with self._lock:
            self.results.append(r)

    def closed(self, clients: int) -> dict:
        nxt = iter(range(self.n))
        t0 = time.perf_counter()

        def caller():
            while time.perf_counter() - t0 < self.limit_s:
                with self._lock:
                    k = next(nxt, None)
                if k is None:
                    return
                self.one(k)

        threads = [threading.Thread(target=caller) for _ in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return self.summary(t0, {"mode": "closed", "clients": clients})

    def open(self, rate: float) -> dict:
        t0, due, threads = time.perf_counter(), 0.0, []
        for k in range(self.n):
            if due > self.limit_s:
                break
            time.sleep(max(0.0, t0 + due - time.perf_counter()))
            threads.append(threading.Thread(target=self.one, args=(k,)))
            threads[-1].start()
            due += self.rng.expovariate(rate)
        for th in threads:
            th.join()
        return self.summary(t0, {"mode": "open", "rate_rps": round(rate, 4)})

    def summary(self, t0: float, row: dict) -> dict:
        ok = [r for r in self.results if r["status"] == 200]
        wall = max([r["done"] for r in self.results], default=t0) - t0
        lat = [r["latency_s"] for r in ok]
        failed: dict[str, int] = {}
        for r in self.results:
            if r["status"] not in (200, None):
                failed[r["reason"]] = failed.get(r["reason"], 0) + 1
        return {**row, "sent": len(self.results), "served": len(ok), "failed": failed,
                "lost": sum(r["status"] is None for r in self.results),
                "mismatches": sum(not r.get("match", True) for r in ok), "wall_s": round(wall, 3),
                "throughput_ips": round(len(ok) / wall, 4) if wall > 0 else None,
                "p50_s": _r(percentile(lat, 50)), "p99_s": _r(percentile(lat, 99))}


def _reason(body: bytes | None) -> str:
    try:
        return f"{json.loads(body)['error']}"[:160]
    except (TypeError, ValueError, KeyError):
        return "unreadable error body"


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# --- one server: references, load runs, faults -----------------------------------------------------------------------
def references(server, pool: list[dict], timeout_s: float) -> tuple[list[bytes], float]:
    """Each pool request alone on the idle server (after one warm-up): the reference images, and the median
    latency of one image."""
    post(server.url, pool[0], timeout_s)
    refs, lat = [], []
    for req in pool:
        t = time.perf_counter()
        status, body = post(server.url, req, timeout_s)
        if status != 200:
            raise RuntimeError(f"reference request failed on the idle server: {status} {_reason(body)}")
        lat.append(time.perf_counter() - t)
        refs.append(body)
    return refs, statistics.median(lat) if len(lat) > 3 else min(lat)


def base_image_s(server, req: dict) -> float:
    """One image without adapters, alone on the idle server (median of three): the floor a LoRA server's image time
    is measured against."""
    lat = []
    for i in range(3):
        t = time.perf_counter()
        status, body = post(server.url, {**req, "adapters": {}, "seed": 900 + i}, 600)
        if status != 200:
            raise RuntimeError(f"base request failed on the idle server: {status} {_reason(body)}")
        lat.append(time.perf_counter() - t)
    return statistics.median(lat)


def load_profile(server, name: str, n: int = 3) -> dict:
    """`name` deleted and loaded again `n` times on the idle server (what an eviction costs a later request: the
    adapter comes back from the RAM cache), the device synchronised around each; the last one under cProfile, its
    20 costliest functions by cumulative time."""
    import cProfile
    import pstats

    import torch

    e = server.engine
    if e is None:
        return {"skipped": "the replica runs in a Ray worker"}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times, prof = [], cProfile.Profile()
    with e._lock:
        known = name in e.known()
        if not known:
            e._load(name, e.specs[name])
        for i in range(n):
            e._delete(name)
            sync()
            t = time.perf_counter()
            if i == n - 1:
                prof.enable()
            e._load(name, e.specs[name])
            sync()
            prof.disable()
            times.append(round(time.perf_counter() - t, 4))
        if not known:
            e._delete(name)
    st = pstats.Stats(prof)
    top = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:20]
    return {"adapter": name, "reload_s": times, "top_cumulative": [
        {"function": f"{Path(f).name}:{line}({fn})", "calls": nc, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)}
        for (f, line, fn), (_, nc, tt, ct, _) in top]}


def soak(a, server, pool, refs, t_img: float, end: float, runs: list, clients: int = 16, every_s: float = 15.0) -> dict:
    """One closed-loop run of `clients` callers until `end` (perf_counter) or `--max-requests`, every image compared
    with its reference, the server's memory read every `every_s` seconds meanwhile: memory over a long run at
    saturation, where a leak would climb. Each reading splits the RSS (anonymous, file-backed, adapter cache, pinned
    blocks; the C heap's bytes in use and free; Python's blocks) and counts the kinds of call run so far, so a rise
    shows whether it is data that lives, pages no trim returned, or the first calls of a new kind."""
    samples: list[dict] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def read():
        m = server.memory()
        mb = {f"{k}_mb": None if m[k] is None else round(m[k] / 2**20, 1)
              for k in MEMORY_KEYS if k not in ("cuda_allocated", "py_blocks")}
        samples.append({"t_s": round(time.perf_counter() - t0, 1), **mb, "cuda_allocated": m["cuda_allocated"],
                        "py_blocks": m["py_blocks"], "call_kinds": m["call_kinds"]})

    def sample():
        read()
        while not stop.wait(every_s):
            read()

    wait_idle()  # the first and the last reading on an idle server: like with like
    reader = threading.Thread(target=sample, daemon=True)
    reader.start()
    send_s = end - time.perf_counter() - 0.8 * t_img * clients  # the last requests still in flight when sending stops
    try:
        row = a.clients.run(server.url, pool, refs, a.max_requests, send_s, 40 * t_img + 30, a.seed + 1, "closed",
                            clients)
    finally:
        stop.set()
        reader.join()
    runs.append({"server": "fdlora", **row})
    wait_idle()
    read()
    print(f"  soak: {row}", flush=True)
    first, last = samples[0], samples[-1]
    cuda = [x["cuda_allocated"] for x in samples if x["cuda_allocated"] is not None]
    half = [x for x in samples if x["t_s"] >= last["t_s"] / 2]
    return {"clients": clients, "requests": row["sent"], "wall_s": row["wall_s"], "samples": samples,
            "rss_growth_mb": round(last["rss_mb"] - first["rss_mb"], 1),
            "growth_by_part_mb": {k[:-3]: round(last[k] - first[k], 1) for k in first
                                  if k.endswith("_mb") and k != "rss_mb" and first[k] is not None},
            "py_blocks_growth": None if first["py_blocks"] is None else last["py_blocks"] - first["py_blocks"],
            "call_kinds": [first["call_kinds"], last["call_kinds"]],
            "rss_slope_second_half_mb_per_min": _slope([x["t_s"] / 60 for x in half], [x["rss_mb"] for x in half]),
            "rss_range_mb": [min(x["rss_mb"] for x in samples), max(x["rss_mb"] for x in samples)],
            "cuda_drift_pct": round(100 * (cuda[-1] - cuda[0]) / cuda[0], 3) if cuda else None,
            "cuda_range_pct": round(100 * (max(cuda) - min(cuda)) / cuda[0], 3) if cuda else None}


def wait_idle() -> None:
    """Wait until a server that has answered everything is idle in the engine's sense: its delayed heap trim has run
    (fdlora.serve.heap.trim_later), so a memory reading shows the data that lives, not what the last answers freed."""
    from fdlora.serve import heap

    time.sleep(2 * heap.IDLE_S)


def _slope(x: list[float], y: list[float]) -> float | None:
    """The least-squares slope of y over x (None for fewer than three points, or all at one x)."""
    if len(x) < 3:
        return None
    try:
        return round(statistics.linear_regression(x, y).slope, 2)
    except statistics.StatisticsError:
        return None


def warm_shapes(server, pool: list[dict], max_batch: int, t_img: float) -> dict:
    """One batch of every size up to `max_batch` (the largest pipeline call; distinct pool requests, so mixed
    adapters), then batches of `max_batch` in which one request is repeated 2..`max_batch` times beside another
    (under load, clients drawing from the same pool send the same adapters in groups, and a group's size sets its
    GEMMs' rows on the per-prompt path), all at two denoising steps, since every step has the same shapes. Before
    memory is first read: the kernels, library workspaces and allocator pools a server meets with each new shape are
    in place, so the RSS and device-memory figures after the load runs show what serving adds, not what a first shape
    does. The idle server's RSS is read before, between and after (`rss_mb`)."""
    t, sizes, steps = time.perf_counter(), list(range(2, max_batch + 1)), min(2, pool[0]["num_inference_steps"])
    groups = list(range((max_batch + 1) // 2, max_batch + 1)) if len(pool) > 1 else []  # g and max_batch - g
    batches = [[pool[(b + i) % len(pool)] for i in range(b)] for b in sizes]
    batches += [[pool[0]] * g + [pool[1]] * (max_batch - g) for g in groups]
    rss = [round(server.memory()["rss"] / 2**20, 1)]
    for k, batch in enumerate(batches):
        reqs = [{**r, "num_inference_steps": steps, "seed": 800 + 10 * k + i} for i, r in enumerate(batch)]
        bad = [s for s, _ in burst(server.url, reqs, 40 * t_img + 30) if s != 200]
        if bad:
            raise RuntimeError(f"warm-up batch {k} of {len(batch)} failed on the idle server: {bad}")
        if k in (len(sizes) - 1, len(batches) - 1):
            wait_idle()
            rss.append(round(server.memory()["rss"] / 2**20, 1))
    return {"batch_sizes": [1, *sizes], "group_sizes": sorted({*groups, *(max_batch - g for g in groups)} - {0}),
            "rss_mb": rss, "s": round(time.perf_counter() - t, 1)}


def base_ceiling(server, pool: list[dict], n: int, t_img: float) -> dict:
    """`n` requests without adapters sent together (one batch of the base pipeline), twice: the images/s of the base
    model at this batch size through the same server, the most any LoRA server can reach on this GPU."""
    best = None
    for rep in range(2):
        reqs = [{**pool[i % len(pool)], "adapters": {}, "seed": 700 + 10 * rep + i} for i in range(n)]
        t = time.perf_counter()
        answers = burst(server.url, reqs, 40 * t_img + 30)
        wall = time.perf_counter() - t
        if any(s != 200 for s, _ in answers):
            return {"batch": n, "error": _reason(next(b for s, b in answers if s != 200))}
        best = min(best or wall, wall)
    return {"batch": n, "wall_s": round(best, 3), "ips": round(n / best, 4)}


def load_runs(a, server, pool, refs, t_img: float, end: float, runs: list, name: str, clients=(16, 1, 4),
              open_loop: bool = True) -> None:
    """Closed loop with `clients` callers (16 measures saturation: first, and given at least twice the time its
    clients' requests take alone plus four images, up to 0.6 of what is left, so that it spans several rounds of its
    clients' requests, not only the first, and a slow host skips the others rather than it),
    then open loop at 50/70/100% of the 16-client throughput; all done by `end` (perf_counter): each run gets a share
    of the time left, stops sending early enough for the requests in flight to finish, and is skipped when too little
    is left."""
    shares = [(("closed", c), w) for c, w in zip(clients, (0.25, 0.1, 0.17) if open_loop else (0.4, 0.6))]
    if open_loop:
        shares += [(("open", f), 0.16) for f in (0.5, 0.7, 1.0)]
    timeout, seed = 40 * t_img + 30, a.seed
    for i, ((mode, x), share) in enumerate(shares):
        left = end - time.perf_counter()
        limit = left * share / sum(w for _, w in shares[i:])
        if i == 0 and mode == "closed":  # the saturation run: several rounds of its clients' requests, however slow
            limit = max(limit, min(0.6 * left, (1.6 * x + 4) * t_img))  # the host (a batched image costs < one alone)
        seed += 1
        engine_before = server.stats()
        if mode == "closed":
            row = {"mode": "closed", "clients": x}
            send_s = limit - 0.8 * t_img * x  # the last `x` requests still in flight when sending stops
            n = min(a.max_requests, max(x, round(limit / t_img * 1.3)))
            if send_s >= t_img:
                row = a.clients.run(server.url, pool, refs, n, send_s, timeout, seed, "closed", x)
        else:
            sat = next((r["throughput_ips"] for r in runs if r["server"] == name and r.get("clients") == 16), None)
            rate = (sat or 1 / t_img) * x
            row = {"mode": "open", "load_of_saturation": x, "rate_rps": round(rate, 4)}
            n = min(a.max_requests, max(4, round(0.8 * limit * rate)))
            if limit >= 4 * t_img:
                row = {"load_of_saturation": x,
                       **a.clients.run(server.url, pool, refs, n, 0.8 * limit, timeout, seed, "open", rate)}
        if "sent" not in row:
            row.update(skipped=f"{limit:.0f} s left of the budget", sent=0, served=0, failed={}, lost=0,
                       mismatches=0, throughput_ips=None, p50_s=None, p99_s=None)
        m = server.memory()  # after each run: a leak climbs run over run
        row["rss_mb"] = round(m["rss"] / 2**20, 1)
        if m.get("rss_anon") is not None:
            row["rss_anon_mb"], row["rss_file_mb"] = round(m["rss_anon"] / 2**20, 1), round(m["rss_file"] / 2**20, 1)
        if row["served"] and engine_before.get("calls") is not None:  # a server with fd-lora's engine counters
            row["engine"] = engine_share(engine_before, server.stats(), row)
        runs.append({"server": name, **row})
        print(f"  {name}: {row}", flush=True)
        a.checkpoint()


def engine_share(before: dict, after: dict, row: dict) -> dict:
    """Where a run's time went on the replica: its pipeline calls and adapter loads (seconds, and their share of the
    run's wall time), requests per batch gathered, images per call, and pipeline seconds per image served (against
    the base pipeline's batch, `base_ceiling`, this is the per-prompt step's cost)."""
    d = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in ("calls", "batches", "mixed_calls", "loads",
                                                                   "load_s", "pipeline_s")}
    wall = row.get("wall_s") or 0
    return {**{k: round(v, 2) for k, v in d.items()},
            "requests_per_batch": round(row["served"] / d["batches"], 2) if d["batches"] else None,
            "images_per_call": round(row["served"] / d["calls"], 2) if d["calls"] else None,
            "pipeline_s_per_image": round(d["pipeline_s"] / row["served"], 3),
            "busy_share": round((d["pipeline_s"] + d["load_s"]) / wall, 3) if wall else None,
            "load_share": round(d["load_s"] / wall, 3) if wall else None}


def burst(url: str, reqs: list[dict], timeout_s: float) -> list[tuple[int | None, bytes | None]]:
    """Requests sent together (they land in one batch), answers in order."""
    out: list = [None] * len(reqs)

    def go(i):
        out[i] = post(url, reqs[i], timeout_s)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
    for th in threads:
        th.start()
        time.sleep(0.002)
    for th in threads:
        th.join()
    return out


def faults(server, pool, refs, size: int, t_img: float, late: str, late_path: Path) -> dict:
    out = {"out_of_memory": fault_oom(server, pool, refs, size, t_img),
           "disconnect": fault_disconnect(server, pool, refs, t_img),
           "corrupt_adapter": fault_corrupt(server, pool, refs, late, late_path, t_img)}
    for k, v in out.items():
        print(f"  fault {k}: {v}", flush=True)
    return out


def fault_oom(server, pool, refs, size: int, t_img: float) -> dict:
    """Three requests of one shape together (a batch over the cap, re-run one by one) and one 2x-size request (four
    times the pixels: over the cap alone even once the merged copies are dropped, a 507). A fourth request runs
    first, alone, so that the three queue behind it and reach the engine as one batch (sent to an idle server, the
    first of them would run alone and the other two fit the cap)."""
    if server.engine is None:
        return {"skipped": "the replica runs in a Ray worker; the memory cap is set in-process"}
    big = {**pool[0], "height": size * 2, "width": size * 2, "seed": 999}
    retries = server.engine.oom_retries
    timeout = 40 * t_img + 30
    lead: list = []
    with server.memory_cap(pool[0]) as how:
        leader = threading.Thread(target=lambda: lead.append(post(server.url, pool[3 % len(pool)], timeout)))
        leader.start()
        time.sleep(server.cfg.serve["batch_wait_s"] + 0.2 * t_img)  # its call has started: the rest queue behind it
        answers = burst(server.url, [pool[0], pool[1 % len(pool)], pool[2 % len(pool)], big], timeout)
        leader.join()
    (s0, b0), (s1, b1), (s2, b2), (sb, bb) = answers
    (sl, bl), = lead or [(None, None)]
    served = [s == 200 for s in (s0, s1, s2)]
    return {"cap": how, "batch_served": sum(served), "batch_statuses": [s0, s1, s2], "batch_errors": [
        _reason(b) for s, b in answers[:3] if s not in (200, None)], "batch_matches": sum(
        s == 200 and compare(b, refs[i % len(pool)]) for i, (s, b) in enumerate(answers[:3])),
        "oversized_status": sb, "oversized_error": _reason(bb) if sb != 200 else None,
        "engine_oom_retries": server.engine.oom_retries - retries,
        "leader_served": sl == 200 and compare(bl, refs[3 % len(pool)]),
        "ok": all(served) and sb == 507 and server.engine.oom_retries > retries and sl == 200}


def fault_disconnect(server, pool, refs, t_img: float) -> dict:
    """A client leaves mid-generation, another while queued behind it; three others of the same time are served."""
    dropped = server.dropped()
    timeout = 40 * t_img + 30
    running = disconnecting(server.url, pool[0], after_s=0.6 * t_img)  # alone on the idle server: it runs
    time.sleep(server.cfg.serve["batch_wait_s"] + 0.2 * t_img)  # its batch has started: the rest queue behind it
    queued = disconnecting(server.url, pool[1 % len(pool)], after_s=0.2 * t_img)
    answers = burst(server.url, pool[2:5] if len(pool) >= 5 else pool[:3], timeout)
    for th in (running, queued):
        th.join()
    after_status, after_body = post(server.url, pool[0], timeout)
    idx = list(range(2, 5)) if len(pool) >= 5 else list(range(3))
    served = sum(s == 200 for s, _ in answers)
    return {"disconnected": 2, "others_served": served, "others_matches": sum(
        s == 200 and compare(b, refs[i]) for i, (s, b) in zip(idx, answers)),
        "dropped_before_running": None if dropped is None else server.dropped() - dropped,
        "served_after": after_status == 200 and compare(after_body, refs[0]),
        "ok": served == len(answers) and after_status == 200}


def fault_corrupt(server, pool, refs, late: str, path: Path, t_img: float) -> dict:
    """The allowlisted adapter `late`, never used yet, is overwritten on disk; requests naming it fail alone."""
    path.write_bytes(b"\x00not a safetensors file" * 8)
    bad = [{**pool[0], "adapters": {late: 1.0}, "seed": 501},
           {**pool[0], "adapters": {late: 0.5, next(iter(pool[0]["adapters"])): 0.5}, "seed": 502}]
    answers = burst(server.url, [bad[0], pool[0], bad[1], pool[1 % len(pool)]], 40 * t_img + 30)
    good = [answers[1], answers[3]]
    errors = [_reason(b) for s, b in (answers[0], answers[2]) if s != 200]
    return {"corrupt_requests": 2, "corrupt_failed": sum(s not in (200, None) for s, _ in (answers[0], answers[2])),
            "corrupt_statuses": [answers[0][0], answers[2][0]], "errors": errors,
            "one_line": all("\n" not in e for e in errors), "others_served": sum(s == 200 for s, _ in good),
            "others_matches": sum(s == 200 and compare(b, refs[i]) for (s, b), i in zip(good, (0, 1 % len(pool)))),
            "ok": all(s == 500 for s in (answers[0][0], answers[2][0])) and all(s == 200 for s, _ in good)}


# --- the run ---------------------------------------------------------------------------------------------------------
def environment(device: str) -> dict:
    import subprocess

    import torch

    def version(m):
        try:
            return __import__(m).__version__
        except ImportError:
            return None

    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": version("diffusers"),
            "peft": version("peft"), "transformers": version("transformers"), "python": sys.version.split()[0],
            "git_sha": sha or None}


def ray_available(a) -> tuple[bool, str | None]:
    if a.no_ray:
        return False, "--no-ray"
    try:
        import ray.serve  # noqa: F401
    except ImportError as e:
        return False, f"ray.serve is not importable ({e}); the replica engine ran in-process behind the same app"
    return True, None


def _load_row(url: str, shared: str, n: int, limit_s: float, timeout_s: float, seed: int, mode: str, x: float) -> dict:
    pool, refs = pickle.loads(Path(shared).read_bytes())
    load = Load(url, pool, refs, n, limit_s, timeout_s, seed)
    return load.closed(int(x)) if mode == "closed" else load.open(x)


class Clients:
    """A process of its own (spawned at first use, reused). The load runs' callers run in one, so the server's RSS
    holds what serving holds, not the callers' threads and the images they decode to compare; the baseline server
    runs in another, so nothing the fd-lora server left in this process (allocator, heap, threads) touches it."""

    def __init__(self) -> None:
        self._pool = None
        self._files: dict[tuple[int, int], tuple[list, list | None, Path]] = {}  # the objects kept: ids stay theirs

    def run(self, url: str, pool: list[dict], refs: list[bytes] | None, *load_args) -> dict:
        return self.call(_load_row, url, str(self._shared(pool, refs)), *load_args)

    def _shared(self, pool: list[dict], refs: list[bytes] | None) -> Path:
        """The pool and its reference images in a file the process reads, written once: sent as arguments, their
        pickle (megabytes of PNGs) would stay in this process, held by the executor's feeder thread until its next
        message, and count in the server's RSS."""
        key = (id(pool), id(refs))
        if key not in self._files:
            fd, path = tempfile.mkstemp(prefix="fdlora-bench-refs-", suffix=".pkl")
            with os.fdopen(fd, "wb") as f:
                pickle.dump((pool, refs), f)
            self._files[key] = (pool, refs, Path(path))
        return self._files[key][2]

    def call(self, fn, *args):
        """`fn(*args)` in the process (a module-level function; arguments and result are pickled)."""
        if self._pool is None:
            import concurrent.futures as cf
            import multiprocessing as mp

            self._pool = cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
        return self._pool.submit(fn, *args).result()

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        for _, _, path in self._files.values():
            path.unlink(missing_ok=True)


def run(a) -> dict:
    with Clients() as a.clients:
        return _run(a)


def _run(a) -> dict:
    import torch

    from fdlora.config import validate

    t_start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = MODELS[a.model]
    size, steps = m["size"], a.steps or m["steps"]
    use_ray, why = ray_available(a)
    tmp = Path(tempfile.mkdtemp(prefix="fdlora-bench-serve-"))
    pipe = make_pipeline(a.model, device)
    paths = write_adapters(pipe, tmp, a.adapters + 1, a.rank)  # the last one: corrupted after start-up
    late = f"a{a.adapters}"
    names = [f"a{i}" for i in range(a.adapters)]
    cfg = validate({"pipeline": "tiny-sdxl" if a.model == "tiny" else str(tmp / "pipeline"), "device": device,
                    "dtype": m["dtype"], "steps": steps, "size": size,
                    "adapters": [{"name": n, "source": str(p)} for n, p in paths.items()],
                    "serve": {"adapters_per_replica": a.slots, "max_batch": a.max_batch, "max_call": a.max_call,
                              "batch_wait_s": a.batch_wait_s, "max_steps": steps, "max_size": size * 2}})
    pool = request_pool(names, a.pool, size, steps, a.seed)
    out = {"bench": "serve", "model": a.model, **environment(device), "pid": os.getpid(), "ray": use_ray,
           "ray_reason": why,
           "config": {"size": size, "steps": steps, "cfg": True, "dtype": m["dtype"], "adapters": a.adapters,
                      "rank": a.rank, "adapters_per_replica": a.slots, "max_batch": a.max_batch, "max_call": a.max_call,
                      "batch_wait_s": a.batch_wait_s, "pool": a.pool, "budget_s": a.budget_s, "seed": a.seed}}
    runs: list[dict] = []
    out["runs"] = runs
    a.checkpoint = lambda: a.out and write(a.out, {**out, "partial": True})  # what a run cut short still leaves
    if use_ray:
        if a.model != "tiny":
            pipe.save_pretrained(tmp / "pipeline")  # the replica builds its own from this folder
        del pipe
        server = RayServer(cfg)
    else:
        server = LocalServer.fdlora(cfg, pipe, a.http)
    out["http"] = server.http
    try:
        refs, t_img = references(server, pool, timeout_s=600)
        out["idle"] = {"image_s": round(t_img, 4), "pool": len(pool),
                       "adapter_effect": not compare(refs[0], refs[2 % len(pool)]),
                       "base_image_s": round(base_image_s(server, pool[0]), 4)}
        print(f"fd-lora: one image alone {t_img:.3f} s, {len(pool)} references", flush=True)
        out["load_profile"] = load_profile(server, names[0])
        print(f"  adapter reload: {out['load_profile'].get('reload_s')} s", flush=True)
        out["warm_up"] = warm_shapes(server, pool, min(a.max_batch, a.max_call or a.max_batch), t_img)
        print(f"  warm-up: {out['warm_up']}", flush=True)
        if a.faults_only or a.soak:
            if a.soak:  # what the faults take (~18 images) kept back
                out["soak"] = soak(a, server, pool, refs, t_img, t_start + a.budget_s - 24 * t_img, runs)
            out["faults"] = faults(server, pool, refs, size, t_img, late, paths[late])
            out["summary"] = summary(out)
            out["wall_s"] = round(time.perf_counter() - t_start, 1)
            return out
        wait_idle()
        mem0 = server.memory()
        # kept for what follows: the faults (~18 images) and the baseline (its build, ~16 images)
        reserve = 44 * t_img + (60 if a.model == "sdxl" else 5)
        load_runs(a, server, pool, refs, t_img, t_start + a.budget_s - reserve, runs, "fdlora")
        wait_idle()
        mem1 = server.memory()
        out["faults"] = faults(server, pool, refs, size, t_img, late, paths[late])
        a.checkpoint()
        wait_idle()
        out["memory"] = memory_report(mem0, mem1, server.memory())
        out["base_ceiling"] = base_ceiling(server, pool, a.max_batch, t_img)
        print(f"  base pipeline, {a.max_batch} images in one batch: {out['base_ceiling']}", flush=True)
        out["server"] = server.stats()
    finally:
        server.close()
    if not use_ray:
        del pipe, server
    _release_device()
    fields = {k: getattr(a, k) for k in ("model", "http", "seed", "max_requests", "budget_s")}
    with Clients() as fresh:  # a process of its own: nothing the fd-lora server left in this one touches it
        idle, peft_runs = fresh.call(baseline, fields, cfg, {n: paths[n] for n in names}, pool[:3], refs[:3],
                                     t_start, device)
    out["baseline_idle"] = idle
    runs.extend(peft_runs)
    out["summary"] = summary(out)
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    return out


def baseline(fields: dict, cfg, paths: dict, pool: list[dict], fd_refs: list[bytes], t_start: float,
             device: str) -> tuple[dict, list[dict]]:
    """The diffusers + PEFT server, run in a fresh process (`Clients.call`): its idle image time (and the plain
    pipeline's, before any adapter is loaded), its images against fd-lora's, and its closed-loop runs with 1 and 4
    clients, until `t_start + budget_s` (perf_counter is the system's monotonic clock, the same in every process)."""
    from types import SimpleNamespace

    pipe = make_pipeline(fields["model"], device)
    base_s = plain_image_s(pipe, pool[0])
    runs: list[dict] = []
    with Clients() as clients:
        a = SimpleNamespace(**fields, clients=clients, checkpoint=lambda: None)
        base = LocalServer.peft(cfg, pipe, paths, a.http)
        try:
            brefs, bt = references(base, pool, timeout_s=600)
            idle = {"image_s": round(bt, 4), "base_image_s": round(base_s, 4), "pid": os.getpid(),
                    "max_diff_to_fdlora": [max_diff(b, r) for b, r in zip(brefs, fd_refs)]}
            end = max(time.perf_counter() + 6 * bt, t_start + a.budget_s - 5)
            load_runs(a, base, pool, brefs, bt, end, runs, "diffusers_peft", (1, 4), open_loop=False)
        finally:
            base.close()
    return idle, runs


def plain_image_s(pipe, req: dict) -> float:
    """One image of the pipeline called directly, no adapter loaded (the second of two calls)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(2):
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            pipe(prompt=req["prompt"], num_inference_steps=req["num_inference_steps"], height=req["height"],
                 width=req["width"], generator=torch.Generator("cpu").manual_seed(req["seed"]))
        sync()
    return time.perf_counter() - t


def _release_device() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def memory_report(before: dict, after_load: dict, after_faults: dict) -> dict:
    def drift(a, b):
        return None if a is None or b is None else round(100 * (b - a) / a, 3)

    def mb(key, m=after_load):
        return None if m.get(key) is None or before.get(key) is None else round((m[key] - before[key]) / 2**20, 1)

    caches = [k for k in ("adapter_cache", "pinned_host") if mb(k) is not None]
    return {"cuda_allocated_before": before["cuda_allocated"], "cuda_allocated_after": after_load["cuda_allocated"],
            "cuda_drift_pct": drift(before["cuda_allocated"], after_load["cuda_allocated"]),
            "cuda_allocated_after_faults": after_faults["cuda_allocated"],
            "rss_before_mb": round(before["rss"] / 2**20, 1), "rss_after_mb": round(after_load["rss"] / 2**20, 1),
            "rss_growth_mb": mb("rss"),
            # the RSS the two bounded caches took over the load runs (adapters first loaded from disk during them;
            # pinned staging blocks), and what is left once they are taken out: the growth a leak would show
            "adapter_cache_growth_mb": mb("adapter_cache"), "pinned_host_growth_mb": mb("pinned_host"),
            "rss_growth_outside_caches_mb": round(mb("rss") - sum(mb(k) for k in caches), 1),
            "rss_growth_by_end_mb": mb("rss", after_faults),
            # anonymous (heap, tensors in RAM) and file-backed (mapped library code and files) parts of the growth
            "rss_anon_growth_mb": mb("rss_anon"), "rss_file_growth_mb": mb("rss_file")}


def summary(out: dict) -> dict:
    runs = out["runs"]
    fd = [r for r in runs if r["server"] == "fdlora"]
    peft = [r for r in runs if r["server"] == "diffusers_peft"]
    best = max((r["throughput_ips"] or 0 for r in fd), default=0)
    best_peft = max((r["throughput_ips"] or 0 for r in peft), default=0)
    at70 = next((r for r in fd if r.get("load_of_saturation") == 0.7), None)
    at16 = next((r for r in fd if r.get("clients") == 16), None)
    failed: dict[str, int] = {}
    for r in runs:
        for k, v in r["failed"].items():
            failed[k] = failed.get(k, 0) + v
    faults = out.get("faults", {})
    return {"fdlora_saturated_ips": best, "peft_saturated_ips": best_peft,
            "x_peft_at_saturation": round(best / best_peft, 3) if best_peft else None,
            "p99_over_p50_at_70pct": round(at70["p99_s"] / at70["p50_s"], 3) if at70 and at70["p50_s"] else None,
            "p50_at_16_clients_s": at16["p50_s"] if at16 else None,
            # the base pipeline's images/s at the largest batch over the baseline's: the most any LoRA server could
            # reach over the baseline on this GPU at this size
            "base_batch_ips": out.get("base_ceiling", {}).get("ips"),
            "x_peft_ceiling": _ratio(out.get("base_ceiling", {}).get("ips"), best_peft),
            # the baseline's image time over the base model's, one image at a time: what a server whose LoRA cost
            # nothing gains over the baseline before batching (batching adds what one GPU has left at this size)
            "peft_image_over_base_image": _ratio(out.get("baseline_idle", {}).get("image_s"),
                                                 out.get("idle", {}).get("base_image_s")),
            "sent": sum(r["sent"] for r in runs), "served": sum(r["served"] for r in runs), "failed": failed,
            "lost": sum(r["lost"] for r in runs), "mismatches": sum(r["mismatches"] for r in runs),
            "faults_ok": all(f.get("ok", True) for f in faults.values()),
            "server_restarts": out.get("server", {}).get("restarts")}


def write(path: Path, res: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main(argv=None) -> int:
    a = args(argv)
    res = run(a)
    if a.out:
        write(a.out, res)
        print(f"wrote {a.out}")
    print(json.dumps(res["summary"], indent=1))
    s = res["summary"]
    return 0 if s["mismatches"] == 0 and s["lost"] == 0 and s["faults_ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here; nothing is downloaded
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # PEFT loads list other adapters' keys as missing
    raise SystemExit(main())
