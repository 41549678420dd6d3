"""Flux kohya DoRA (LyCORIS ``dora_wd`` through sd-scripts: ``lora_unet_<BFL module>.dora_scale`` next to
lora_down / lora_up / alpha) on a tiny FluxPipeline.

diffusers' load_lora_weights drops the magnitudes (it warns and loads the plain LoRA), so the oracle is LyCORIS
itself: its own LoConModule with weight_decompose on the fused BFL layer (qkv = [to_q; to_k; to_v]) merges W' in
float64, and W' is split back onto the diffusers modules. A blend weight c follows
PEFT's rule (c inside the norm), checked against that definition written out in float64.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings

import pytest
import torch
from torch import nn

from . import families as F

os.environ.setdefault("LYCORIS_KERNEL_BACKEND", "torch")
lycoris = pytest.importorskip("lycoris")
logging.getLogger("LyCORIS").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")
REL = 1e-5


# BFL module -> (diffusers module paths it concatenates, DoRA?, alpha). (final_layer_* and the embedders are left
# out: diffusers' converter returns them without the transformer. prefix, so neither diffusers nor fd-lora loads them)
MODULES = {
    "double_blocks.0.img_attn.qkv": (("attn.to_q", "attn.to_k", "attn.to_v"), True, 3.0),
    "double_blocks.0.txt_attn.qkv": (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), True, 1.5),
    "double_blocks.0.txt_attn.proj": (("attn.to_add_out",), True, 1.0),
    "double_blocks.0.img_mlp.0": (("ff.net.0.proj",), False, 4.0),  # a plain LoRA module in the same file
    "single_blocks.0.linear2": (("proj_out",), True, 2.0),
}


def _path(bfl: str, p: str) -> str:
    if bfl.startswith("double_blocks."):
        return f"transformer_blocks.{bfl.split('.')[1]}.{p}"
    if bfl.startswith("single_blocks."):
        return f"single_transformer_blocks.{bfl.split('.')[1]}.{p}"
    return p


def _fused(tr: nn.Module, bfl: str) -> torch.Tensor:
    return torch.cat([tr.get_submodule(_path(bfl, p)).weight.detach().double() for p in MODULES[bfl][0]])


def _file_and_oracle(tr: nn.Module) -> tuple[dict, dict, dict]:
    """(kohya state dict in fp32, {BFL module: LyCORIS-merged W' fp64}, {BFL module: its fp64 parts})."""
    sd, merged, parts = {}, {}, {}
    g = torch.Generator().manual_seed(11)
    for bfl, (_, dora, alpha) in MODULES.items():
        W = _fused(tr, bfl)
        lin = nn.Linear(W.shape[1], W.shape[0], bias=False).double()
        lin.weight.data.copy_(W)
        name = "lora_unet_" + bfl.replace(".", "_")
        mod = lycoris.modules.locon.LoConModule(name, lin, lora_dim=2, alpha=alpha, weight_decompose=dora)
        with torch.no_grad():
            mod.lora_down.weight.copy_(torch.randn(mod.lora_down.weight.shape, generator=g, dtype=torch.float64)
                                       / W.shape[1] ** .5)
            mod.lora_up.weight.copy_(torch.randn(mod.lora_up.weight.shape, generator=g, dtype=torch.float64) * .5)
            if dora:  # magnitudes away from ‖W + ΔW‖, so the rescaling shows
                mod.dora_scale.data = mod.dora_scale.data.double() * (
                    0.5 + torch.rand(mod.dora_scale.shape, generator=g, dtype=torch.float64))
            merged[bfl] = mod.get_merged_weight()[0].detach().double()
        state = {k: v.detach() for k, v in mod.custom_state_dict().items()}
        parts[bfl] = {k: v.double() for k, v in state.items()}
        sd.update({f"{name}.{k}": v.float().contiguous() for k, v in state.items()})
    return sd, merged, parts


def _reference(tr: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    ref = copy.deepcopy(tr).double()
    for bfl, W in weights.items():
        paths = MODULES[bfl][0]
        rows = [ref.get_submodule(_path(bfl, p)).weight.shape[0] for p in paths]
        with torch.no_grad():
            for p, w in zip(paths, W.split(rows)):
                ref.get_submodule(_path(bfl, p)).weight.copy_(w)
    return ref


def _peft_definition(tr: nn.Module, parts: dict, c: float) -> dict[str, torch.Tensor]:
    """W' = (W + c ΔW) · m / (‖W + c ΔW‖_row + eps) (PEFT's DoRA with the blend weight inside c, LyCORIS's eps)."""
    out = {}
    for bfl, p in parts.items():
        W = _fused(tr, bfl)
        scale = float(p["alpha"]) / p["lora_down.weight"].shape[0]
        new = W + c * scale * p["lora_up.weight"] @ p["lora_down.weight"]
        if "dora_scale" in p:
            norm = new.norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps
            new = new * p["dora_scale"] / norm
        out[bfl] = new
    return out


def _run64(model: nn.Module, x: dict) -> torch.Tensor:
    return F.run(model, {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in x.items()})


def test_flux_kohya_dora_equals_lycoris():
    base = F.build("flux")
    tr = base.transformer
    sd, merged, parts = _file_and_oracle(tr)
    assert sum(k.endswith(".dora_scale") for k in sd) == 4
    fd = copy.deepcopy(base)
    report = fd.load_fd_lora({k: v.clone() for k, v in sd.items()}, "d")
    assert report.format == "flux-kohya (LoRA 9, DoRA 8)" and not report.keys_dropped and not report.keys_unused
    assert report.keys_matched == len(sd)
    x = F.SPECS["flux"].inputs(2)
    want = _run64(_reference(tr, merged), x)
    got = F.run(fd.transformer, x)
    assert F.close(got.double(), want) < REL
    # what diffusers' load_lora_weights gives: the magnitudes dropped, a visibly different (plain LoRA) output
    dif = copy.deepcopy(base)
    dif.load_lora_weights({k: v.clone() for k, v in sd.items()}, adapter_name="d")
    assert F.close(F.run(dif.transformer, x).double(), want) > 1e-3

    fd.set_adapters(["d"], [0.6])  # the blend weight sits inside DoRA's norm (PEFT)
    want = _run64(_reference(tr, _peft_definition(tr, parts, 0.6)), x)
    assert F.close(F.run(fd.transformer, x).double(), want) < REL


def test_flux_per_input_channel_dora_is_refused():
    """Old LyCORIS's dora_scale [1, K] (wd_on_out=False) normalises columns of the fused qkv: not splittable onto
    to_q / to_k / to_v, and not what fd-lora computes; the error says so and the pipeline is left unchanged."""
    from fdlora.errors import UnsupportedFeatureError

    base = F.build("flux")
    sd, _, _ = _file_and_oracle(base.transformer)
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    sd[f"{name}.dora_scale"] = torch.ones(1, sd[f"{name}.lora_down.weight"].shape[1])
    fd = copy.deepcopy(base)
    with pytest.raises(UnsupportedFeatureError, match="per-input-channel"):
        fd.load_fd_lora(sd, "d")
    assert not fd.get_list_adapters().get("transformer")
    x = F.SPECS["flux"].inputs(1)
    assert F.close(F.run(fd.transformer, x), F.run(base.transformer, x)) == 0


@pytest.mark.parametrize("name,comp,path", [
    ("lora_transformer_transformer_blocks_0_attn_to_q", "transformer", "transformer_blocks.0.attn.to_q"),
    ("lora_te1_text_model_encoder_layers_0_self_attn_q_proj", "text_encoder",
     "text_model.encoder.layers.0.self_attn.q_proj"),
    ("diffusion_model.double_blocks.0.img_attn.proj", "transformer", "transformer_blocks.0.attn.to_out.0"),
], ids=["mixture", "clip-l", "comfy"])
def test_other_flux_kohya_layouts_keep_their_magnitudes(name, comp, path):
    """The kohya "mixture" (lora_transformer_), CLIP-L (lora_te1_) and ComfyUI spellings take the same route."""
    from fdlora.hub.formats import flux
    from fdlora.hub.formats.base import Options, Raw

    g = torch.Generator().manual_seed(3)
    mag = torch.rand(32, 1, generator=g, dtype=torch.bfloat16) + 0.5
    sd = {f"{name}.lora_down.weight": torch.randn(2, 32, generator=g),
          f"{name}.lora_up.weight": torch.randn(32, 2, generator=g), f"{name}.alpha": torch.tensor(2.0),
          f"{name}.dora_scale": mag}
    out = flux.convert_kohya(Raw(sd, {}, None, "f"), Options())
    m = out.components[comp][path]
    assert torch.equal(m.magnitude, mag.flatten().float()) and m.dora_eps == torch.finfo(torch.bfloat16).eps
    assert out.matched == len(sd) and not out.dropped and not out.unused


def test_flux_dora_scale_of_no_module_or_of_the_wrong_size_says_so():
    """A dora_scale fitting neither the module's outputs nor its inputs is a corrupt file (AdapterShapeError, nothing
    loaded); one with no lora_down / lora_up is reported unused, the rest of the file loads."""
    from fdlora.errors import AdapterShapeError
    from fdlora.hub.formats import flux
    from fdlora.hub.formats.base import Options, Raw

    a, b = "lora_unet_double_blocks_0_img_attn_proj", "lora_unet_double_blocks_0_txt_attn_proj"
    sd = {f"{a}.dora_scale": torch.rand(32, 1), f"{b}.lora_down.weight": torch.randn(2, 16),
          f"{b}.lora_up.weight": torch.randn(32, 2), f"{b}.dora_scale": torch.rand(32, 1) + 0.5}
    out = flux.convert_kohya(Raw(dict(sd), {}, None, "f"), Options())
    assert set(out.unused) == {f"{a}.dora_scale"} and "no lora_down" in out.unused[f"{a}.dora_scale"]
    assert out.matched == 3 and out.components["transformer"]["transformer_blocks.0.attn.to_add_out"].magnitude \
        is not None
    sd[f"{b}.dora_scale"] = torch.rand(30, 1)
    with pytest.raises(AdapterShapeError, match="fits neither the module's 32 outputs nor its 16 inputs"):
        flux.convert_kohya(Raw(sd, {}, None, "f"), Options())
