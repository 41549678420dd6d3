"""`warmup(pipe_or_model)`: build the kernels a served model will launch before its first request does.

A fresh process pays, on the first call that reaches each kernel, Triton's compile (or its disk-cache load)
and the autotuner's timing runs per tuning key (M bucket, K, N, rank ...); with FDLORA_BACKEND=cuda, the C++
extension's build or load. `warmup` pays them up front: the bulk bank writer of adapter loads
(fdlora.kernels.triton.merge.bank_scatter) once per bank dtype, then every distinct fused-layer shape once per token
count in `tokens`, in blend and per-sample modes, with an adapter already loaded. The model's adapters, active
set and weights are as before afterwards (merged-weight caches may hold entries, as after a first request).

The bulk bank writer is what loads on CUDA use once it is built (fdlora.hub.pool.mark_bulk_ready): until then they
write through torch copies, so a cold process's first load never waits for a kernel build.

Before the first load it also wraps a diffusers pipeline's denoiser in fd-lora layers, as that load would
(`pipe.fd_lora_prepare()`: the same LoRA target table, slots and rank), so that the first load only reads the file
and writes the banks: wrapping SDXL's 722 layers was most of a first load after warmup on an H100 host.

It also starts the reader process of background loads (fdlora.hub.worker; its imports take a few seconds), so the
first `prefetch_fd_lora` does not wait for them, page-locks `pinned_bytes` of the host arena those loads arrive
in (fdlora.hub.worker.reserve: page-locking while steps run stalled an H100 host's steps for seconds; a load that
finds no room there arrives in pageable memory instead), and runs Python's full garbage collection: a fresh process that
imported diffusers and built a model owes one (over ~640k objects: 0.3-0.4 s on our CPU box), and the first load,
which allocates thousands of objects, would otherwise trigger it and pay it. On CPU nothing is compiled (the
torch backend), and the report says so.
Triton keeps compiled kernels on disk (TRITON_CACHE_DIR): running `warmup` once while building a serving
image, with that folder inside the image, turns a cold start's compiles into loads.

    fdlora.integrations.warmup.warmup(pipe)                        # before the first load: its layers, bank writer
    pipe.load_fd_lora("user/style", "style")
    fdlora.integrations.warmup.warmup(pipe)                        # after it: every layer shape
    fdlora.integrations.warmup.warmup(pipe, tokens=(154, 2048, 8192))   # SDXL 1024^2 with CFG: text, 32^2, 64^2
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fdlora.errors import FdLoraError
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.layers import registry_of_models
from fdlora.runtime.scope import lock_of

logger = logging.getLogger("fdlora")
TOKENS = (1, 77, 1024, 4096)  # decode, text, and the image token counts of SD-size latents
PINNED_BYTES = 1 << 30  # room for a few full-size SDXL adapters (170-225 MB at rank 32) arriving or kept at once


@dataclass
class WarmupReport:
    device: str
    layers: int = 0  # fused layers seen
    shapes: int = 0  # distinct layer shapes run
    calls: int = 0  # layer calls made
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"fd-lora warmup on {self.device}: {self.shapes} layer shapes of {self.layers} layers, {self.calls} "
                f"calls, {self.seconds:.2f} s" + "".join(f"; {n}" for n in self.notes))


def warmup(obj: Any, *, tokens: Sequence[int] = TOKENS, batch: int = 2,
           pinned_bytes: int = PINNED_BYTES) -> WarmupReport:
    """Build the kernels `obj` (a pipeline or a model with fd-lora layers) will launch; see the module docstring.
    `tokens`: the token counts per sample its layers see (the M of each linear is batch x tokens); `pinned_bytes`:
    the page-locked host memory background loads may arrive in (with CUDA; kept for the process's life)."""
    _start_reader(pinned_bytes)
    handles = _handles(obj)
    layers = [layer for h in handles for layer in h.layers.values()]
    if not layers:
        report = _before_first_load(obj)
        gc.collect()  # (after it: the layers it wrapped are thousands of objects)
        return report
    gc.collect()
    devices = {layer.bank.A.device for layer in layers}
    cuda = sorted((d for d in devices if d.type == "cuda"), key=str)
    report = WarmupReport(", ".join(sorted(map(str, devices))), layers=len(layers))
    if not cuda:
        report.notes.append("nothing to build: the layers run on the torch backend, which compiles no kernels")
        logger.info("%s", report)
        return report
    t0 = time.perf_counter()
    with lock_of(obj), torch.inference_mode():
        for dtype in sorted({layer.bank.A.dtype for layer in layers if layer.bank.A.is_cuda}, key=str):
            _warm_scatter(cuda[0], dtype)
        for h in handles:
            _warm_layers(h, tokens, batch, report)
    for d in cuda:
        torch.cuda.synchronize(d)
    report.seconds = time.perf_counter() - t0
    logger.info("%s", report)
    return report


def _before_first_load(obj: Any) -> WarmupReport:
    """No fd-lora layers yet: build the bank writer the first load uses, for the dtypes of the model's weights."""
    modules = [m for m in (obj.components.values() if hasattr(obj, "components") else [obj])
               if isinstance(m, torch.nn.Module)]
    if not modules:
        raise FdLoraError(f"{type(obj).__name__} is neither a pipeline nor a model; pass the pipe or model to serve.")
    params = [(p.device, p.dtype) for m in modules for p in m.parameters() if p.is_floating_point()]
    cuda = sorted({(d, t) for d, t in params if d.type == "cuda"}, key=str)
    report = WarmupReport(", ".join(sorted({str(d) for d, _ in params})) or "no parameters")
    report.layers = _prepare(obj)
    if report.layers:
        report.notes.append(f"wrapped {report.layers} layers of the denoiser's LoRA targets ahead of the first load")
    if not cuda:
        report.notes.append("nothing to build: on CPU the torch backend compiles no kernels")
    else:
        t0 = time.perf_counter()
        for device, dtype in cuda:
            _warm_scatter(device, dtype)
            _import_backends(dtype)
            torch.cuda.synchronize(device)
        report.seconds = time.perf_counter() - t0
        report.notes.append("no fd-lora layers yet: built the bank writer of the first load and imported the kernel "
                            "backends its layers select; call warmup again after it for the layers' kernels")
    logger.info("%s", report)
    return report


def _prepare(obj: Any) -> int:
    """A diffusers pipeline: its denoiser's fd-lora layers, wrapped now as its first load would wrap them
    (FdLoraPipelineMixin.fd_lora_prepare); the number of layers it then has."""
    try:
        from diffusers import DiffusionPipeline
    except ImportError:
        return 0
    if not isinstance(obj, DiffusionPipeline):
        return 0
    from fdlora.integrations.diffusers.pipeline import enable_fd_lora

    return sum(len(h.layers) for h in enable_fd_lora(obj).fd_lora_prepare().values())


def _start_reader(pinned_bytes: int) -> None:
    from fdlora import env
    from fdlora.hub import worker

    if env.prefetch_reader() == "process":
        worker.start()
        if torch.cuda.is_available() and worker.ARENA.pinned_bytes < pinned_bytes:
            try:
                worker.reserve(pinned_bytes - worker.ARENA.pinned_bytes)
            except FdLoraError as e:  # (no room in /dev/shm: background loads arrive in pageable memory)
                logger.warning("fd-lora warmup: %s", e)


def _handles(obj: Any) -> list:
    if hasattr(obj, "fd_lora_handles"):
        return list(obj.fd_lora_handles().values())
    h = registry_of_models.get(getattr(obj, "_orig_mod", obj))
    return [] if h is None else [h]


def _warm_scatter(device: torch.device, dtype: torch.dtype) -> None:
    """One load's bank writes on a scratch bank: compiles the bulk writer for `dtype` (fdlora.layers.storage.bulk)."""
    from fdlora.hub.cache import pack_adapters, stage
    from fdlora.hub.pool import mark_bulk_ready
    from fdlora.layers.storage.bank import AdapterBank
    from fdlora.layers.storage.bulk import write_staged

    bank = AdapterBank(1, 16, 32, (32,), dtype, device)
    m = ModuleLora(torch.zeros(16, 32, dtype=dtype), torch.zeros(32, 16, dtype=dtype))
    host = pack_adapters({"": LoraAdapter({"w": m})}, pin=True)[""]
    write_staged([(bank, 0, host.modules["w"])], stage(host, device))
    mark_bulk_ready(device, dtype)


def _import_backends(dtype: torch.dtype) -> None:
    """Import the backends the first load's layers will probe as they select one (fdlora.kernels.registry imports a
    backend on its first probe): the Triton ops modules register ~14 torch.library ops, and torch reads each one's
    source as it registers its fake implementation, 0.4-0.9 s on an H100 host that a first load after `warmup` still
    paid (benchmarks/probes/probe_prefetch_cold.py). None that can run (a requested backend that cannot): the
    first load raises that with the layer's path."""
    from fdlora.kernels import registry

    with contextlib.suppress(FdLoraError):
        registry.select(registry.Problem("cuda", dtype, "linear", 16, 1))


def _warm_layers(h, tokens: Sequence[int], batch: int, report: WarmupReport) -> None:
    """Each distinct (layer type, input width, output width, dtype, device, backend) once per token count, in
    blend mode and per sample, with the first loaded adapter; the active set and weights are put back."""
    names = h.list_adapters()
    if not names:
        report.notes.append(f"{type(h.model).__name__}: no adapter loaded, its layers were not run")
        return
    seen: dict[tuple, Any] = {}
    for layer in h.layers.values():
        A = layer.bank.A
        if A.is_cuda and layer.selection is not None:
            seen.setdefault((type(layer).__name__, tuple(A.shape[2:]), layer.out_features, A.dtype, A.device,
                             layer.selection.name), layer)
    active, enabled = dict(h.state.active), h.state.enabled
    try:
        h.enable()
        h.set_adapters([names[0]])
        for (_, a_shape, _, dtype, device, _), layer in seen.items():
            for M in tokens:
                if len(a_shape) == 1:  # linear: [batch, M, K]
                    x = torch.randn(batch, M, a_shape[0], dtype=dtype, device=device)
                else:  # conv: [batch, C, s, s] with s*s ~ M
                    s = max(1, round(M ** 0.5))
                    x = torch.randn(batch, a_shape[0], s, s, dtype=dtype, device=device)
                layer(x)
                with h.per_sample([names[0]] + [None] * (batch - 1)):
                    layer(x)
                report.calls += 2
        report.shapes += len(seen)
    finally:
        h.set_adapters(list(active), list(active.values()))
        if not enabled:
            h.disable()
