"""The read step of a PEFT load: a folder, Hub repo or state dict + LoraConfig -> a `PeftLoad` for one model.

    load = read(model, "user/chat-adapter", "chat")     # or adapter_from_state(model, config, tensors, name)

A `PeftLoad` is the canonical LoraAdapter, the LoraConfig it came with and the full module copies of
modules_to_save: everything the attach step (fdlora.integrations.transformers.attach) puts into the
model. Nothing in the model changes here. (A live PeftModel is read by `.live` into the same type.)

Files. Resolution and download are fdlora.hub's (`resolve` pins a Hub revision to a commit and picks
the weight file, `fetch` downloads through huggingface_hub; HF_ENDPOINT, offline mode, tokens
honoured), and the weights are read with `fdlora.hub.safefile` (safetensors checked first; pickle
only with allow_pickle=True). The tensors stay in PEFT's key layout with the LoraConfig beside them:
which modules get LoRA, and modules_to_save, can only be decided against the model, which the hub's
model-agnostic converter does not see.

Keys are PEFT's saved layout: ``base_model.model.<path>.lora_A.weight`` / ``.lora_B.weight`` /
``.lora_B.bias`` (the adapter name removed; a name segment ``lora_A.<name>.weight`` is accepted too),
and full state dicts of `modules_to_save` modules under ``base_model.model.<path>.``. Which of the
file's modules get LoRA, and at what scale, is decided by the LoraConfig exactly as PEFT decides it;
file modules this model lacks are an error naming them (an adapter for another architecture).

Steps, each module entered once: the file (here) -> what the LoraConfig decides for this model
(`loraconfig.facts`, plain data) -> the weights checked against the model and converted (`convert`).
"""

from __future__ import annotations

import json
import os
import re

import torch
from torch import nn

from fdlora.errors import FdLoraError, FormatError, UnsupportedFeatureError
from fdlora.hub import worker
from fdlora.hub.adapter import LoraAdapter, Provenance
from fdlora.hub.resolve import fetch, resolve
from fdlora.hub.safefile import read_weights
from fdlora.integrations.transformers import params
from fdlora.integrations.transformers.convert import PREFIX, PeftLoad, to_load
from fdlora.integrations.transformers.loraconfig import facts, lora_config

LORA_KEY = re.compile(r"^(?P<path>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.(?P<param>weight|bias)$")
MAGNITUDE_KEY = re.compile(r"^(?P<path>.+)\.lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?$")  # DoRA's m [N]
UNSUPPORTED_KEYS = {"lora_embedding_": "LoRA on embeddings (lora_embedding_A/B)",
                    "trainable_tokens": "trainable tokens"}


def read_peft(source: str | os.PathLike, *, subfolder: str | None = None, revision: str | None = None,
              weight_name: str | None = None, token: str | bool | None = None,
              cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
              force_download: bool = False, allow_pickle: bool = False,
              ) -> tuple[object, dict[str, torch.Tensor], Provenance]:
    """(LoraConfig, state dict in PEFT's saved layout, provenance) of a PEFT adapter folder."""
    hub = dict(token=token, cache_dir=cache_dir, local_files_only=local_files_only)
    r = resolve(os.fspath(source), weight_name=weight_name, subfolder=subfolder, revision=revision,
                allow_pickle=allow_pickle, **hub)
    r = fetch(r, force_download=force_download, **hub)
    if r.config_path is None:
        raise FormatError(f"{r.source!r} has {r.file} but no adapter_config.json next to it; load_fd_lora reads PEFT "
                          "adapter folders (adapter_config.json + adapter_model.safetensors). For other formats "
                          "use fdlora.hub.load_adapters(...) and fdlora.add_adapter(model, adapter).")
    with open(r.config_path, encoding="utf-8") as f:
        config = lora_config(json.load(f))
    tensors, _ = read_weights(r.path, allow_pickle=allow_pickle)
    return config, tensors, Provenance(source=r.source, revision=r.sha, file=r.file, format="peft")


def read(model: nn.Module, source: str | os.PathLike | LoraAdapter, name: str, *, in_process: bool = True,
         **hub_kwargs) -> PeftLoad:
    """The read step: a PEFT folder / Hub repo id (checked against `model`) or a ready LoraAdapter.
    `in_process=False` reads the files in fd-lora's reader process (fdlora.hub.worker: background loads, off the
    serving thread's GIL); the check against the model and the conversion stay here."""
    if isinstance(source, LoraAdapter):
        return PeftLoad(source, None)
    if isinstance(source, (str, os.PathLike)):
        if in_process:
            config, tensors, prov = read_peft(source, **hub_kwargs)
        else:
            config, tensors, prov = worker.run(read_peft, source, page_locked=torch.cuda.is_available(),
                                               **hub_kwargs)
        return adapter_from_state(model, config, tensors, name, prov)
    raise FdLoraError(f"load_fd_lora takes a PEFT adapter directory, a Hub repo id or a LoraAdapter; got "
                      f"{type(source).__name__}. For a state dict use model.load_adapter(peft_config=..., "
                      "adapter_state_dict=...) on a model fd-lora already serves.")


def strip_prefix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if tensors and all(k.startswith(PREFIX) for k in tensors):
        return {k[len(PREFIX):]: v for k, v in tensors.items()}
    return dict(tensors)


def adapter_from_state(model: nn.Module, config: object, tensors: dict[str, torch.Tensor], name: str,
                       provenance: Provenance | None = None) -> PeftLoad:
    """Validate a PEFT adapter against `model` and convert it; nothing in the model changes here."""
    what = f"adapter {name!r}"
    cf = facts(model, config, what)  # the config's one say; the model is checked in .convert
    tensors = strip_prefix(tensors)
    for key in tensors:
        for marker, feature in UNSUPPORTED_KEYS.items():
            if marker in key:
                raise UnsupportedFeatureError(
                    f"{what} has {feature} weights (e.g. {key!r}), which fd-lora does not implement. "
                    "Serve it with PEFT, or merge it into the base model with PEFT's merge_and_unload()."
                )
    parts: dict[str, dict[str, torch.Tensor]] = {}
    rest: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        m = LORA_KEY.match(key)
        if m is not None:
            parts.setdefault(m["path"], {})[f"{m['ab']}.{m['param']}"] = t
        elif (dm := MAGNITUDE_KEY.match(key)) is not None:
            parts.setdefault(dm["path"], {})["magnitude"] = t
        else:
            rest[key] = t
    if cf.params:  # LoRA on parameters (ParamWrapper): PEFT's nested keys -> fd-lora paths and layout
        parts = params.remap(model, parts, cf.params, what)
    return to_load(model, cf, config, parts, rest, name, provenance)
