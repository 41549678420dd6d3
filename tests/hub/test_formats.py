"""Every format converts to the math its own loader applies: compared with PEFT and diffusers on tiny models."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save, save_file
from support import loras, tiny

from fdlora.errors import FormatError, UnsupportedFeatureError, UnusedKeysError
from fdlora.hub import AdapterCache, AdapterPool, load_adapters
from fdlora.hub.formats.base import peft_key
from fdlora.layers import FdLoraHandle

IDS = torch.tensor([[0, 5, 7, 9, 1]])


def write(files: dict[str, bytes], d) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data)


def run_unet(unet) -> torch.Tensor:
    with torch.no_grad():
        return unet(**tiny.unet_inputs(unet)).sample


def fd_model(model, adapter):
    """A copy of `model` with `adapter` loaded by fd-lora (paths fitted like a pipeline's pool does)."""
    m = copy.deepcopy(model)
    AdapterPool(FdLoraHandle(m)).add("x", adapter, activate=True)
    return m


def close(a: torch.Tensor, b: torch.Tensor, base: torch.Tensor) -> None:
    """Equal up to fp32 rounding, and the adapter changed the output."""
    assert (a - base).abs().max() > 1e-2
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(base.abs().max()))


# --- PEFT and diffusers save the same adapter ----------------------------------------------------
def test_peft_and_diffusers_saved_adapters_are_identical(sd15_unet, tmp_path):
    from diffusers.loaders import StableDiffusionLoraLoaderMixin
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=list(tiny.ATTN), init_lora_weights=False,
                     rank_pattern={"to_k": 2}, alpha_pattern={"to_v": 16})
    torch.manual_seed(0)
    peft_unet = get_peft_model(copy.deepcopy(sd15_unet), cfg)
    peft_unet.save_pretrained(tmp_path / "peft")
    sd = get_peft_model_state_dict(peft_unet)
    sd = {k.removeprefix("base_model.model."): v for k, v in sd.items()}
    StableDiffusionLoraLoaderMixin.save_lora_weights(tmp_path / "diffusers", unet_lora_layers=sd,
                                                     unet_lora_adapter_metadata=cfg.to_dict())
    a, ra = load_adapters(tmp_path / "peft", cache=None)
    b, rb = load_adapters(tmp_path / "diffusers", cache=None)
    assert (ra.format, rb.format) == ("peft", "diffusers") and a.keys() == b.keys() == {"unet"}
    ma, mb = a["unet"].modules, b["unet"].modules
    assert ma.keys() == mb.keys() and len(ma) == 8 * 6  # attn1 + attn2 of 6 transformer blocks
    for p in ma:
        assert torch.equal(ma[p].A, mb[p].A) and torch.equal(ma[p].B, mb[p].B) and ma[p].alpha == mb[p].alpha
    assert {m.rank for p, m in ma.items() if p.endswith("to_k")} == {2}
    assert {m.alpha for p, m in ma.items() if p.endswith("to_v")} == {16.0}
    close(run_unet(fd_model(sd15_unet, a["unet"])), run_unet(peft_unet), run_unet(sd15_unet))


# --- PEFT config semantics, against PEFT itself --------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict(
            {"q_proj": torch.nn.Linear(16, 16), "v_proj": torch.nn.Linear(16, 16), "fc": torch.nn.Linear(16, 16)})
            for _ in range(3))

    def forward(self, x):
        for b in self.layers:
            x = torch.tanh(b["q_proj"](x) + b["v_proj"](x)) + b["fc"](x)
        return x


PEFT_CASES = [
    pytest.param(dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), id="r4-alpha8"),
    pytest.param(dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "fc"], rank_pattern={"fc": 2},
                      alpha_pattern={"layers.1.q_proj": 32}), id="rank+alpha-patterns"),
    pytest.param(dict(r=4, lora_alpha=8, target_modules=["q_proj", "fc"], use_rslora=True), id="rslora"),
    pytest.param(dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_bias=True), id="lora-bias"),
    pytest.param(dict(r=4, lora_alpha=4, target_modules=["q_proj"], layers_to_transform=[0, 2],
                      layers_pattern="layers"), id="layers-to-transform"),
]


