"""Ray Serve: replicas that each hold one pipeline, an HTTP ingress, and a Python handle.

    FdLoraImages / FdLoraText (num_replicas = serve.replicas; a pipeline or a Transformers model per replica)
        @serve.multiplexed, keyed by a request's heaviest adapter: Ray routes a request to a replica that holds
            that adapter when one has room, and keeps `adapters_per_replica` ids per replica (LRU); the adapters
            live in the pipeline's slot pool of the same size (fdlora.serve.engine)
        @serve.batch: requests that arrive together, whatever their adapters, run as one per-prompt batch
    Ingress (FastAPI, one replica, no CPU reserved)
        POST /v1/images (pipelines), POST /v1/generate (models), GET /v1/adapters; every refusal a 4xx with a
        one-line JSON reason (fdlora.serve.schema).
        A request whose replica dies in flight is sent again (requests are seeded: the answer is the same), up
        to RETRIES times, while Ray Serve starts a replacement.

`deploy(cfg)` starts everything on a local Ray cluster (or `serve.address`) and returns a `Served` with the
URL and a `Client` (the handle API: the same validation and retries, no HTTP).
"""

# no `from __future__ import annotations`: FastAPI reads the route annotations (Request) as objects

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from ..extras import require
from . import heap
from .engine import Engine, json_body, make_engine
from .schema import (
    MAX_BODY_BYTES,
    ImageRequest,
    Limits,
    RequestError,
    TextRequest,
    error_body,
    parse,
    parse_body,
    parse_text,
)

APP_NAME = "fdlora"
RETRIES = 4
REPLICA_HEADER = "X-FdLora-Replica"


def _ray():
    ray = require("ray", "fdlora serve")
    serve = require("ray.serve", "fdlora serve")
    require("fastapi", "fdlora serve")
    return ray, serve


def _dead_replica_errors() -> tuple[type[BaseException], ...]:
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:  # build_api over an in-process engine (benchmarks/bench_serve.py): no replica to die
        return ()

    return (ActorDiedError, ActorUnavailableError, RayActorError)


async def call_images(images, req) -> dict[str, Any]:
    """One request on the replicas, routed by its heaviest adapter; sent again if its replica dies. A refusal
    the replica makes (a token id past the vocabulary) comes back as RequestError."""
    dead = _dead_replica_errors()
    for attempt in range(RETRIES):
        try:
            out = await images.options(multiplexed_model_id=req.primary or "").generate.remote(req.to_dict())
            return _checked(out)
        except dead:
            if attempt == RETRIES - 1:
                raise
            await asyncio.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def _checked(out: dict[str, Any]) -> dict[str, Any]:
    if "error" in out:
        raise RequestError(*out["error"])
    return out


def deployment_name(cfg) -> str:
    return "FdLoraImages" if cfg.kind == "pipeline" else "FdLoraText"


def make_app(cfg, *, num_gpus: float = 0.0):
    """The Ray Serve application (ingress bound to the image deployment) for a validated run config."""
    ray, serve = _ray()
    s = cfg.serve or {}
    slots, max_batch, wait = s.get("adapters_per_replica", 4), s.get("max_batch", 8), s.get("batch_wait_s", 0.05)

    @serve.deployment(name=deployment_name(cfg), num_replicas=s.get("replicas", 1),
                      max_ongoing_requests=4 * max_batch, ray_actor_options={"num_cpus": 1, "num_gpus": num_gpus})
    class FdLoraReplica:
        def __init__(self, cfg) -> None:
            self.engine = make_engine(cfg)
            self.text = cfg.kind == "model"
            self.replica = serve.get_replica_context().replica_id.unique_id
            self.started = time.time()

        @serve.multiplexed(max_num_models_per_replica=slots)
        async def adapter(self, name: str):
            await asyncio.get_running_loop().run_in_executor(None, self.engine.hold, name)
            return _Resident(self.engine, name)

        async def generate(self, req: dict) -> dict[str, Any]:
            req = TextRequest(**req) if self.text else ImageRequest(**req)
            if self.text and max(req.input_ids) >= self.engine.vocab:  # refused alone, before it joins a batch
                return {"error": (422, f"input_ids: token ids must be below the vocabulary size "
                                       f"{self.engine.vocab}")}
            name = serve.get_multiplexed_model_id()
            if name:
                await self.adapter(name)
            out = await self.batched(req)
            if isinstance(out, RequestError):  # failed alone (an adapter that does not load, out of memory)
                return {"error": (out.status, str(out))}
            return {"output_ids" if self.text else "png": out, "replica": self.replica}

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=wait)
        async def batched(self, reqs: list) -> list:
            return await asyncio.get_running_loop().run_in_executor(None, self.engine.run_each, reqs)

        def stats(self) -> dict[str, Any]:
            e = self.engine
            return {"replica": self.replica, "known": e.known(), "calls": e.calls, "batches": e.batches,
                    "mixed_calls": e.mixed, "call_kinds": len(e.kinds), "loads": e.loads, "pid": os.getpid(),
                    "oom_retries": e.oom_retries, "failed_loads": e.failed_loads, **process_memory()}

    @serve.deployment(name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=1000)
    @serve.ingress()
    class Ingress:
        def __init__(self, images, cfg) -> None:
            self.images, self.cfg = images, cfg

        def __serve_build_asgi_app__(self):  # built in the replica: nothing FastAPI is pickled
            return build_api(self.images, self.cfg)

    return Ingress.bind(FdLoraReplica.bind(cfg), cfg)


