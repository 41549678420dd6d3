"""The servers and the client of bench_serve.py, on loopback.

    LocalServer.fdlora(cfg, pipe)      the replica engine (fdlora.serve.engine) in this process, behind the same
                                       HTTP app as `fdlora serve` (fdlora.serve.deployment.build_api, FastAPI on
                                       uvicorn) or, without those, a stdlib threaded server with the same routes
    LocalServer.peft(cfg, pipe, files) the baseline: diffusers + PEFT, set_adapters per request, one at a time
    RayServer(cfg)                     `fdlora serve` itself (Ray Serve on a local cluster)

Requests are batched the way `@serve.batch` batches (`Batcher`: what arrives within batch_wait_s, up to
max_batch); a request whose client has gone before its batch starts is dropped from it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import http.client
import io
import json
import queue
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from fdlora.serve.deployment import MEMORY_KEYS, process_memory
from fdlora.serve.engine import Engine, png
from fdlora.serve.schema import MAX_BODY_BYTES, ImageRequest, Limits, RequestError, error_body, parse_body


# --- client ------------------------------------------------------------------------------------------------------
def post(url: str, body: dict, timeout_s: float) -> tuple[int | None, bytes | None]:
    """(status, body) of POST /v1/images; (None, None) when no answer came (the request is lost)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/images", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    except OSError:
        return None, None
    finally:
        conn.close()


def disconnecting(url: str, body: dict, after_s: float) -> threading.Thread:
    """A client that sends a request and closes its connection `after_s` later, without reading an answer."""
    u = urlsplit(url)
    data = json.dumps(body).encode()
    head = (f"POST /v1/images HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()

    def go():
        with socket.create_connection((u.hostname, u.port)) as s:
            s.sendall(head + data)
            time.sleep(after_s)

    th = threading.Thread(target=go)
    th.start()
    return th


def max_diff(got: bytes, ref: bytes) -> int | None:
    """The largest per-pixel difference of two PNGs, in 1/255 (None: different sizes)."""
    import numpy as np
    from PIL import Image

    a, b = (np.asarray(Image.open(io.BytesIO(x)).convert("RGB"), dtype=np.int16) for x in (got, ref))
    return int(abs(a - b).max()) if a.shape == b.shape else None


def compare(got: bytes, ref: bytes, tol: int = 1) -> bool:
    """Same image within `tol`/255 per pixel after PNG."""
    d = max_diff(got, ref)
    return d is not None and d <= tol


# --- batching and the in-process handle ----------------------------------------------------------------------------
class Batcher:
    """`@serve.batch` without Ray: requests arriving within `wait_s` (up to `max_batch`) go to `run_each` together on
    one worker thread; a cancelled request (its client left) is dropped before its batch starts."""

    def __init__(self, run_each, max_batch: int, wait_s: float) -> None:
        self.run_each, self.max_batch, self.wait_s = run_each, max_batch, wait_s
        self.q: queue.Queue = queue.Queue()
        self.dropped = 0
        self.worker = threading.Thread(target=self._loop, daemon=True)
        self.worker.start()

    def submit(self, req: ImageRequest) -> cf.Future:
        fut: cf.Future = cf.Future()
        self.q.put((req, fut))
        return fut

    def close(self) -> None:
        self.q.put(None)
        self.worker.join()

    def _loop(self) -> None:
        while (batch := self._gather()) is not None:
            self._run(batch)
            del batch  # the answers are the waiting handlers' now: none held while the next batch is awaited

    def _gather(self) -> list | None:
        if (item := self.q.get()) is None:
            return None
        batch, end = [item], time.monotonic() + self.wait_s
        while len(batch) < self.max_batch:
            try:
                nxt = self.q.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            if nxt is None:
                self.q.put(None)
                break
            batch.append(nxt)
        return batch

    def _run(self, batch: list) -> None:
        live = [(r, f) for r, f in batch if f.set_running_or_notify_cancel()]
        self.dropped += len(batch) - len(live)
        if not live:
            return
        try:
            outs = self.run_each([r for r, _ in live])
        except BaseException as e:  # noqa: BLE001 - handed to every waiting request
            for _, f in live:
                f.set_exception(e)
            return
        for (_, f), o in zip(live, outs):
            f.set_result(o)


class LocalImages:
    """What build_api calls as a Ray deployment handle (`images.options(...).generate.remote(req)`), in-process."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self.generate = self

    def options(self, **_):
        return self

    async def remote(self, req: dict) -> dict:
        out = await asyncio.wrap_future(self.batcher.submit(ImageRequest(**req)))  # cancelled with its caller
        if isinstance(out, RequestError):
            return {"error": (out.status, str(out))}
        return {"png": out, "replica": "local"}


def cancel_on_disconnect(app):
    """ASGI: cancel a request's handler when its client disconnects (as Ray Serve's proxy does)."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        body_read = asyncio.Event()

        async def recv():
            msg = await receive()
            if msg["type"] != "http.request" or not msg.get("more_body"):
                body_read.set()
            return msg

        task = asyncio.ensure_future(app(scope, recv, send))

        async def watch():
            await body_read.wait()
            while (await receive())["type"] != "http.disconnect":
                pass
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        finally:
            watcher.cancel()

    return wrapped


