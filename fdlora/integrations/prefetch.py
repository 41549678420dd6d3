"""`pipe.prefetch_fd_lora(source, name)`: load an adapter in the background while the pipeline keeps serving.

    job = pipe.prefetch_fd_lora("user/pixel-style", adapter_name="pixel")   # returns at once
    images = pipe("a castle").images                   # generations go on meanwhile, with their own adapters
    job.result()                                       # the load report; raises the load's error
    pipe.set_adapters(["pixel"])                       # or pipe(..., fd_lora_adapters=["pixel"])

How it overlaps. A host-bound eager step needs the GIL nearly all the time (it releases it at every torch op and
wants it back at once): on an H100 host a busy Python thread made SDXL steps 300x slower, so the rule is that a
prefetch runs O(1) Python in this process while steps may run, and everything per tensor or per module between
two steps. A background thread resolves the source; the reader process (fdlora.hub.worker) reads, converts and
checks the format, and writes every tensor into one block of a host arena shared with it (page-locked once, by
fdlora.integrations.warmup, never while steps run); on CUDA the thread copies that block to the device in one
transfer on a side stream and checks it for NaN/Inf in one pass (a sum per dtype run), then waits for that copy's
event. FDLORA_PREFETCH_READER=thread keeps the read in this process (and its per-tensor Python on the thread).
Only then does it publish, under the lock a generation holds from start to end (fdlora.runtime.scope.lock_of):
the adapter objects are built over views of the block, and the attach step of `load_fd_lora` runs: shapes
checked against the model, room made, the banks' write tables made, then the banks written from the device copy in
one launch of the bulk writer (fdlora.layers.storage.bulk; torch copies until fdlora.integrations.warmup built it) and
the name registered. It does so in pieces (fdlora.steps): it holds the lock for at most ~1.5 ms at a time
(`background.SLICE_S`) and lets go of it between pieces, so the generation waiting for the lock waits for one piece,
not for the whole publication (~25 ms of Python for an SDXL LoRA on an H100 host, which made the step it landed on
about a third slower). Nothing changes in the pipeline before the last piece, which writes the banks and registers
the name at once; if a call changed the components meanwhile (a load, a delete, an eviction) the last piece checks
and writes again in one go. Loads that must wrap layers or grow the rank capacity publish in one piece. So a
generation in flight never sees a half-written slot and never waits on the file or the PCIe transfer. The adapter
is usable from the first call that starts after its last piece.

Why a staging buffer and not the bank rows themselves on the side stream: writing bank rows before
publication means holding a free slot meanwhile, and taking a slot (evicting, if the pool is full) needs the
lock, which a running generation holds for its whole length: the copy would start only after the current
generation and publish after the next one. Staging costs, for a moment, one device buffer of the adapter's size.

Semantics (what differs from `load_fd_lora`):
- The active adapters do not change (steps running meanwhile keep theirs): activate the adapter with
  `set_adapters` or use it per prompt once `.result()` returned. Room is made as for a load that does not
  activate: the least recently used *inactive* adapter is evicted (fdlora.hub.pool); if every slot holds an
  active adapter, `.result()` raises CapacityError.
- A name still being prefetched is not loaded: `set_adapters`, per-prompt `fd_lora_adapters` and the like raise
  UnknownAdapterError naming the prefetch and `.result()`. They do not wait: they hold the pipeline's lock,
  which the publication needs, and a call that silently waits on a file read is what prefetching avoids.
- `delete_adapters(name)` of a name being prefetched cancels it; `unload_lora_weights()` cancels every pending
  prefetch. `job.cancel()` is True until the publication's last piece starts; the adapter is then never published.
- `.result()` raises exactly the error `load_fd_lora` would have raised, and the model is unchanged (the attach
  step is load_fd_lora's own, all or nothing).
- The background thread runs in its caller's `torch.inference_mode` state, as a load there would.
"""

from __future__ import annotations

from typing import Any

from fdlora import env
from fdlora.runtime.background import Prefetch, cancel_all, cancel_pending, check_kwargs, pending, pipeline_job, start

__all__ = ["Prefetch", "cancel_all", "cancel_pending", "pending", "prefetch"]


def prefetch(obj: Any, source: Any, adapter_name: str | None = None, **kwargs: Any) -> Prefetch:
    """Start loading `source` into `obj` in the background; returns a `Prefetch` at once.

    `obj`: a diffusers pipeline (as `pipe.prefetch_fd_lora`), a diffusers model (as `fdlora.load_fd_lora(model,
    ...)`: its `family` / `prefix` keywords too) or a Transformers model (a PEFT adapter, as the Transformers
    `load_fd_lora`; there the files are read in the reader process, checked against the model and converted off
    the lock, and written under it, without a side stream).
    Keywords are the matching `load_fd_lora`'s; the adapter is never activated (see the module docstring).
    """
    from fdlora.integrations.diffusers.model import is_diffusers_model
    from fdlora.integrations.diffusers.pipeline import FdLoraPipelineMixin, enable_fd_lora

    check_kwargs(kwargs)
    if isinstance(obj, FdLoraPipelineMixin) or hasattr(obj, "components") and hasattr(obj, "load_fd_lora"):
        return pipeline_job(enable_fd_lora(obj), source, adapter_name, kwargs)
    base = getattr(obj, "_orig_mod", obj)
    if is_diffusers_model(base):
        from fdlora.integrations.diffusers.family import family_of, family_of_model
        from fdlora.integrations.diffusers.model import _ModelHolder

        family, prefix = kwargs.pop("family", None), kwargs.pop("prefix", None)
        fam = family_of(family) if family is not None else family_of_model(base)
        comp = prefix or (fam.denoiser if fam is not None else
                          "unet" if type(base).__name__.startswith("UNet") else "transformer")
        return pipeline_job(_ModelHolder(comp, obj, fam), source, adapter_name, kwargs, key=base)
    return start(base, base, adapter_name or "default", source, *_transformers_steps(base, source, kwargs))


def _transformers_steps(model: Any, source: Any, kwargs: dict[str, Any]):
    from fdlora.integrations.transformers.attach import attach
    from fdlora.integrations.transformers.model import enable
    from fdlora.integrations.transformers.quantized import check_quantized
    from fdlora.integrations.transformers.read import read as read_peft

    def read(name):
        check_quantized(model)
        return read_peft(model, source, name, in_process=env.prefetch_reader() == "thread", **kwargs), {}

    def publish(load, staged, name):
        attach(model, [(name, load)], activate=None)
        enable(model)
        return model

    return read, publish


