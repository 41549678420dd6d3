"""Integration: the only place that imports diffusers / transformers / peft.

    diffusers/      the pipeline mixin (pipe.load_fd_lora and diffusers' own LoRA calls), its import hook,
                    per-family target tables, from_diffusers, tiny pipelines
    transformers/   Transformers models and PEFT: read (files / live PeftModel) -> attach, FdLoraModel, save
    session.py      what the integration keeps per model beside the handle (configs, module copies)
    routing.py      adapter_names / per-sample specs onto the fused layers' per-sample mode
    scope.py        fdlora.adapters(...) and the per-pipeline lock
    fuse.py         weight deltas for fuse_lora and merging

`diffusers` may import `transformers` (from_diffusers reuses the PEFT conversion), never the reverse.
"""


def __getattr__(name: str):
    """Modules that moved into diffusers/ or transformers/, by their old name (with a DeprecationWarning)."""
    from .._moved import moved_attribute

    return moved_attribute(__name__, name)