@pytest.mark.parametrize("kw", PEFT_CASES)
@pytest.mark.filterwarnings("ignore:.*invalid shape")  # PEFT misreads 1-D lora_B biases as unsharded tensors
def test_peft_config_fields_match_peft(kw, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(1)
    src = get_peft_model(Net(), LoraConfig(init_lora_weights=False, **kw))
    if kw.get("lora_bias"):
        for n, p in src.named_parameters():
            if "lora_B" in n and n.endswith("bias"):
                p.data.normal_()
    src.save_pretrained(tmp_path)
    ref = PeftModel.from_pretrained(Net(), tmp_path)
    adapters, report = load_adapters(tmp_path, cache=None)
    assert report.format == "peft" and report.keys_unused == {} and report.keys_dropped == {}
    x = torch.randn(5, 16)
    with torch.no_grad():
        close(fd_model(Net(), adapters["model"])(x), ref(x), Net()(x))


@pytest.mark.filterwarnings("ignore:.*invalid shape")
def test_lora_b_biases_under_a_config_without_lora_bias_are_left_out_as_peft_does(tmp_path):
    """lora_bias defaults to False in LoraConfig: PEFT loads no lora_B bias then, and neither does fd-lora."""
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(2)
    src = get_peft_model(Net(), LoraConfig(init_lora_weights=False, r=4, target_modules=["q_proj"], lora_bias=True))
    for n, p in src.named_parameters():
        if "lora_B" in n and n.endswith("bias"):
            p.data.normal_()
    src.save_pretrained(tmp_path)
    cfg_path = tmp_path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["lora_bias"]  # a config written before the field existed
    cfg_path.write_text(json.dumps(cfg))
    ref = PeftModel.from_pretrained(Net(), tmp_path)
    adapters, report = load_adapters(tmp_path, cache=None)
    assert all(m.bias is None for m in adapters["model"].modules.values())
    assert report.keys_unused and all("lora_bias=False" in why for why in report.keys_unused.values())
    x = torch.randn(5, 16)
    with torch.no_grad():
        close(fd_model(Net(), adapters["model"])(x), ref(x), Net()(x))


def test_peft_keys_outside_the_config_targets_are_reported_unused(tmp_path):
    lora = loras.make_lora({"layers.0.q_proj": (16, 16), "layers.0.fc": (16, 16), "layers.1.q_proj": (16, 16)})
    write(loras.peft_files(lora, target_modules=["q_proj", "fc"], exclude_modules=["layers.0.fc"],
                           layers_to_transform=[0], layers_pattern="layers"), tmp_path)
    adapters, report = load_adapters(tmp_path, cache=None)
    assert set(adapters["model"].modules) == {"layers.0.q_proj"}
    assert sum("exclude_modules" in why for why in report.keys_unused.values()) == 2
    assert sum("target_modules" in why for why in report.keys_unused.values()) == 2
    assert report.keys_matched + len(report.keys_unused) == report.keys_total


def test_fan_in_fan_out_conv1d_matches_peft(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import GPT2Config, GPT2Model

    def gpt2():
        torch.manual_seed(0)
        return GPT2Model(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)).eval()

    torch.manual_seed(2)
    src = get_peft_model(gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                            fan_in_fan_out=True, init_lora_weights=False))
    src.save_pretrained(tmp_path)
    adapters, report = load_adapters(tmp_path, cache=None)
    assert report.configs["model"]["fan_in_fan_out"] is True
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        ref = PeftModel.from_pretrained(gpt2(), tmp_path)(ids).last_hidden_state
        close(fd_model(gpt2(), adapters["model"])(ids).last_hidden_state, ref, gpt2()(ids).last_hidden_state)


DORA = {  # how a DoRA file fd-lora cannot load says so -> (error, what it must say); loading: tests/hub/test_lycoris.py
    "config": (FormatError, "use_dora=True but"), "keys": (None, ""),
    "kohya": (UnsupportedFeatureError, "per-input-channel"),
    "kohya-flux": (UnsupportedFeatureError, "per-input-channel")}  # (Flux DoRA per output: test_flux_dora.py)
