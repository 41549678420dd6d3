"""Integrations: the only place that imports diffusers / transformers / peft.

    diffusers/      the pipeline mixin (pipe.load_fd_lora and diffusers' own LoRA calls), its import hook,
                    per-family target tables, from_diffusers
    transformers/   Transformers models and PEFT: read (files / live PeftModel) -> attach, FdLoraModel, save;
                    trainable/ adds trainable adapters from a LoraConfig or a live PeftModel
    fuse.py         weight deltas for fuse_lora and merging
    prefetch.py     fdlora.prefetch: background loads into a pipeline or a model
    warmup.py       fdlora.warmup: build what a served model launches before its first request

`diffusers` may import `transformers` (from_diffusers reuses the PEFT conversion), never the reverse.
"""