def build_api(images, cfg):
    """The FastAPI app of the ingress: POST /v1/images, GET /v1/adapters, one-line JSON errors."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    api = FastAPI(title="fd-lora", docs_url=None, redoc_url=None, openapi_url=None)
    limits = Limits.from_config(cfg)
    listing = {"adapters": [{"name": a.name, "default_weight": a.weight} for a in cfg.adapters],
               "adapters_per_request": limits.max_adapters, "max_steps": limits.max_steps,
               "max_size": limits.max_size}

    @api.exception_handler(HTTPException)
    async def _http_error(request, exc):  # Starlette's 404 / 405 with the same one-line body
        return Response(error_body(str(exc.detail)), status_code=exc.status_code, media_type="application/json",
                        headers=getattr(exc, "headers", None))

    text = cfg.kind == "model"
    other = "this server serves a Transformers model: POST /v1/generate" if text else \
        "this server serves a diffusers pipeline: POST /v1/images"

    @api.post("/v1/images")
    async def post_images(request: Request):
        try:
            if text:
                raise RequestError(404, other)
            req = parse_body(await _read_body(request), request.headers.get("content-type"), limits)
            out = await call_images(images, req)
        except RequestError as e:
            return Response(error_body(str(e)), status_code=e.status, media_type="application/json")
        headers = {REPLICA_HEADER: out["replica"]}
        if req.response_format == "json":
            return JSONResponse(json_body(out["png"], req, out["replica"]), headers=headers)
        return Response(out["png"], media_type="image/png", headers=headers)

    @api.post("/v1/generate")
    async def post_generate(request: Request):
        try:
            if not text:
                raise RequestError(404, other)
            req = parse_body(await _read_body(request), request.headers.get("content-type"), limits, parse_text)
            out = await call_images(images, req)
        except RequestError as e:
            return Response(error_body(str(e)), status_code=e.status, media_type="application/json")
        return JSONResponse({"output_ids": out["output_ids"], "adapters": req.adapters, "replica": out["replica"]},
                            headers={REPLICA_HEADER: out["replica"]})

    @api.get("/v1/adapters")
    async def get_adapters():
        return listing

    return api


MEMORY_KEYS = ("cuda_allocated", "rss", "rss_anon", "rss_file", "adapter_cache", "pinned_host", "heap_in_use",
               "heap_free", "py_blocks")  # process_memory's keys: every one in bytes but py_blocks (a count)


def process_memory() -> dict[str, Any]:
    """This process's CUDA memory allocated by torch (None without CUDA), resident set size (and its anonymous and
    file-backed parts), the two parts of the RSS that are caches by design: the in-RAM adapter cache
    (`FDLORA_CACHE_BYTES`) and the page-locked blocks torch's host allocator keeps for reuse (None without CUDA), in
    bytes, and where the anonymous part lives: the C heap's bytes in use and free (`heap.usage`) and Python's
    allocated small-object blocks (a count)."""
    import resource
    import sys

    import torch

    from ..hub.cache import cached_bytes

    cuda = pinned = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.memory_allocated()
        pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current")  # active + cached pinned blocks
    with open("/proc/self/statm") as f:  # current RSS (ru_maxrss is the peak)
        rss = int(f.read().split()[1]) * resource.getpagesize()
    return {"cuda_allocated": cuda, "rss": rss, **_rss_parts(), "adapter_cache": cached_bytes(),
            "pinned_host": pinned, **heap.usage(), "py_blocks": sys.getallocatedblocks()}


def _rss_parts() -> dict[str, int | None]:
    """The RSS's anonymous part (the heap, tensors in RAM) and its file-backed part (pages of mapped files: the
    shared libraries' code as their kernels are first used, memory-mapped weights), in bytes; None off Linux."""
    parts: dict[str, int | None] = {"rss_anon": None, "rss_file": None}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    parts["rss_" + key[3:].lower()] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return parts