KOHYA_NAMES = {"kohya": "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q",
               "kohya-flux": "lora_unet_double_blocks_0_img_attn_proj"}


@pytest.mark.parametrize("how", list(DORA))
def test_dora_files_load_or_say_why(how, tmp_path):
    lora = loras.make_lora({"layers.0.q_proj": (16, 16)})
    files = loras.peft_files(lora, use_dora=how == "config")  # (a use_dora config, but no magnitudes)
    if how == "keys":  # PEFT magnitudes: a DoRA, config or not
        sd = loras.peft_state(lora, "base_model.model.")
        sd["base_model.model.layers.0.q_proj.lora_magnitude_vector"] = torch.ones(16)
        files["adapter_model.safetensors"] = save(sd)
    elif how in KOHYA_NAMES:  # an old LyCORIS DoRA: a dora_scale [1, in] (per input channel) next to lora_down / up
        (A, B), name = lora.weights["layers.0.q_proj"], KOHYA_NAMES[how]
        sd = {f"{name}.lora_down.weight": A, f"{name}.lora_up.weight": B, f"{name}.alpha": torch.tensor(4.0),
              f"{name}.dora_scale": torch.ones(1, 16)}
        files = {"lora.safetensors": save(sd)}
    write(files, tmp_path)
    error, says = DORA[how]
    if error is None:
        adapters, _ = load_adapters(tmp_path, cache=None)
        assert torch.equal(adapters["model"].modules["layers.0.q_proj"].magnitude, torch.ones(16))
        return
    with pytest.raises(error, match=says):
        load_adapters(tmp_path, cache=None)


# --- diffusers format ----------------------------------------------------------------------------
def test_diffusers_alpha_sources(tmp_path, sd15_unet):
    shapes = tiny.shapes(sd15_unet, ("attn1.to_q", "attn2.to_k"))
    lora = loras.make_lora(shapes, rank=4, seed=4)
    lora.alphas = {p: 2.0 if "attn1" in p else 8.0 for p in shapes}
    meta = {"unet": {"r": 4, "lora_alpha": 2.0, "alpha_pattern": {"attn2.to_k": 8.0},
                     "target_modules": sorted(shapes)}}
    cases = {"metadata": loras.diffusers_files({"unet": lora}, metadata=meta),
             "network-alphas": loras.diffusers_files({"unet": lora}, network_alphas=True),
             "none": loras.diffusers_files({"unet": lora})}
    got = {}
    for name, files in cases.items():
        write(files, tmp_path / name)
        adapters, report = load_adapters(tmp_path / name, cache=None)
        assert report.format == "diffusers" and not report.keys_unused and not report.keys_dropped
        got[name] = {p: m.alpha for p, m in adapters["unet"].modules.items()}
    assert got["metadata"] == got["network-alphas"] == lora.alphas
    assert set(got["none"].values()) == {4.0}  # alpha = rank: diffusers' convention without alphas


def test_old_diffusers_key_names(tmp_path, sd15_unet, clip_te):
    """Pre-PEFT diffusers spellings (to_q_lora.down, lora_linear_layer, .processor.) rename like diffusers does."""
    u = tiny.shapes(sd15_unet, ("attn1.to_q", "attn1.to_out.0"))
    t = {"text_model." + p.removeprefix("text_model."): s for p, s in tiny.shapes(clip_te, ("q_proj", "fc1")).items()}
    ul, tl = loras.make_lora(u, seed=5), loras.make_lora(t, seed=6)
    sd = {}
    for p, (A, B) in ul.weights.items():
        old = p.replace("attn1.to_q", "attn1.processor.to_q_lora")
        old = old.replace("attn1.to_out.0", "attn1.processor.to_out_lora")
        sd[f"unet.{old}.down.weight"], sd[f"unet.{old}.up.weight"] = A, B
    for p, (A, B) in tl.weights.items():
        old = p.replace("self_attn.q_proj", "self_attn.to_q_lora").replace("mlp.fc1", "mlp.fc1.lora_linear_layer")
        sd[f"text_encoder.{old}.down.weight"], sd[f"text_encoder.{old}.up.weight"] = A, B
    save_file(sd, tmp_path / "pytorch_lora_weights.safetensors")
    adapters, report = load_adapters(tmp_path, cache=None)
    assert report.keys_matched == len(sd) and set(adapters) == {"unet", "text_encoder"}
    for comp, lora in (("unet", ul), ("text_encoder", tl)):
        mods = adapters[comp].modules
        assert mods.keys() == lora.weights.keys()
        assert all(torch.equal(mods[p].A, A) and torch.equal(mods[p].B, B) for p, (A, B) in lora.weights.items())


