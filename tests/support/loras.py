"""LoRA fixtures in every format fd-lora reads, written from one set of weights (`Lora`).

`make_lora` draws weights for given module shapes; the writers lay the same weights out as
PEFT (adapter_config.json + adapter_model.safetensors), diffusers (pytorch_lora_weights.safetensors,
with or without the lora_adapter_metadata header), kohya SD1.5/SDXL (diffusers or SGM block names,
LoCon conv keys, per-module .alpha), and kohya (sd-scripts, ComfyUI, lora_transformer_ mixture) /
XLabs Flux. Each returns {file name: bytes}, ready for `hubcache.populate` or a directory.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch
from safetensors.torch import save

Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]  # path -> (A [r, K...], B [N, r(,1,1)])


@dataclass
class Lora:
    """Weights of one component plus the alpha of every module (None: alpha = rank)."""

    weights: Weights
    alphas: dict[str, float] = field(default_factory=dict)

    def alpha(self, path: str) -> float:
        return self.alphas.get(path, float(self.weights[path][0].shape[0]))


def make_lora(shapes: dict[str, tuple], rank: int = 4, seed: int = 0, alpha: float | None = None,
              b_scale: float = 1.0, dtype: torch.dtype = torch.float32) -> Lora:
    """shapes: path -> (K, N) for linear, (C_in, N, kh, kw) for conv. Non-zero B so the delta shows."""
    g = torch.Generator().manual_seed(seed)
    w = {}
    for path, s in shapes.items():
        if len(s) == 2:
            A, B = torch.randn(rank, s[0], generator=g), torch.randn(s[1], rank, generator=g)
        else:
            A, B = torch.randn(rank, s[0], s[2], s[3], generator=g), torch.randn(s[1], rank, 1, 1, generator=g)
        w[path] = ((A / s[0] ** 0.5).to(dtype).contiguous(), (B * b_scale).to(dtype).contiguous())
    return Lora(w, {p: alpha for p in shapes} if alpha is not None else {})


def peft_state(lora: Lora, prefix: str = "") -> dict[str, torch.Tensor]:
    sd = {}
    for p, (A, B) in lora.weights.items():
        sd[f"{prefix}{p}.lora_A.weight"] = A
        sd[f"{prefix}{p}.lora_B.weight"] = B
    return sd


def peft_files(lora: Lora, **config) -> dict[str, bytes]:
    """What PeftModel.save_pretrained writes. `config` overrides LoraConfig fields (r, lora_alpha, ...)."""
    ranks = {A.shape[0] for A, _ in lora.weights.values()}
    cfg = {"peft_type": "LORA", "r": max(ranks), "lora_alpha": max(ranks), "target_modules": sorted(
        {p.split(".")[-1] if not p.split(".")[-1].isdigit() else ".".join(p.split(".")[-2:]) for p in lora.weights}),
        "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "lora_bias": False,
        "rank_pattern": {}, "alpha_pattern": {}, "task_type": None, **config}
    return {"adapter_config.json": json.dumps(cfg, indent=2).encode(),
            "adapter_model.safetensors": save(peft_state(lora, "base_model.model."), {"format": "pt"})}


def diffusers_files(components: dict[str, Lora], metadata: dict[str, dict] | None = None,
                    network_alphas: bool = False) -> dict[str, bytes]:
    """pytorch_lora_weights.safetensors with `<component>.` keys; metadata = {component: LoraConfig dict}."""
    sd = {}
    for comp, lora in components.items():
        sd.update(peft_state(lora, f"{comp}."))
        if network_alphas:
            sd.update({f"{comp}.{p}.alpha": torch.tensor(lora.alpha(p)) for p in lora.weights})
    meta = {"format": "pt"}
    if metadata:
        flat = {f"{c}.{k}": v for c, cfg in metadata.items() for k, v in cfg.items()}
        meta["lora_adapter_metadata"] = json.dumps(flat)
    return {"pytorch_lora_weights.safetensors": save(sd, meta)}


KOHYA_TE = {"sd15": {"text_encoder": "lora_te"}, "sdxl": {"text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}}


def kohya_state(components: dict[str, Lora], kind: str = "sd15", sgm: bool = False,
                layers_per_block: int = 2) -> dict[str, torch.Tensor]:
    """kohya-ss keys; `sgm` writes SDXL's original block names (input_blocks_4_1_...) for the UNet."""
    pre = {"unet": "lora_unet", **KOHYA_TE[kind]}
    out = {}
    for comp, lora in components.items():
        for p, (A, B) in lora.weights.items():
            mod = to_sgm(p, layers_per_block) if comp == "unet" and sgm else p
            name = pre[comp] + "_" + mod.replace(".", "_")
            out[f"{name}.lora_down.weight"] = A
            out[f"{name}.lora_up.weight"] = B
            out[f"{name}.alpha"] = torch.tensor(lora.alpha(p))
    return out


