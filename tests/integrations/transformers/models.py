"""Tiny Transformers models (random weights, built from configs) and PEFT adapters for them.

One case per architecture: every adapter targets "all-linear" with a rank_pattern, an alpha_pattern
and rsLoRA, plus the LoraConfig field that architecture exercises best (lora_bias,
layers_to_transform, exclude_modules, fan_in_fan_out, modules_to_save, regex patterns). Weights are
made exact in fp32 and lora_B is randomised so every delta matters.
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from peft import LoraConfig, get_peft_model

transformers.logging.set_verbosity_error()
VOCAB = 96


def _dec(cls_cfg, cls_model, **kw):
    def build():
        cfg = cls_cfg(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)
        return cls_model(cfg)
    return build


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, num_labels=3, max_position_embeddings=64)
    return transformers.BertForSequenceClassification(cfg)


def t5():
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg)


def clip_text():
    cfg = transformers.CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64, bos_token_id=0,
                                      eos_token_id=1, pad_token_id=1)
    return transformers.CLIPTextModel(cfg)


def vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=48, num_labels=3)
    return transformers.ViTForImageClassification(cfg)


def ids(batch: int = 3, seq: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def text_inputs(batch: int) -> dict:
    return {"input_ids": ids(batch)}


def bert_inputs(batch: int) -> dict:
    mask = torch.ones(batch, 6, dtype=torch.long)
    mask[0, -2:] = 0  # padding in one row
    return {"input_ids": ids(batch), "attention_mask": mask}


def t5_inputs(batch: int) -> dict:
    return {"input_ids": ids(batch), "decoder_input_ids": ids(batch, 4, seed=2)}


def vit_inputs(batch: int) -> dict:
    return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(3))}


@dataclass
class Case:
    id: str
    build: Any
    inputs: Any
    extra: dict = field(default_factory=dict)  # the LoraConfig fields this case adds
    rank_key: str = "q_proj"
    alpha_key: str = "o_proj"
    b_target: Any = ("q_proj",)  # what the second, simpler adapter "two" targets
    b_extra: dict = field(default_factory=dict)

    def config(self) -> LoraConfig:
        kw = dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True, init_lora_weights=False,
                  rank_pattern={self.rank_key: 4}, alpha_pattern={self.alpha_key: 5.0})
        return LoraConfig(**{**kw, **self.extra})


CASES = [
    Case("llama", _dec(transformers.LlamaConfig, transformers.LlamaForCausalLM), text_inputs, {"lora_bias": True}),
    Case("mistral", _dec(transformers.MistralConfig, transformers.MistralForCausalLM), text_inputs,
         {"exclude_modules": r".*layers\.0\.mlp\..*"},
         b_extra={"layers_to_transform": [1], "layers_pattern": "layers"}),
    Case("qwen2", _dec(transformers.Qwen2Config, transformers.Qwen2ForCausalLM), text_inputs,
         {"exclude_modules": ["down_proj"]}),
    Case("gpt2-conv1d", gpt2, text_inputs, {"fan_in_fan_out": True}, "c_attn", "c_proj", ["c_attn"]),
    Case("bert-seqcls", bert, bert_inputs, {"task_type": "SEQ_CLS"}, "query", r"attention\.output\.dense", ["value"]),
    Case("t5", t5, t5_inputs, {"exclude_modules": r".*decoder\.block\.0\..*"}, "q", r"decoder\..*\.wo", ["v"]),
    Case("clip-text", clip_text, text_inputs, {}, r"layers\.1\..*fc1", "out_proj", ["fc1"]),
    Case("vit-cls", vit, vit_inputs, {"modules_to_save": ["classifier"]}, "(q_proj|query)", "fc1",
         ["q_proj", "query"]),  # ViT's attention is q_proj from transformers 5.2x on, query before
]
BY_ID = {c.id: c for c in CASES}


def randomize_lora(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.copy_(torch.randn(p.shape, generator=g) * std)


@dataclass
class Built:
    base: torch.nn.Module  # untouched base (deep-copy before use)
    peft: Any  # PeftModel with adapters "one" (the case config) and "two" (one module kind, r=4)
    dirs: dict[str, str]  # adapter name -> saved PEFT folder


def second_config(case: Case) -> LoraConfig:
    extra = {k: v for k, v in case.extra.items() if k in ("task_type", "modules_to_save", "fan_in_fan_out")}
    return LoraConfig(r=4, lora_alpha=8, target_modules=list(case.b_target), init_lora_weights=False, **extra,
                      **case.b_extra)


@functools.cache
def built(case_id: str) -> Built:
    case = BY_ID[case_id]
    torch.manual_seed(0)
    base = case.build().eval()
    peft_model = get_peft_model(copy.deepcopy(base), case.config(), adapter_name="one")
    peft_model.add_adapter("two", second_config(case))
    randomize_lora(peft_model)
    peft_model.eval()
    root = tempfile.mkdtemp(prefix=f"fdlora-{case_id}-")
    peft_model.save_pretrained(root)
    return Built(base, peft_model, {n: os.path.join(root, n) for n in ("one", "two")})


def first_tensor(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]