# --- kohya SD1.5 / SDXL, against diffusers' loader -----------------------------------------------
def te_paths(te) -> dict[str, tuple]:
    """Text-encoder shapes named as LoRA files name them (with text_model.), whatever transformers' layout."""
    return {"text_model." + p.removeprefix("text_model."): s for p, s in tiny.shapes(te, tiny.TE).items()}


@pytest.mark.parametrize("kind,sgm", [("sd15", False), ("sdxl", False), ("sdxl", True)],
                         ids=["sd15", "sdxl", "sdxl-sgm-names"])
def test_kohya_matches_diffusers(kind, sgm, sd15_unet, sdxl_unet, clip_te, clip_te2, tmp_path):
    from diffusers.loaders import StableDiffusionLoraLoaderMixin, StableDiffusionXLLoraLoaderMixin

    unet = sd15_unet if kind == "sd15" else sdxl_unet
    tes = {"text_encoder": clip_te} if kind == "sd15" else {"text_encoder": clip_te, "text_encoder_2": clip_te2}
    comps = {"unet": loras.make_lora(tiny.shapes(unet, tiny.ATTN + ("ff.net.2",), convs=("conv1",)), rank=4,
                                     seed=7, alpha=2.0)}
    for i, (c, te) in enumerate(tes.items()):
        comps[c] = loras.make_lora(te_paths(te), rank=4, seed=8 + i, alpha=8.0)
    write(loras.kohya_file(comps, kind=kind, sgm=sgm), tmp_path)
    adapters, report = load_adapters(tmp_path / "lora.safetensors", cache=None)
    assert report.format == "kohya" and report.keys_matched == report.keys_total
    assert {c: report.components[c] for c in comps} == {c: len(lora.weights) for c, lora in comps.items()}
    assert any(m.kind == "conv2d" for m in adapters["unet"].modules.values())  # LoCon conv keys

    mixin = StableDiffusionLoraLoaderMixin if kind == "sd15" else StableDiffusionXLLoraLoaderMixin
    sd, alphas = mixin.lora_state_dict(str(tmp_path / "lora.safetensors"), unet_config=unet.config)
    ref_unet = copy.deepcopy(unet)
    mixin.load_lora_into_unet(sd, alphas, ref_unet, adapter_name="x")
    close(run_unet(fd_model(unet, adapters["unet"])), run_unet(ref_unet), run_unet(unet))
    for comp, te in tes.items():
        ref_te = copy.deepcopy(te)
        mixin.load_lora_into_text_encoder(sd, alphas, ref_te, prefix=comp, adapter_name="x")
        with torch.no_grad():
            close(fd_model(te, adapters[comp])(IDS).last_hidden_state, ref_te(IDS).last_hidden_state,
                  te(IDS).last_hidden_state)


def test_kohya_alpha_is_per_module(sd15_unet, tmp_path):
    """kohya scales each module by its own .alpha; diffusers folds alphas by name and can miss attention ones."""
    shapes = tiny.shapes(sd15_unet, ("attn1.to_q", "ff.net.2", "ff.net.0.proj"))
    lora = loras.make_lora(shapes, rank=4, seed=9)
    lora.alphas = {p: 1.0 if p.endswith("to_q") else 8.0 for p in shapes}
    write(loras.kohya_file({"unet": lora}), tmp_path)
    adapters, _ = load_adapters(tmp_path / "lora.safetensors", cache=None)
    assert {p: m.alpha for p, m in adapters["unet"].modules.items()} == lora.alphas


