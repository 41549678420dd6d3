"""Read a PEFT adapter folder (local directory or Hub repo): adapter_config.json + adapter_model.safetensors.

Downloads go through huggingface_hub (`hf_hub_download`: revision, subfolder, token, cache_dir,
local_files_only, force_download, HF_ENDPOINT and offline mode all honoured); pickle weights
(adapter_model.bin) only with allow_pickle=True.
TODO(issue 7): switch to fdlora.hub's resolver and PEFT converter once they land; this reader exists
so that Transformers models can load PEFT adapters before then.
"""

from __future__ import annotations

import json
import os
import re

import torch

from ..errors import FdLoraError, FormatError
from ..hub.adapter import Provenance
from .peft_config import lora_config

CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")


def _fetch(source: str, filename: str, subfolder: str | None, hub_kwargs: dict) -> str | None:
    """Local path of `filename` in the adapter folder, or None if the folder has no such file."""
    local = os.path.join(source, subfolder or "")
    if os.path.isdir(local):
        path = os.path.join(local, filename)
        return path if os.path.isfile(path) else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    try:
        return hf_hub_download(source, filename, subfolder=subfolder, **hub_kwargs)
    except EntryNotFoundError:
        return None
    except (LocalEntryNotFoundError, HfHubHTTPError, ValueError, OSError) as e:
        raise FdLoraError(
            f"cannot get {filename} of {source!r} ({type(e).__name__}: {str(e).splitlines()[0][:200]}). "
            "Give a local adapter directory or a Hub repo id that exists (with revision=... / token=... if needed)."
        ) from None


def _revision(path: str) -> str | None:
    m = re.search(r"snapshots[/\\]([0-9a-f]{40})[/\\]", path)
    return m.group(1) if m else None


def read_peft(source: str | os.PathLike, *, subfolder: str | None = None, allow_pickle: bool = False,
              **hub_kwargs) -> tuple[object, dict[str, torch.Tensor], Provenance]:
    """(LoraConfig, state dict in PEFT's saved layout, provenance) of a PEFT adapter folder."""
    source = os.fspath(source)
    cfg_path = _fetch(source, CONFIG_NAME, subfolder, hub_kwargs)
    if cfg_path is None:
        raise FormatError(f"{source!r} has no {CONFIG_NAME}; fdlora.load_fd_lora reads PEFT adapter folders "
                          "(adapter_config.json + adapter_model.safetensors).")
    with open(cfg_path, encoding="utf-8") as f:
        config = lora_config(json.load(f))
    for name in WEIGHT_NAMES:
        path = _fetch(source, name, subfolder, hub_kwargs)
        if path is not None:
            break
    else:
        raise FormatError(f"{source!r} has {CONFIG_NAME} but no {' or '.join(WEIGHT_NAMES)}.")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        tensors = load_file(path)
    elif not allow_pickle:
        raise FormatError(f"{source!r} only has {os.path.basename(path)}, a pickle, and unpickling can run code. "
                          "Re-save it as safetensors, or pass allow_pickle=True if you trust its source.")
    else:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    prov = Provenance(source=source, revision=_revision(path), file=os.path.basename(path), format="peft")
    return config, tensors, prov