class _Resident:
    """What Ray's multiplexed LRU holds per adapter; dropping it releases the adapter from the pipeline."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine, self.name, self.released = engine, name, False

    def __del__(self) -> None:
        # Ray calls this when its LRU drops the adapter, and Python again when the object is collected (an
        # instance attribute cannot replace a type's __del__): release once, or a reload in between is undone
        if self.released:
            return
        self.released = True
        try:
            self.engine.release(self.name)
        except Exception:  # never raise from a finalizer; the pool keeps working either way
            pass


async def _read_body(request) -> bytes:
    """The body, refused with 413 as soon as it passes the limit (a declared Content-Length too)."""
    media = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise RequestError(415, "Content-Type must be application/json")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
        raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes")
    return bytes(body)


class Client:
    """The Python handle API, from sync code (not inside an event loop); same validation, routing, batching and
    retries as HTTP:

        png = client.generate("a cat", adapters={"pixel": 0.8}, seed=1)         # a pipeline: PNG bytes
        ids = client.complete([1, 15, 27], adapters={"chat": 1.0}, max_new_tokens=8)   # a model: token ids
    """

    def __init__(self, images, limits: Limits) -> None:
        self.images, self.limits = images, limits

    def request(self, prompt: str, **fields: Any) -> ImageRequest:
        return parse({"prompt": prompt, **fields}, self.limits)

    async def agenerate(self, prompt: str, **fields: Any) -> bytes:
        return (await call_images(self.images, self.request(prompt, **fields)))["png"]

    def generate(self, prompt: str, **fields: Any) -> bytes:
        return self._call(self.request(prompt, **fields))["png"]

    def complete(self, input_ids: list[int], **fields: Any) -> list[int]:
        return self._call(parse_text({"input_ids": list(input_ids), **fields}, self.limits))["output_ids"]

    def _call(self, req) -> dict[str, Any]:
        dead = _dead_replica_errors()
        for attempt in range(RETRIES):
            try:
                resp = self.images.options(multiplexed_model_id=req.primary or "").generate.remote(req.to_dict())
                return _checked(resp.result())
            except dead:
                if attempt == RETRIES - 1:
                    raise
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")


@dataclass
class Served:
    url: str
    client: Client
    ingress: Any

    name: str = APP_NAME

    def shutdown(self) -> None:
        _, serve = _ray()
        serve.delete(self.name)


def init_ray(cfg, *, num_cpus: int | None = None, **ray_kwargs: Any) -> None:
    """Connect to `serve.address`, or start a local cluster whose workers import this same fd-lora."""
    ray, _ = _ray()
    if ray.is_initialized():
        return
    address = (cfg.serve or {}).get("address")
    if address:
        ray.init(address=address, **ray_kwargs)
        return
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds fdlora/
    path = os.pathsep.join([root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {k: v for k, v in os.environ.items() if k.startswith(("HF_", "FDLORA_", "TRANSFORMERS_", "DIFFUSERS_"))}
    ray_kwargs.setdefault("include_dashboard", False)
    # address="local": a new cluster of our own, never one that `ray start` (or another `fdlora serve`) left here
    ray.init(address="local", num_cpus=num_cpus, runtime_env={"env_vars": {**env, "PYTHONPATH": path}},
             **ray_kwargs)


def deploy(cfg, *, num_cpus: int | None = None, name: str = APP_NAME, route_prefix: str = "/",
           **ray_kwargs: Any) -> Served:
    """Start Ray (local unless `serve.address`; kept if this process has it already), Serve's HTTP proxy on
    serve.host:port, and the application (`name` and `route_prefix` let several live on one proxy)."""
    ray, serve = _ray()
    init_ray(cfg, num_cpus=num_cpus, **ray_kwargs)
    s = cfg.serve or {}
    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    serve.start(http_options={"host": s.get("host", "127.0.0.1"), "port": s.get("port", 8000)})
    ingress = serve.run(make_app(cfg, num_gpus=1.0 if cuda else 0.0), name=name, route_prefix=route_prefix)
    images = serve.get_deployment_handle(deployment_name(cfg), app_name=name)
    port = s.get("port", 8000)
    host = s.get("host", "127.0.0.1")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}{route_prefix.rstrip('/')}"
    return Served(url, Client(images, Limits.from_config(cfg)), ingress, name)