def kohya_file(components: dict[str, Lora], kind: str = "sd15", sgm: bool = False,
               name: str = "lora.safetensors") -> dict[str, bytes]:
    return {name: save(kohya_state(components, kind, sgm), {"ss_network_module": "networks.lora"})}


def to_sgm(path: str, layers_per_block: int = 2) -> str:
    """diffusers UNet path -> the original SD (SGM) name, for attention and resnet modules."""
    L = layers_per_block
    m = re.match(r"down_blocks\.(\d+)\.(attentions|resnets)\.(\d+)\.(.*)", path)
    if m:
        b, kind, i, rest = m.groups()
        return f"input_blocks.{1 + int(b) * (L + 1) + int(i)}.{1 if kind == 'attentions' else 0}.{_sgm_resnet(rest)}"
    m = re.match(r"up_blocks\.(\d+)\.(attentions|resnets)\.(\d+)\.(.*)", path)
    if m:
        b, kind, i, rest = m.groups()
        return f"output_blocks.{int(b) * (L + 1) + int(i)}.{1 if kind == 'attentions' else 0}.{_sgm_resnet(rest)}"
    m = re.match(r"mid_block\.attentions\.0\.(.*)", path)
    if m:
        return f"middle_block.1.{m.group(1)}"
    m = re.match(r"mid_block\.resnets\.(\d)\.(.*)", path)
    if m:
        return f"middle_block.{2 * int(m.group(1))}.{_sgm_resnet(m.group(2))}"
    raise ValueError(f"no SGM name for {path}")


def _sgm_resnet(rest: str) -> str:
    return {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
            "conv_shortcut": "skip_connection"}.get(rest, rest)


FLUX_BFL = {  # diffusers FluxTransformer2DModel path (block 0) -> original (BFL) module name
    "transformer_blocks.0.attn.to_out.0": "double_blocks.0.img_attn.proj",
    "transformer_blocks.0.attn.to_add_out": "double_blocks.0.txt_attn.proj",
    "transformer_blocks.0.ff.net.0.proj": "double_blocks.0.img_mlp.0",
    "transformer_blocks.0.ff.net.2": "double_blocks.0.img_mlp.2",
    "single_transformer_blocks.0.proj_out": "single_blocks.0.linear2",
}


def flux_kohya_file(lora: Lora, qkv: tuple[torch.Tensor, torch.Tensor] | None = None,
                    alpha: float | None = None, comfy: bool = False, te: Lora | None = None) -> dict[str, bytes]:
    """kohya Flux: modules of FLUX_BFL from `lora`, plus an optional fused img qkv LoRA (A, B [3*D, r]).

    sd-scripts names are lora_unet_double_blocks_0_img_attn_proj; `comfy` writes ComfyUI's
    diffusion_model.double_blocks.0.img_attn.proj instead. `te` adds CLIP-L keys (lora_te1_..., with
    their alphas), as sd-scripts writes them."""
    sd = {}
    items = [(FLUX_BFL[p], A, B) for p, (A, B) in lora.weights.items()]
    if qkv is not None:
        items.append(("double_blocks.0.img_attn.qkv", *qkv))
    for bfl, A, B in items:
        name = "diffusion_model." + bfl if comfy else "lora_unet_" + bfl.replace(".", "_")
        sd[f"{name}.lora_down.weight"] = A
        sd[f"{name}.lora_up.weight"] = B
        if alpha is not None:
            sd[f"{name}.alpha"] = torch.tensor(alpha)
    if te is not None:
        sd.update(kohya_state({"text_encoder": te}, kind="sdxl"))  # CLIP-L is lora_te1_, like SDXL's first encoder
    return {"flux_lora.safetensors": save(sd)}


def flux_mixture_file(lora: Lora, te: Lora | None = None) -> dict[str, bytes]:
    """The kohya "mixture" Flux layout: diffusers module paths with underscores under lora_transformer_
    (lora_transformer_transformer_blocks_0_attn_to_q), every module with its .alpha; `te` adds lora_te1_ keys."""
    sd = {}
    for p, (A, B) in lora.weights.items():
        name = "lora_transformer_" + p.replace(".", "_")
        sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"] = A, B
        sd[f"{name}.alpha"] = torch.tensor(lora.alpha(p))
    if te is not None:
        sd.update(kohya_state({"text_encoder": te}, kind="sdxl"))
    return {"flux_mixture.safetensors": save(sd)}


def xlabs_file(proj: tuple[torch.Tensor, torch.Tensor], qkv: tuple[torch.Tensor, torch.Tensor]) -> dict[str, bytes]:
    sd = {"double_blocks.0.processor.proj_lora1.down.weight": proj[0],
          "double_blocks.0.processor.proj_lora1.up.weight": proj[1],
          "double_blocks.0.processor.qkv_lora1.down.weight": qkv[0],
          "double_blocks.0.processor.qkv_lora1.up.weight": qkv[1]}
    return {"lora.safetensors": save(sd)}
