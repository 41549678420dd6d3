"""`fdlora serve CONFIG.yaml`: serve the config's pipeline (POST /v1/images) or Transformers model
(POST /v1/generate) and its adapters over HTTP on Ray Serve.

The config is an `fdlora run` YAML plus an optional `serve:` section (replicas, adapters_per_replica, max_batch,
batch_wait_s, host, port, address, max_steps, max_size; see fdlora.config). The adapters the config lists are
the allowlist: a request may name only those, by name. Without `serve.address` a local Ray cluster starts in
this process (no `ray start` needed); Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="YAML config: an `fdlora run` config plus a `serve:` section")
    p.add_argument("--check", action="store_true", help="validate the config and exit, starting nothing")
    p.add_argument("--host", default=None, help="overrides serve.host (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=None, help="overrides serve.port (default 8000)")
    p.add_argument("--address", default=None, help="an existing Ray cluster (e.g. ray://head:10001 or auto)")


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import os
    import time

    from ..config import load_config, validate

    cfg = load_config(args.config)
    s = dict(cfg.serve or validate({"pipeline": "tiny-sd15", "serve": None}).serve)
    for key in ("host", "port", "address"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    cfg = dataclasses.replace(cfg, serve=s)
    names = ", ".join(a.name for a in cfg.adapters) or "none (base model only)"
    print(f"{args.config}: {cfg.base} x{s['replicas']} replicas, {s['adapters_per_replica']} adapters per replica, "
          f"batches of up to {s['max_batch']}, on {s['host']}:{s['port']}; allowed adapters: {names}")
    if args.check:
        print("config is valid")
        return 0
    from ..extras import require

    require("ray.serve", "fdlora serve")
    require("fastapi", "fdlora serve")
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    from ..serve import deploy

    served = deploy(cfg)
    route = "/v1/images" if cfg.kind == "pipeline" else "/v1/generate"
    print(f"serving on {served.url}  (POST {route}, GET /v1/adapters); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        served.shutdown()
    return 0