# --- servers -------------------------------------------------------------------------------------------------------
class PeftEngine:
    """The baseline server's work: diffusers + PEFT, every adapter loaded with `load_lora_weights`, `set_adapters`
    per request, one request at a time under a lock."""

    def __init__(self, pipe, files: dict) -> None:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        self.pipe, self.lock = pipe, threading.Lock()
        was = are_progress_bars_disabled()
        disable_progress_bars()  # (process-wide: put back after the loads)
        try:
            for name, path in files.items():
                pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
        finally:
            if not was:
                enable_progress_bars()
        self.oom_retries = 0

    def run_each(self, reqs: list[ImageRequest]) -> list:
        return [self._one(r) for r in reqs]

    def _one(self, r: ImageRequest) -> bytes:
        import torch

        with self.lock:
            names = sorted(r.adapters)
            self.pipe.set_adapters(names, [r.adapters[n] for n in names])
            with torch.inference_mode():
                image = self.pipe(prompt=r.prompt, num_inference_steps=r.num_inference_steps, height=r.height,
                                  width=r.width, generator=torch.Generator("cpu").manual_seed(r.seed)).images[0]
        return png(image)


def _http_kind(want: str) -> str:
    if want != "auto":
        return want
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return "stdlib"
    return "fastapi"


class LocalServer:
    def __init__(self, cfg, engine, max_batch: int, wait_s: float, http: str) -> None:
        self.cfg, self.engine = cfg, engine
        self.batcher = Batcher(engine.run_each, max_batch, wait_s)
        self.http = _http_kind(http)
        self._stop = (self._fastapi if self.http == "fastapi" else self._stdlib)()

    @classmethod
    def fdlora(cls, cfg, pipe, http: str = "auto") -> LocalServer:
        s = cfg.serve
        return cls(cfg, Engine(cfg, pipe), s["max_batch"], s["batch_wait_s"], http)

    @classmethod
    def peft(cls, cfg, pipe, files: dict, http: str = "auto") -> LocalServer:
        return cls(cfg, PeftEngine(pipe, files), 1, 0.0, http)

    def _fastapi(self):
        import uvicorn

        from fdlora.serve.deployment import build_api

        app = cancel_on_disconnect(build_api(LocalImages(self.batcher), self.cfg))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=1))
        th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        th.start()
        while not server.started:
            if not th.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

        def stop():
            server.should_exit = True
            th.join(30)
            sock.close()

        return stop

    def _stdlib(self):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.batcher, Limits.from_config(self.cfg)))
        httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        th = threading.Thread(target=httpd.serve_forever, daemon=True)
        th.start()

        def stop():
            httpd.shutdown()
            httpd.server_close()

        return stop

    def dropped(self) -> int:
        return self.batcher.dropped

    def memory(self) -> dict:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {**process_memory(), "call_kinds": self.stats()["call_kinds"]}

    @contextlib.contextmanager
    def memory_cap(self, req: dict):
        """Device memory capped between what one request of `req`'s shape needs and what two need, over the weights
        and banks (CUDA: a per-process fraction, with the merged-weight cache off for its duration, so no copy dropped
        on running out makes room and every step keeps 0.6 of an image's need free; CPU: a UNet hook refusing more
        latents than one prompt's, CFG included)."""
        import torch

        from fdlora import set_merge_cache

        unet, dev = self.engine.pipe.unet, self.engine.pipe.device
        if dev.type == "cuda":
            merge_limit = set_merge_cache(0)
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            post(self.url, req, 600)
            need = torch.cuda.max_memory_allocated(dev) - base
            torch.cuda.empty_cache()
            # the room under the cap is the cap less what is allocated: free blocks left inside reserved segments are
            # room too (gigabytes of them after a load run), so a cap over the reserved bytes can let a batch fit; the
            # cap is set over the allocated bytes. A cap within an image's need of a step's peak leaves the step at
            # the limit, where convolutions fall back to algorithms without workspace and the allocator frees its
            # cache on every miss: slow, never out of memory
            cap = torch.cuda.memory_allocated(dev) + int(1.6 * need)
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(cap / total, dev)
            try:
                yield f"CUDA memory fraction {cap / total:.4f} ({cap / 2**30:.2f} GiB; one image needs " \
                      f"{need / 2**30:.2f} GiB over the weights)"
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0, dev)
                torch.cuda.empty_cache()
                set_merge_cache(merge_limit)
            return
        side = req["height"] // self.engine.pipe.vae_scale_factor

        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["sample"]
            if x.shape[0] * x.shape[2] * x.shape[3] > 2 * side * side:
                raise torch.OutOfMemoryError("out of memory (bench_serve's injected cap)")

        handle = unet.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield "injected: a UNet hook raises torch.OutOfMemoryError past one prompt's latents (CPU)"
        finally:
            handle.remove()

    def stats(self) -> dict:
        e = self.engine
        return {"calls": getattr(e, "calls", None), "batches": getattr(e, "batches", None),
                "mixed_calls": getattr(e, "mixed", None),
                "call_kinds": len(e.kinds) if hasattr(e, "kinds") else None,
                "loads": getattr(e, "loads", None), "oom_retries": e.oom_retries,
                "failed_loads": getattr(e, "failed_loads", None), "dropped_before_running": self.batcher.dropped,
                "load_s": round(getattr(e, "load_s", 0.0), 2), "pipeline_s": round(getattr(e, "call_s", 0.0), 2),
                "restarts": 0 if self.batcher.worker.is_alive() else 1,
                "dispatch": dict(getattr(e, "paths", {}))}  # fused layers by path, summed over every call

    def close(self) -> None:
        self._stop()
        self.batcher.close()


