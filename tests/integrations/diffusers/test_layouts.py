"""Community layouts per family (ComfyUI ``diffusion_model.`` with lora_down/lora_up + alpha or lora_A/lora_B,
musubi / kohya ``lora_unet_``, unprefixed ``<module>.lora_down + alpha``, original-model names) load through
the pipeline family's own diffusers converter and equal `load_lora_weights` on the same state dict."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

from . import families as F

warnings.filterwarnings("ignore")
REL = 1e-5


def wan_name(path: str) -> str | None:
    f = re.fullmatch(r"blocks\.(\d+)\.ffn\.net\.(0\.proj|2)", path)
    if f:
        return f"blocks.{f[1]}.ffn.{f[2][0]}"
    m = re.fullmatch(r"blocks\.(\d+)\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)", path)
    if not m:
        return None
    attn = {"attn1": "self_attn", "attn2": "cross_attn"}[m[2]]
    return f"blocks.{m[1]}.{attn}.{ {'to_q': 'q', 'to_k': 'k', 'to_v': 'v', 'to_out.0': 'o'}[m[3]] }"


def attention_only(pattern: str):
    rx = re.compile(pattern)
    return lambda path: path if rx.fullmatch(path) else None


QWEN = attention_only(r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|to_add_out)|"
                      r"transformer_blocks\.\d+\.img_mlp\.net\.2")
ZIMAGE = attention_only(r"layers\.\d+\.attention\.(to_q|to_k|to_v|to_out\.0)|layers\.\d+\.feed_forward\.w2")
LTX = attention_only(r"transformer_blocks\.\d+\.attn[12]\.(to_q|to_v|to_out\.0)|transformer_blocks\.\d+\.ff\.net\.2")
HIDREAM = attention_only(r"double_stream_blocks\.\d+\.block\.attn1\.(to_q|to_k|to_v|to_out)")
FLUX2 = attention_only(r"(single_)?transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|to_out)")


def musubi(name: str) -> str:
    return "lora_unet_" + name.replace(".", "_")


LAYOUTS = {  # (family key, naming of a diffusers module path, key prefix function, down/up names, alpha?)
    "wan21-comfy-down-alpha": ("wan21", wan_name, lambda n: f"diffusion_model.{n}", ("lora_down", "lora_up"), True),
    "wan21-comfy-AB": ("wan21", wan_name, lambda n: f"diffusion_model.{n}", ("lora_A", "lora_B"), False),
    "wan21-musubi": ("wan21", wan_name, musubi, ("lora_down", "lora_up"), True),
    "wan22-comfy-down-alpha": ("wan22", wan_name, lambda n: f"diffusion_model.{n}", ("lora_down", "lora_up"), True),
    "qwenimage-comfy-down-alpha": ("qwenimage", QWEN, lambda n: f"diffusion_model.{n}", ("lora_down", "lora_up"),
                                   True),
    "qwenimage-comfy-AB": ("qwenimage", QWEN, lambda n: f"diffusion_model.{n}", ("lora_A", "lora_B"), False),
    "qwenimage-musubi": ("qwenimage", QWEN, musubi, ("lora_down", "lora_up"), True),
    "qwenimage-unprefixed-down-alpha": ("qwenimage", QWEN, lambda n: n, ("lora_down", "lora_up"), True),
    "zimage-comfy-down-alpha": ("zimage", ZIMAGE, lambda n: f"diffusion_model.{n}", ("lora_down", "lora_up"), True),
    "zimage-musubi": ("zimage", ZIMAGE, musubi, ("lora_down", "lora_up"), True),
    "zimage-unprefixed-down-alpha": ("zimage", ZIMAGE, lambda n: n, ("lora_down", "lora_up"), True),
    "ltxvideo-comfy-AB": ("ltxvideo", LTX, lambda n: f"diffusion_model.{n}", ("lora_A", "lora_B"), False),
    "hidream-comfy-AB": ("hidream", HIDREAM, lambda n: f"diffusion_model.{n}", ("lora_A", "lora_B"), False),
    "flux2-comfy-AB": ("flux2", FLUX2, lambda n: f"diffusion_model.{n}", ("lora_A", "lora_B"), False),
}


def community_state(key: str, model, rank: int = 4, alpha: float = 2.0, seed: int = 7) -> dict[str, torch.Tensor]:
    """A random LoRA on the layout's modules of `model`, spelled as the layout spells it."""
    _, name_of, prefix, (down, up), with_alpha = LAYOUTS[key]
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for path, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or (name := name_of(path)) is None:
            continue
        k = prefix(name)
        sd[f"{k}.{down}.weight"] = torch.randn(rank, m.in_features, generator=g) / m.in_features ** 0.5
        sd[f"{k}.{up}.weight"] = torch.randn(m.out_features, rank, generator=g)
        if with_alpha:
            sd[f"{k}.alpha"] = torch.tensor(alpha)
    assert sd, key
    return sd


_BASES: dict[str, object] = {}


def base_of(fam: str):
    if fam not in _BASES:
        _BASES[fam] = F.build(fam)
    return _BASES[fam]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_load_lora_weights(layout):
    fam = LAYOUTS[layout][0]
    base = base_of(fam)
    sd = community_state(layout, base.transformer)
    ref, fd = copy.deepcopy(base), copy.deepcopy(base)
    ref.load_lora_weights({k: v.clone() for k, v in sd.items()}, adapter_name="c")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may be dropped
        report = fd.load_fd_lora(sd, "c")
    assert report.format.endswith("-diffusers-converter"), report.format
    assert not report.keys_dropped and not report.keys_unused, str(report)
    assert report.keys_matched == len(sd)
    x = F.SPECS[fam].inputs(1)
    want = F.run(ref.transformer, x)
    assert F.close(want, F.run(base.transformer, x)) > 1e-3, "the LoRA must change the output"
    assert F.close(F.run(fd.transformer, x), want) < REL