# --- Flux ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux():
    return tiny.flux_transformer()


# Modules diffusers' lora_transformer_ ("mixture") converter maps: it names a block's ff / proj_mlp / proj_out
# LoRA after the whole block (transformer_blocks.0), which neither diffusers nor fd-lora can load into a model.
FLUX_MIXTURE = ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj",
                "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.to_add_out",
                "single_transformer_blocks.0.attn.to_v", "x_embedder", "context_embedder", "proj_out")


def per_module_alphas(lora: loras.Lora) -> loras.Lora:
    """Alphas 1, 2, 8, 1, ... by module, so a module given another's alpha shows in the output."""
    lora.alphas = {p: (1.0, 2.0, 8.0)[i % 3] for i, p in enumerate(lora.weights)}
    return lora


def flux_lora(flux, paths, seed: int) -> loras.Lora:
    shapes = tiny.shapes(flux, tuple(paths))
    return loras.make_lora({p: shapes[p] for p in paths}, rank=4, seed=seed)


def flux_layout_file(layout: str, flux) -> dict[str, bytes]:
    if layout == "kohya-mixture":
        return loras.flux_mixture_file(per_module_alphas(flux_lora(flux, FLUX_MIXTURE, seed=12)))
    if layout == "ai-toolkit":  # transformer.<path>.lora_A/B.weight + transformer.<path>.alpha
        paths = [*loras.FLUX_BFL, "transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k"]
        return loras.diffusers_files({"transformer": per_module_alphas(flux_lora(flux, paths, seed=13))},
                                     network_alphas=True)
    lora = flux_lora(flux, loras.FLUX_BFL, seed=10)
    g = torch.Generator().manual_seed(11)
    qkv = (torch.randn(6, 32, generator=g) / 6, torch.randn(96, 6, generator=g))
    if layout == "xlabs":
        return loras.xlabs_file(lora.weights["transformer_blocks.0.attn.to_out.0"], qkv)
    return loras.flux_kohya_file(lora, qkv=qkv, alpha=2.0, comfy=layout == "comfy")


@pytest.mark.parametrize("layout", ["kohya", "comfy", "xlabs", "kohya-mixture", "ai-toolkit"])
@pytest.mark.filterwarnings("ignore:While injecting the PEFT")  # the reference: PEFT's target "proj_out" also
# wraps single_transformer_blocks.0.proj_out, with no weights for it (an unused, zero-B layer)
def test_flux_layouts_match_diffusers(layout, flux, tmp_path):
    from diffusers.loaders import FluxLoraLoaderMixin

    files = flux_layout_file(layout, flux)
    write(files, tmp_path)
    path = tmp_path / next(iter(files))
    adapters, report = load_adapters(path, cache=None)
    assert report.format == {"xlabs": "flux-xlabs", "ai-toolkit": "diffusers"}.get(layout, "flux-kohya")
    assert report.keys_matched == report.keys_total and set(adapters) == {"transformer"}
    sd, alphas = FluxLoraLoaderMixin.lora_state_dict(str(path), return_alphas=True)
    ref = copy.deepcopy(flux)
    FluxLoraLoaderMixin.load_lora_into_transformer(sd, alphas, ref, adapter_name="x")
    inputs = tiny.flux_inputs(flux)
    with torch.no_grad():
        close(fd_model(flux, adapters["transformer"])(**inputs).sample, ref(**inputs).sample, flux(**inputs).sample)


