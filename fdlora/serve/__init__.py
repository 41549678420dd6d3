"""Serving fd-lora pipelines and Transformers models: many adapters, one base model per replica, requests with
different adapters in one per-prompt (per-row) batch. Needs `pip install 'fd-lora[serve]'` (Ray Serve,
FastAPI) for the deployment; the schema and the engines need only the diffusers / transformers extras.

    schema.py       the HTTP/handle request schema, checked with the standard library (every refusal a 4xx)
    engine.py       one replica's work without Ray: pipeline (or model), allowlisted adapters, batches -> PNGs
                    (or token ids)
    deployment.py   Ray Serve: multiplexed + batched replicas, the FastAPI ingress, the handle API, deploy()

    from fdlora.config import load_config
    from fdlora.serve import deploy
    served = deploy(load_config("serve.yaml"))           # `fdlora serve serve.yaml` does this and waits
    png = served.client.generate("a cat", adapters={"pixel": 0.8}, seed=1)
"""

from __future__ import annotations

from .schema import ImageRequest, Limits, RequestError, TextRequest, parse, parse_body, parse_text

_LAZY = {"Engine": "engine", "TextEngine": "engine", "make_engine": "engine", "deploy": "deployment",
         "make_app": "deployment", "Client": "deployment", "Served": "deployment", "init_ray": "deployment"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)  # Ray on use
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Client", "Engine", "ImageRequest", "Limits", "RequestError", "Served", "TextEngine", "TextRequest",
           "deploy", "init_ray", "make_app", "make_engine", "parse", "parse_body", "parse_text"]
