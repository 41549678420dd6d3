"""A dropped model is freed: nothing fd-lora keeps per model (the slot pool of a pipeline, the PEFT session of a
Transformers model, the handle) holds it alive. A server that swaps base models would otherwise keep every old
model's weights (on the GPU) for the life of the process."""

from __future__ import annotations

import copy
import gc
import weakref

import torch
from peft import LoraConfig, get_peft_model

import fdlora.integrations.transformers as fdt
from fdlora.runtime.session import session_of
from tests.integrations.diffusers import families as F
from tests.integrations.transformers import models as M


def _freed(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


def test_dropped_pipeline_with_a_pool_is_freed(tmp_path):
    from safetensors.torch import save_file

    pipe = F.build("wan21")
    g = torch.Generator().manual_seed(0)
    sd = {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.randn(4, 24, generator=g),
          "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.randn(24, 4, generator=g)}
    save_file(sd, tmp_path / "pytorch_lora_weights.safetensors")
    pipe.load_fd_lora(str(tmp_path), "a")  # goes through the pipeline's slot pool
    assert pipe.fd_lora_pools()  # the pool exists, and holds the handle
    model = weakref.ref(pipe.transformer)
    del pipe
    assert _freed(model), "a pipeline with fd-lora adapters stays alive after its last reference is dropped"


def test_dropped_transformers_model_with_a_session_is_freed(tmp_path):
    base = M.gpt2()
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["c_attn"]))
    peft.save_pretrained(tmp_path)
    fdt.load_fd_lora(base, str(tmp_path), "one")
    assert session_of(base, create=False) is not None  # the session exists, and holds the handle
    ref = weakref.ref(base)
    del base, peft
    assert _freed(ref), "a Transformers model with fd-lora adapters stays alive after its last reference is dropped"
