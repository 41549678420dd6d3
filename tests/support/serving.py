"""One live `fdlora serve` for the whole test session: a real local Ray cluster (small: 3 CPUs, no dashboard),
the tiny SD1.5 pipeline on 2 replicas, and 8 adapters published to the loopback Hub server
(tests/conftest.py), loaded by repo id through huggingface_hub into the session's one HF cache.

tests/serve/ and tests/reliability/test_http_fuzz.py share it (started on first use, stopped at exit), so
the suite pays Ray's start and the replicas' pipeline builds once.
"""

from __future__ import annotations

import atexit
import io
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

N_ADAPTERS = 8
REPLICAS = 2
SLOTS = 4
STEPS, SIZE = 2, 64
_lock = threading.Lock()
_served = None


@dataclass
class Live:
    served: object  # fdlora.serve.Served
    cfg: object  # the validated Config
    repos: dict[str, str]  # adapter name -> repo id on the loopback hub
    start_s: float  # seconds from nothing to serving

    @property
    def url(self) -> str:
        return self.served.url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publish(root: str) -> dict[str, str]:
    """8 diffusers-format LoRAs for the tiny SD1.5 pipeline on the loopback Hub."""
    from fdlora.fixtures import tiny_pipeline as tiny
    from fdlora.fixtures.localcache import populate

    pipe = tiny.sd15()
    repos = {}
    for i in range(N_ADAPTERS):
        repo = f"serve-tests/lora-{i}"
        populate(root, repo, tiny.random_lora_files(pipe, seed=100 + i, strength=2.0))
        repos[f"a{i}"] = repo
    return repos


def peft_files(model, seed: int) -> dict[str, bytes]:
    """A PEFT adapter for the tiny Llama, saved by PEFT itself (random A and B: it changes the tokens)."""
    import copy
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model

    from fdlora.fixtures.localcache import files_from_dir

    torch.manual_seed(seed)
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            p.data.mul_(20)
    with tempfile.TemporaryDirectory() as d:
        pm.save_pretrained(d)
        return files_from_dir(d)


def publish_text_adapters(root, n: int = 3) -> dict[str, str]:
    """n PEFT adapters for the tiny Llama (fdlora.config's tiny-llama) on the loopback Hub."""
    from fdlora.config import _tiny_llama
    from fdlora.fixtures.localcache import populate

    base = _tiny_llama()
    repos = {}
    for i in range(n):
        repos[f"t{i}"] = f"serve-text/l{i}"
        populate(root, repos[f"t{i}"], peft_files(base, 60 + i))
    return repos


def config(repos: dict[str, str], port: int):
    from fdlora.config import validate

    return validate({
        "pipeline": "tiny-sd15", "device": "cpu", "steps": STEPS, "size": SIZE,
        "adapters": [{"name": n, "source": r} for n, r in repos.items()],
        "serve": {"replicas": REPLICAS, "adapters_per_replica": SLOTS, "max_batch": 8, "batch_wait_s": 0.05,
                  "port": port, "max_steps": 4, "max_size": 128},
    }, "tests/support/serving.py")


def live(hub_root: str) -> Live:
    """The session's server (started here on first call)."""
    global _served
    with _lock:
        if _served is None:
            t = time.perf_counter()
            repos = _publish(hub_root)
            cfg = config(repos, free_port())
            from fdlora.serve import deploy

            served = deploy(cfg, num_cpus=REPLICAS + 1, object_store_memory=96 << 20, log_to_driver=False,
                            configure_logging=False)
            _served = Live(served, cfg, repos, time.perf_counter() - t)
            atexit.register(_stop)
            wait_ready(_served.url)
    return _served


def _stop() -> None:
    try:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    except Exception:
        pass


def wait_ready(url: str, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(url + "/v1/adapters", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def post(url: str, body: bytes, *, content_type: str | None = "application/json", method: str = "POST",
         path: str = "/v1/images", timeout: float = 120, headers: dict | None = None):
    """(status, headers, body bytes) of one request; never raises on an HTTP error status."""
    req = urllib.request.Request(url + path, data=body if method not in ("GET", "HEAD") else None, method=method)
    if content_type is not None:
        req.add_header("Content-Type", content_type)
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def decode_png(data: bytes):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


