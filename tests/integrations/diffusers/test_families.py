"""Every diffusers LoRA family, by its pipeline class's mixin: a LoRA saved with the pipeline's own
`save_lora_weights` loads with `load_fd_lora`, and the denoiser's output equals `load_lora_weights`'
(fp32, 1e-5 relative); blends and per-prompt batches; the covered mixins are diffusers' list minus `SKIPS`.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from . import families as F

warnings.filterwarnings("ignore")

# diffusers LoRA mixins not covered here, each with why (a diffusers upgrade adding a mixin fails
# test_every_mixin_is_covered_or_skipped until it is covered in families.SPECS or listed here)
SKIPS = {
    "StableDiffusionLoraLoaderMixin": "UNet family: covered by test_diffusers_equivalence.py (sd15) and kohya tests",
    "StableDiffusionXLLoraLoaderMixin": "UNet family: covered by test_diffusers_equivalence.py (sdxl) and kohya tests",
    "AmusedLoraLoaderMixin": "diffusers cannot load with it: no pipeline class uses it (AmusedPipeline has no LoRA "
                             "mixin) and it has no load_lora_weights (LoraBaseMixin's raises NotImplementedError)",
}

REL = 1e-5
_CACHE: dict[str, dict] = {}


def family_case(key: str) -> dict:
    """Built once per module: base pipe, two LoRA folders (save_lora_weights), a diffusers-loaded pipe and an
    fd-lora-loaded one."""
    import diffusers

    if key in _CACHE:
        return _CACHE[key]
    spec = F.SPECS[key]
    base = F.build(key)
    cls = type(base)
    loras = {n: F.peft_lora(base.transformer, seed=i + 1, rank=4 + 4 * i, alpha=8.0 + 4 * i)
             for i, n in enumerate(("a", "b"))}
    saver = getattr(diffusers, spec.saver) if spec.saver else cls
    dirs = {n: F.save(saver, sd, meta) for n, (sd, meta) in loras.items()}
    ref = copy.deepcopy(base)
    for n, d in dirs.items():
        ref.load_lora_weights(d, adapter_name=n)
    fd = copy.deepcopy(base)
    reports = {n: fd.load_fd_lora(d, adapter_name=n) for n, d in dirs.items()}
    _CACHE[key] = case = {"spec": spec, "base": base, "ref": ref, "fd": fd, "dirs": dirs, "loras": loras,
                          "reports": reports}
    return case


KEYS = list(F.SPECS)


@pytest.mark.parametrize("key", KEYS)
def test_saved_lora_equals_load_lora_weights(key):
    c = family_case(key)
    x = c["spec"].inputs(1)
    assert all(r.format == "diffusers" and not r.keys_dropped and not r.keys_unused for r in c["reports"].values())
    base = F.run(c["base"].transformer, x)
    for name in ("a", "b"):
        c["ref"].set_adapters([name])
        c["fd"].set_adapters([name])
        want, got = F.run(c["ref"].transformer, x), F.run(c["fd"].transformer, x)
        assert F.close(want, base) > 1e-3, "the LoRA must visibly change the output"
        assert F.close(got, want) < REL, (key, name)


@pytest.mark.parametrize("key", KEYS)
def test_blend_equals_diffusers(key):
    c = family_case(key)
    x = c["spec"].inputs(1)
    c["ref"].set_adapters(["a", "b"], [0.7, -0.4])
    c["fd"].set_adapters(["a", "b"], [0.7, -0.4])
    assert F.close(F.run(c["fd"].transformer, x), F.run(c["ref"].transformer, x)) < REL


@pytest.mark.parametrize("key", [k for k in KEYS if F.SPECS[k].per_prompt])
def test_per_prompt_rows_equal_each_adapter(key):
    """Row i of one batch through adapter i equals that adapter alone (diffusers+PEFT), per row."""
    from fdlora.layers import registry_of_models

    c = family_case(key)
    x = c["spec"].inputs(2)
    want = []
    for i, name in enumerate(("a", "b")):
        c["ref"].set_adapters([name])
        want.append(F.run(c["ref"].transformer, x)[i])
    h = registry_of_models[c["fd"].transformer]
    with h.per_sample({2: ["a", "b"]}):
        got = F.run(c["fd"].transformer, x)
    for i in range(2):
        assert F.close(got[i], want[i]) < REL, (key, i)


def test_per_prompt_through_routed_experts_is_refused():
    """HiDream's routed MoE experts see tokens gathered across the batch: per-prompt adapters there would mix
    prompts silently, so the pipeline call refuses (blends are fine: test_blend_equals_diffusers[hidream])."""
    from fdlora.errors import FdLoraError

    c = family_case("hidream")
    with pytest.raises(FdLoraError, match="routed MoE experts"):
        c["fd"](prompt=["a", "b"], fd_lora_adapters=["a", "b"])


def test_per_prompt_through_a_sequence_first_layer_is_refused():
    """ERNIE-Image runs its MLP on [S, B, H]: contiguous rows are not one sample's, so per-prompt adapters there would
    mix prompts silently; the layer refuses (blends are fine: test_blend_equals_diffusers[ernieimage])."""
    from fdlora.errors import FdLoraError
    from fdlora.layers import registry_of_models

    c = family_case("ernieimage")
    h = registry_of_models[c["fd"].transformer]
    with pytest.raises(FdLoraError, match="not batch-first"), h.per_sample({2: ["a", "b"]}):
        F.run(c["fd"].transformer, c["spec"].inputs(2))


def test_every_mixin_is_covered_or_skipped():
    from fdlora.integrations.diffusers.family import family_of, mixins

    covered = {family_of(type(family_case(k)["base"])).mixin.__name__ for k in KEYS}
    assert not covered & set(SKIPS), "a covered mixin is still in SKIPS"
    assert covered | set(SKIPS) == set(mixins()), (
        f"diffusers mixins neither covered nor skipped: {sorted(set(mixins()) - covered - set(SKIPS))}; "
        f"skipped but gone from diffusers: {sorted(set(SKIPS) - set(mixins()))}")


def test_wan22_load_into_transformer_2():
    c = family_case("wan22")
    base, d = c["base"], c["dirs"]["a"]
    ref, fd = copy.deepcopy(base), copy.deepcopy(base)
    ref.load_lora_weights(d, adapter_name="hi", load_into_transformer_2=True)
    fd.load_fd_lora(d, "hi", load_into_transformer_2=True)
    x = c["spec"].inputs(1)
    assert F.close(F.run(fd.transformer, x), F.run(base.transformer, x)) == 0  # the first expert untouched
    want = F.run(ref.transformer_2, x)
    assert F.close(want, F.run(base.transformer_2, x)) > 1e-3
    assert F.close(F.run(fd.transformer_2, x), want) < REL
    assert fd.get_list_adapters() == {"transformer_2": ["hi"]}


def test_wan21_load_into_transformer_2_refused():
    from fdlora.errors import FdLoraError

    c = family_case("wan21")
    with pytest.raises(FdLoraError, match="no transformer_2"):
        copy.deepcopy(c["base"]).load_fd_lora(c["dirs"]["a"], "x", load_into_transformer_2=True)


@pytest.mark.parametrize("key", ["flux", "wan21", "qwenimage", "sd35", "zimage"])
def test_scale_kwarg_on_the_denoiser_equals_diffusers(key):
    """pipe.transformer(..., joint_attention_kwargs / attention_kwargs={"scale": 0.5}) as diffusers+PEFT."""
    from fdlora.integrations.diffusers.scale import scale_kwarg_of

    c = family_case(key)
    x = c["spec"].inputs(1)
    kw = scale_kwarg_of(c["base"].transformer)
    c["ref"].set_adapters(["a"])
    c["fd"].set_adapters(["a"])
    full = F.run(c["fd"].transformer, x)
    want = F.run(c["ref"].transformer, x, **{kw: {"scale": 0.5}})
    got = F.run(c["fd"].transformer, x, **{kw: {"scale": 0.5}})
    assert F.close(want, full) > 1e-4, "the scale must change the output"
    assert F.close(got, want) < REL
    assert F.close(F.run(c["fd"].transformer, x), full) == 0  # the next call is at full strength again


def test_model_level_load_on_a_diffusers_model():
    """fdlora.load_fd_lora(transformer, source) on a diffusers ModelMixin, as its load_lora_adapter."""
    import fdlora

    c = family_case("qwenimage")
    x = c["spec"].inputs(1)
    ref = copy.deepcopy(c["base"].transformer)
    ref.load_lora_adapter(c["dirs"]["a"], adapter_name="a", prefix="transformer",
                          weight_name="pytorch_lora_weights.safetensors")
    m = copy.deepcopy(c["base"].transformer)
    assert fdlora.load_fd_lora(m, c["dirs"]["a"], "a") is m
    assert F.close(F.run(m, x), F.run(ref, x)) < REL


def test_wan_video_pipeline_per_prompt_adapters_equal_diffusers():
    """A whole Wan video generation (T5 prompts, CFG as two denoiser calls, VAE decode of every frame) with one
    adapter per prompt equals diffusers+PEFT generating each prompt alone with its adapter."""
    import diffusers

    from fdlora.fixtures import tiny_pipeline as tiny

    torch.manual_seed(0)
    tr = diffusers.WanTransformer3DModel(**dict(F.WAN, text_dim=32, in_channels=16, out_channels=16)).eval()
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True]).eval()
    pipe = diffusers.WanPipeline(tokenizer=tiny.t5_tokenizer(), text_encoder=tiny.t5_te(), vae=vae,
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), transformer=tr)
    pipe.set_progress_bar_config(disable=True)
    dirs = {n: F.save(diffusers.WanPipeline, *F.peft_lora(tr, seed=i + 1)) for i, n in enumerate("ab")}
    ref, fd = copy.deepcopy(pipe), copy.deepcopy(pipe)
    for n, d in dirs.items():
        ref.load_lora_weights(d, adapter_name=n)
        fd.load_fd_lora(d, n)
    latents = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    kw = dict(height=16, width=16, num_frames=5, num_inference_steps=2, guidance_scale=4.0, output_type="pt",
              max_sequence_length=16)
    got = fd(prompt=["a cat", "a dog"], latents=latents, fd_lora_adapters=["a", "b"], **kw).frames
    for i, n in enumerate("ab"):
        ref.set_adapters([n])
        want = ref(prompt=["a cat", "a dog"][i], latents=latents[i:i + 1], **kw).frames[0]
        assert F.close(got[i], want) < 1e-4, n
    other = ref(prompt="a cat", latents=latents[:1], **kw).frames[0]  # prompt 0 through adapter b
    assert F.close(got[0], other) > 1e-3, "the adapters must give visibly different videos"
    assert fd.get_active_adapters() == ["b"]  # the blend set before the call is back


def test_unet_cross_attention_kwargs_scale_equals_diffusers():
    """The UNet spelling: pipe.unet(..., cross_attention_kwargs={"scale": 0.5}) called directly, as diffusers+PEFT."""
    import tempfile

    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from tests.support import tiny

    unet = tiny.sd15_unet()
    pipe = diffusers.StableDiffusionPipeline(vae=None, text_encoder=None, tokenizer=None, unet=unet, scheduler=None,
                                             safety_checker=None, feature_extractor=None,
                                             requires_safety_checker=False)
    m = copy.deepcopy(unet)
    torch.manual_seed(3)
    m.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "conv1"], init_lora_weights=False),
                  adapter_name="src")
    d = tempfile.mkdtemp(prefix="fdlora-unet-")
    layers = get_peft_model_state_dict(m, adapter_name="src")
    diffusers.StableDiffusionPipeline.save_lora_weights(d, unet_lora_layers=layers)
    ref, fd = copy.deepcopy(pipe), copy.deepcopy(pipe)
    ref.load_lora_weights(d, adapter_name="a")
    fd.load_fd_lora(d, "a")
    x = tiny.unet_inputs(unet, batch=1)
    kw = {"cross_attention_kwargs": {"scale": 0.5}}
    want, full = F.run(ref.unet, x, **kw), F.run(ref.unet, x)
    assert F.close(want, full) > 1e-4
    assert F.close(F.run(fd.unet, x, **kw), want) < REL
    assert F.close(F.run(fd.unet, x), full) < REL


def test_wan22_one_lora_per_expert_equals_diffusers():
    """Wan 2.2's usual setup: a high-noise LoRA in transformer, a low-noise one in transformer_2, both active."""
    c = family_case("wan22")
    base = c["base"]
    ref, fd = copy.deepcopy(base), copy.deepcopy(base)
    ref.load_lora_weights(c["dirs"]["a"], adapter_name="high")
    ref.load_lora_weights(c["dirs"]["b"], adapter_name="low", load_into_transformer_2=True)
    fd.load_fd_lora(c["dirs"]["a"], "high")
    fd.load_lora_weights(c["dirs"]["b"], adapter_name="low", load_into_transformer_2=True)  # fd-lora's, now
    for p in (ref, fd):
        p.set_adapters(["high", "low"], [0.8, 0.6])
    from peft.tuners.tuners_utils import BaseTunerLayer

    assert not any(isinstance(m, BaseTunerLayer) for c_ in ("transformer", "transformer_2")
                   for m in getattr(fd, c_).modules()), "the fd pipe must hold no PEFT layers"
    assert fd.get_list_adapters() == {"transformer": ["high"], "transformer_2": ["low"]}
    x = c["spec"].inputs(1)
    for comp in ("transformer", "transformer_2"):
        want = F.run(getattr(ref, comp), x)
        assert F.close(want, F.run(getattr(base, comp), x)) > 1e-3
        assert F.close(F.run(getattr(fd, comp), x), want) < REL, comp