def _handler(batcher: Batcher, limits: Limits):
    """The routes of fdlora.serve.deployment.build_api on http.server; a waiting request polls its socket and is
    cancelled when the client has gone."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):
            pass

        def _send(self, status: int, body: bytes, media: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", media)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path != "/v1/adapters":
                return self._send(404, error_body("Not Found"))
            self._send(200, json.dumps({"adapters": [{"name": n} for n in limits.allowed]}).encode())

        def do_POST(self):
            if self.path != "/v1/images":
                return self._send(404, error_body("Not Found"))
            n = int(self.headers.get("Content-Length") or 0)
            try:
                if n > MAX_BODY_BYTES:
                    raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes")
                req = parse_body(self.rfile.read(n), self.headers.get("Content-Type"), limits)
            except RequestError as e:
                return self._send(e.status, error_body(str(e)))
            fut = batcher.submit(req)
            while True:
                try:
                    out = fut.result(timeout=0.05)
                    break
                except cf.TimeoutError:
                    if self._client_gone():
                        fut.cancel()
                        return
                except Exception as e:  # the engine's failure reaches the client as a 500, as FastAPI answers
                    return self._send(500, error_body(f"internal error ({type(e).__name__})"))
            if isinstance(out, RequestError):
                return self._send(out.status, error_body(str(out)))
            self._send(200, out, "image/png")

        def _client_gone(self) -> bool:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            try:
                return self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

    return Handler


class RayServer:
    """`fdlora serve` on a local Ray cluster (fdlora.serve.deploy); the replica builds its pipeline from the config."""

    http = "ray-serve"
    engine = None

    def __init__(self, cfg) -> None:
        from fdlora.serve import deploy
        from fdlora.serve.deployment import deployment_name

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        cfg.serve["port"] = port
        self.cfg, self.served = cfg, deploy(cfg)
        self.url = self.served.url
        from ray import serve

        self.handle = serve.get_deployment_handle(deployment_name(cfg), app_name=self.served.name)
        self.pids: set[int] = set()

    def stats(self) -> dict:
        s = self.handle.stats.remote().result()
        self.pids.add(s["pid"])
        return {**s, "restarts": len(self.pids) - 1}

    def memory(self) -> dict:
        s = self.stats()
        return {**{k: s.get(k) for k in MEMORY_KEYS}, "call_kinds": s.get("call_kinds")}

    def dropped(self) -> None:
        return None

    def close(self) -> None:
        import ray
        from ray import serve

        self.served.shutdown()
        serve.shutdown()
        ray.shutdown()