@pytest.mark.parametrize("layout", ["kohya", "kohya-mixture"])
def test_flux_kohya_text_encoder_matches_diffusers(layout, flux, clip_te, tmp_path):
    """The lora_te1_ (CLIP-L) part of a kohya Flux file, against diffusers' converter and its text-encoder loader."""
    from diffusers.loaders import FluxLoraLoaderMixin

    te = per_module_alphas(loras.make_lora(te_paths(clip_te), rank=4, seed=14))
    den = flux_lora(flux, ["transformer_blocks.0.attn.to_out.0"], seed=15)
    files = loras.flux_kohya_file(den, alpha=2.0, te=te) if layout == "kohya" else loras.flux_mixture_file(den, te=te)
    write(files, tmp_path)
    path = tmp_path / next(iter(files))
    adapters, report = load_adapters(path, cache=None)
    assert report.format == "flux-kohya" and report.keys_matched == report.keys_total
    assert report.components == {"transformer": 1, "text_encoder": len(te.weights)}
    sd, alphas = FluxLoraLoaderMixin.lora_state_dict(str(path), return_alphas=True)
    ref = copy.deepcopy(clip_te)
    FluxLoraLoaderMixin.load_lora_into_text_encoder(sd, alphas, ref, prefix="text_encoder", adapter_name="x")
    with torch.no_grad():
        close(fd_model(clip_te, adapters["text_encoder"])(IDS).last_hidden_state, ref(IDS).last_hidden_state,
              clip_te(IDS).last_hidden_state)


def test_flux_mixture_modules_mapped_onto_one_are_dropped(flux, tmp_path):
    """diffusers' converter maps a lora_transformer_ block's ff.net.0.proj and ff.net.2 both onto the bare block
    name: neither can be applied faithfully, so both are dropped with the reason; the rest loads."""
    paths = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.ff.net.2"]
    files = loras.flux_mixture_file(flux_lora(flux, paths, seed=16))
    write(files, tmp_path)
    adapters, report = load_adapters(tmp_path / next(iter(files)), cache=None)
    dropped = [k for k in report.keys_dropped if "same module" in report.keys_dropped[k]]
    assert sorted({k.split(".")[0] for k in dropped}) == ["lora_transformer_transformer_blocks_0_ff_net_0_proj",
                                                         "lora_transformer_transformer_blocks_0_ff_net_2"]
    assert list(adapters["transformer"].modules) == ["transformer_blocks.0.attn.to_q"]
    assert report.keys_matched == 3  # to_q's lora_down, lora_up, alpha
    with pytest.raises(UnusedKeysError):
        load_adapters(tmp_path / next(iter(files)), cache=None, strict=True)


def test_flux_drops_are_reported(tmp_path):
    sd = {"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": torch.randn(2, 32),
          "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": torch.randn(32, 2),
          "lora_unet_double_blocks_0_img_norm.diff": torch.randn(32),
          "text_encoders.t5xxl.transformer.encoder.block_0.lora_down.weight": torch.randn(2, 8),
          "lora_unet_double_blocks_0_no_such_layer.lora_down.weight": torch.randn(2, 32),
          "lora_unet_double_blocks_0_no_such_layer.lora_up.weight": torch.randn(32, 2)}
    save_file(sd, tmp_path / "f.safetensors")
    adapters, report = load_adapters(tmp_path / "f.safetensors", cache=None)
    assert report.keys_matched == 2 and len(report.keys_dropped) == 4
    assert "T5" in report.keys_dropped["text_encoders.t5xxl.transformer.encoder.block_0.lora_down.weight"]
    assert "diff" in report.keys_dropped["lora_unet_double_blocks_0_img_norm.diff"]
    assert "diffusers' Flux converter" in report.keys_dropped["lora_unet_double_blocks_0_no_such_layer.lora_up.weight"]


# --- components and the report -------------------------------------------------------------------
@pytest.mark.parametrize("paths,component", [
    (["down_blocks.1.attentions.0.proj_in"], "unet"),
    (["transformer_blocks.0.attn.to_q"], "transformer"),
    (["text_model.encoder.layers.0.self_attn.q_proj"], "text_encoder"),
    (["encoder.layers.0.mlp.fc1"], "text_encoder"),
    (["model.layers.0.self_attn.q_proj"], "model"),
])
def test_single_model_component_detection(paths, component):
    sd = loras.peft_state(loras.make_lora({p: (8, 8) for p in paths}))
    adapters, report = load_adapters(sd, cache=None)
    assert report.format == "peft-bare" and set(adapters) == {component}
    forced, _ = load_adapters(sd, component="text_encoder_2", cache=None)
    assert set(forced) == {"text_encoder_2"}
    assert adapters[component].provenance.component == component


