"""diffusers' per-call LoRA `scale` on a directly called denoiser.

`pipe.transformer(..., joint_attention_kwargs={"scale": s})` (likewise cross_attention_kwargs /
attention_kwargs) scales every LoRA layer of that model for that call under diffusers+PEFT
(`apply_lora_scale` / `scale_lora_layers`). fd-lora's layers are not PEFT layers, so the same is
done here: a forward pre-hook reads the scale and sets the model's multiplier (one table write),
a forward hook (always called, errors too) puts the previous one back. The kwargs are left as
they are: diffusers pops `scale` itself. The pipeline's __call__ strips `scale` before the
denoiser sees it, so a pipe call is not scaled twice.
"""

from __future__ import annotations


def scale_kwarg_of(model) -> str | None:
    """The keyword through which `model.forward` takes diffusers' attention kwargs, if any."""
    import inspect

    from fdlora.integrations.diffusers.targets import SCALE_KWARGS

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in SCALE_KWARGS if k in params), None)


def install_scale_hook(model) -> bool:
    """Honour diffusers' per-call `scale` when `model` is called directly; once per model. True if installed."""
    from fdlora.layers import registry_of_models

    key = scale_kwarg_of(model)
    if key is None or getattr(model, "_fdlora_scale_hooked", False):
        return False
    saved: list[float] = []

    def pre(module, args, kwargs):
        kw = kwargs.get(key)
        h = registry_of_models.get(module)
        if h is None or not isinstance(kw, dict) or kw.get("scale") is None:
            saved.append(None)
            return None
        saved.append(h.state.table.multiplier)
        h.set_multiplier(h.state.table.multiplier * float(kw["scale"]))
        return None

    def post(module, args, kwargs, output):
        prev = saved.pop() if saved else None
        h = registry_of_models.get(module)
        if prev is not None and h is not None:
            h.set_multiplier(prev)
        return None

    a = model.register_forward_pre_hook(pre, with_kwargs=True)
    b = model.register_forward_hook(post, with_kwargs=True, always_call=True)
    object.__setattr__(model, "_fdlora_scale_hooked", True)
    object.__setattr__(model, "_fdlora_scale_hooks", (a, b))
    return True


def remove_scale_hook(model) -> None:
    for h in getattr(model, "_fdlora_scale_hooks", ()):
        h.remove()
    for attr in ("_fdlora_scale_hooked", "_fdlora_scale_hooks"):
        model.__dict__.pop(attr, None)