def test_hunyuan_original_layout():
    """HunyuanVideo's original names (fused img_attn_qkv split by diffusers' converter)."""
    base = base_of("hunyuanvideo")
    tr = base.transformer
    g = torch.Generator().manual_seed(3)
    sd = {}
    for i, blk in enumerate(tr.transformer_blocks):
        K, N = blk.attn.to_q.in_features, blk.attn.to_q.out_features
        sd[f"diffusion_model.double_blocks.{i}.img_attn_qkv.lora_A.weight"] = torch.randn(4, K, generator=g) / K ** .5
        sd[f"diffusion_model.double_blocks.{i}.img_attn_qkv.lora_B.weight"] = torch.randn(3 * N, 4, generator=g)
        sd[f"diffusion_model.double_blocks.{i}.img_attn_proj.lora_A.weight"] = torch.randn(4, N, generator=g) / N ** .5
        sd[f"diffusion_model.double_blocks.{i}.img_attn_proj.lora_B.weight"] = torch.randn(N, 4, generator=g)
    ref, fd = copy.deepcopy(base), copy.deepcopy(base)
    ref.load_lora_weights({k: v.clone() for k, v in sd.items()}, adapter_name="c")
    report = fd.load_fd_lora(sd, "c")
    assert report.format == "hunyuanvideo-diffusers-converter" and not report.keys_dropped
    x = F.SPECS["hunyuanvideo"].inputs(1)
    want = F.run(ref.transformer, x)
    assert F.close(want, F.run(base.transformer, x)) > 1e-3
    assert F.close(F.run(fd.transformer, x), want) < REL


def test_flux_comfy_layout_goes_through_the_flux_table():
    """Flux keeps fd-lora's module-by-module kohya path (diffusers' converter inside), equal to diffusers."""
    base = base_of("flux")
    tr = base.transformer
    g = torch.Generator().manual_seed(5)
    sd = {}
    blk = tr.transformer_blocks[0]
    for name, lin in (("img_attn.proj", blk.attn.to_out[0]), ("txt_attn.proj", blk.attn.to_add_out)):
        k = f"diffusion_model.double_blocks.0.{name}"
        sd[f"{k}.lora_down.weight"] = torch.randn(4, lin.in_features, generator=g) / lin.in_features ** .5
        sd[f"{k}.lora_up.weight"] = torch.randn(lin.out_features, 4, generator=g)
        sd[f"{k}.alpha"] = torch.tensor(2.0)
    ref, fd = copy.deepcopy(base), copy.deepcopy(base)
    ref.load_lora_weights({k: v.clone() for k, v in sd.items()}, adapter_name="c")
    report = fd.load_fd_lora(sd, "c")
    assert report.format == "flux-kohya"
    x = F.SPECS["flux"].inputs(1)
    assert F.close(F.run(fd.transformer, x), F.run(ref.transformer, x)) < REL


def test_wan_comfy_file_is_not_taken_for_flux():
    """Detection asks the family first: a Wan ``diffusion_model.`` file is a Wan file on a Wan pipeline (it was
    'detected as flux-kohya' before), while on its own (no pipeline) the generic table still applies."""
    from fdlora.hub import load_adapters
    from fdlora.integrations.diffusers.family import family_of

    sd = community_state("wan21-comfy-down-alpha", base_of("wan21").transformer)
    _, report = load_adapters(sd, family=family_of(base_of("wan21")), cache=None)
    assert report.format == "wan-diffusers-converter"
    assert "flux-kohya" not in report.also_matched


def test_unconvertible_file_names_diffusers_error():
    from fdlora.errors import FormatError

    fd = copy.deepcopy(base_of("wan21"))
    sd = {"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(4, 24),
          "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.zeros(24, 4),
          "diffusion_model.blocks.0.weird_thing.lora_down.weight": torch.zeros(4, 24),
          "diffusion_model.blocks.0.weird_thing.lora_up.weight": torch.zeros(24, 4)}
    with pytest.raises(FormatError, match="WanLoraLoaderMixin"):
        fd.load_fd_lora(sd, "bad")


@pytest.mark.parametrize("layout", ["wan21-musubi", "qwenimage-unprefixed-down-alpha"])
def test_model_level_load_reads_the_models_family(layout):
    """fdlora.load_fd_lora(transformer, state_dict): the model's family (WanTransformer3DModel -> Wan) converts it."""
    import fdlora

    fam = LAYOUTS[layout][0]
    base = base_of(fam)
    sd = community_state(layout, base.transformer)
    ref = copy.deepcopy(base)
    ref.load_lora_weights({k: v.clone() for k, v in sd.items()}, adapter_name="c")
    m = copy.deepcopy(base.transformer)
    fdlora.load_fd_lora(m, sd, "c")
    x = F.SPECS[fam].inputs(1)
    assert F.close(F.run(m, x), F.run(ref.transformer, x)) < REL
    fdlora.set_adapters(m, ["c"], [0.5])
    ref.set_adapters(["c"], [0.5])
    assert F.close(F.run(m, x), F.run(ref.transformer, x)) < REL