def test_report_prints_what_and_why(sd15_unet, tmp_path):
    lora = loras.make_lora(tiny.shapes(sd15_unet, ("to_q",)), rank=4, alpha=2.0)
    sd = loras.kohya_state({"unet": lora})
    sd["lora_unet_stray_key"] = torch.zeros(1)
    save_file(sd, tmp_path / "style.safetensors", metadata={"ss_network_module": "networks.lora"})
    _, report = load_adapters(tmp_path, cache=None)
    text = str(report)
    for needle in ("format    kohya", "style.safetensors: the only .safetensors file", "unet: 12 modules",
                   "attn1.to_q", "scale 0.5", "1 unused", "lora_unet_stray_key"):
        assert needle in text, text
    meta = json.loads(json.dumps(report.configs))  # the report is plain data
    assert isinstance(meta, dict)


def test_strict_raises_on_dropped_keys(tmp_path):
    """A module with lora_A but no lora_B is dropped (not unused); strict=True refuses it, from the RAM cache too."""
    lora = loras.make_lora({"transformer_blocks.0.attn.to_q": (8, 8), "transformer_blocks.0.attn.to_k": (8, 8)})
    sd = loras.peft_state(lora, "transformer.")
    del sd["transformer.transformer_blocks.0.attn.to_k.lora_B.weight"]
    save_file(sd, tmp_path / "pytorch_lora_weights.safetensors")
    ram = AdapterCache(max_bytes=1 << 30)
    adapters, report = load_adapters(tmp_path, cache=ram)
    assert set(adapters["transformer"].modules) == {"transformer_blocks.0.attn.to_q"} and report.keys_unused == {}
    assert list(report.keys_dropped) == ["transformer.transformer_blocks.0.attn.to_k.lora_A.weight"]  # file's spelling
    with pytest.raises(UnusedKeysError, match=r"0 keys are unused, 1 dropped:\n  transformer\..*to_k.lora_A.weight"):
        load_adapters(tmp_path, strict=True, cache=ram)
    assert ram.hits == 1  # the strict load was answered by the cache, and still refused


def test_state_dict_source_with_config():
    lora = loras.make_lora({"layers.0.q_proj": (16, 16)}, rank=4)
    adapters, report = load_adapters(loras.peft_state(lora, "base_model.model."),
                                     config={"r": 4, "lora_alpha": 16, "target_modules": ["q_proj"]}, cache=None)
    assert report.kind == "memory" and adapters["model"].modules["layers.0.q_proj"].alpha == 16.0


def test_reads_back_what_it_was_given(tmp_path):
    """A canonical adapter written as PEFT and read back is bit-identical (dtype kept unless asked)."""
    lora = loras.make_lora({"layers.0.q_proj": (16, 16)}, rank=3, dtype=torch.bfloat16)
    write(loras.peft_files(lora), tmp_path)
    a, _ = load_adapters(tmp_path, cache=None)
    h, r = load_adapters(tmp_path, dtype=torch.float16, cache=None)
    m = a["model"].modules["layers.0.q_proj"]
    assert m.A.dtype == torch.bfloat16 and torch.equal(m.A, load_file(tmp_path / "adapter_model.safetensors")[
        "base_model.model.layers.0.q_proj.lora_A.weight"])
    assert h["model"].modules["layers.0.q_proj"].B.dtype == torch.float16 and r.dtype == "float16"


PEFT_KEY = re.compile(r"(?P<path>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias)")


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", ".", "_", "lora_A", "lora_B", "weight", "bias", ".lora_A.weight",
                                 ".lora_B.bias", "lora_B.weight"]), max_size=8).map("".join))
def test_peft_key_splits_keys_as_the_peft_key_pattern(key):
    m = PEFT_KEY.fullmatch(key)  # the pattern the loaders used before peft_key
    assert peft_key(key) == (None if m is None else (m["path"], m["part"]))
