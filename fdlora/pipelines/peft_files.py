"""Read a PEFT adapter folder (local directory or Hub repo): adapter_config.json + adapter_model.safetensors.

Resolution and download are fdlora.hub's (`resolve` pins a Hub revision to a commit and picks the
weight file, `fetch` downloads through huggingface_hub; HF_ENDPOINT, offline mode, tokens honoured),
and the weights are read with `fdlora.hub.safefile` (safetensors checked first; pickle only with
allow_pickle=True). The tensors stay in PEFT's key layout with the LoraConfig beside them: which
modules get LoRA, and modules_to_save, can only be decided against the model
(fdlora.pipelines.peft_state), which the hub's model-agnostic converter does not see.
"""

from __future__ import annotations

import json
import os

import torch

from ..errors import FormatError
from ..hub.adapter import Provenance
from ..hub.resolve import fetch, resolve
from ..hub.safefile import read_weights
from .peft_config import lora_config


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
