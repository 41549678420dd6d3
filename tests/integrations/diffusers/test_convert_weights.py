"""from_diffusers / from_peft after diffusers' or PEFT's adapter weights were set: the converted adapters keep their own
alpha / r, the weights active at conversion carry over as fd-lora's blend weights (one number, or per layer for
block-wise weights), and after conversion `fdlora.set_adapters(names, weights)` means what diffusers' / PEFT's
`set_adapters(names, weights)` means (a multiplier of alpha / r). Checked against diffusers+PEFT on the same weights,
tiny SD1.5 UNet and CLIP text encoder, fp32: relative L2 <= 1e-5."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("diffusers")

import fdlora  # noqa: E402

NAMES = ["a0", "a1", "a2", "a3"]
UNET_TARGETS = [["to_q", "to_v", "to_out.0"], ["to_k", "to_v", "conv1"], ["to_q", "ff.net.2"], ["to_out.0", "proj_in"]]
TE_TARGETS = [["q_proj", "v_proj"], ["k_proj", "out_proj"], ["q_proj"], ["v_proj", "out_proj"]]
LATER = [[0.7, 0.5, 0.3, 0.2], [1.0, 1.0, 1.0, 1.0], [-0.4, 1.3, 0.0, 0.9]]
TOL = 1e-5


def _lora_state(model, targets, r, alpha, seed, prefix):
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    m = copy.deepcopy(model)
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False), m, "x")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return {prefix + k: v for k, v in get_peft_model_state_dict(m, adapter_name="x").items()}


@pytest.fixture(scope="module")
def loaded():
    """A tiny SD1.5 pipeline with four diffusers+PEFT adapters (ranks 4/8/4/16, alpha != r) on the UNet and the text
    encoder."""
    from fdlora.fixtures import tiny_pipeline as tiny

    pipe = tiny.sd15()
    for i, n in enumerate(NAMES):
        r = (4, 8, 4, 16)[i]
        sd = {**_lora_state(pipe.unet, UNET_TARGETS[i], r, 3 * r // 2 + i, 10 + i, "unet."),
              **_lora_state(pipe.text_encoder, TE_TARGETS[i], r, 2 * r + i, 20 + i, "text_encoder.")}
        pipe.load_lora_weights(sd, adapter_name=n)
    return pipe


def _slider(p):  # the case: all four weighted, then one slider moved
    p.set_adapters(NAMES, [0.7, 0.5, 0.3, 0.2])
    p.set_adapters(["a0"], [0.61])


def _components(p):  # diffusers' component weight dicts, then two of them weighted again (the others inactive)
    p.set_adapters(NAMES, [{"unet": 0.7, "text_encoder": 0.2}, {"unet": 0.5, "text_encoder": 1.3}, 0.3,
                           {"unet": -0.6}])
    p.set_adapters(["a1", "a0"], [{"unet": 0.45, "text_encoder": 0.8}, {"text_encoder": 1.7}])


def _blocks(p):  # block weight dicts: per UNet block, active at conversion (per-layer weights carry over)
    p.set_adapters(["a0", "a1", "a3"], [{"unet": {"down": 0.3, "mid": 1.2, "up": {"block_0": [0.8, 0.1, 1.6]}},
                                         "text_encoder": 0.4},
                                        {"unet": {"down": {"block_1": [1.5, -0.5]}, "up": 0.25}}, 0.9])


def _blocks_then_switch(p):  # block weights, then another set active (the block-weighted ones inactive)
    _blocks(p)
    p.set_adapters(["a2", "a3"], [0.35, 1.1])


def _peft_set_adapter(p):  # weights set by diffusers, then PEFT's own set_adapter on each component
    from peft.functional import set_adapter

    p.set_adapters(NAMES, [0.7, 0.5, 0.3, 0.2])
    set_adapter(p.unet, ["a1", "a2"], inference_mode=True)  # active again at their last weights
    set_adapter(p.text_encoder, "a1", inference_mode=True)


HISTORIES = [
    pytest.param(_slider, id="set_adapters-then-one-slider"),
    pytest.param(_components, id="component-weight-dicts"),
    pytest.param(_blocks, id="block-weight-dicts-active"),
    pytest.param(_blocks_then_switch, id="block-weight-dicts-then-switch"),
    pytest.param(_peft_set_adapter, id="peft-set_adapter"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _outputs(p):
    from support.tiny import unet_inputs

    tokens = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return p.unet(**unet_inputs(p.unet)).sample, p.text_encoder(tokens)[0]


def _base_outputs(p):
    """Outputs with every adapter off (to check that the compared outputs carry LoRA)."""
    p.disable_lora()
    try:
        return _outputs(p)
    finally:
        p.enable_lora()


@pytest.mark.parametrize("history", HISTORIES)
def test_weights_mean_after_conversion_what_they_mean_in_diffusers(loaded, history):
    ref, fd = copy.deepcopy(loaded), copy.deepcopy(loaded)
    history(ref)
    history(fd)
    now = _outputs(ref)
    fdlora.from_diffusers(fd)
    for got, want in zip(_outputs(fd), now):  # the weights active at conversion carry over
        assert _rel(got, want) <= TOL
    base = _base_outputs(ref)
    for ws in LATER:
        ref.set_adapters(NAMES, ws)
        fdlora.set_adapters(fd.unet, NAMES, ws)
        fdlora.set_adapters(fd.text_encoder, NAMES, ws)
        for got, want, off in zip(_outputs(fd), _outputs(ref), base):
            assert _rel(want, off) > 1e-3  # the adapters change the output
            assert _rel(got, want) <= TOL, ws


def test_from_peft_on_a_unet_after_set_adapters():
    """The same on one model through fdlora.from_peft: a diffusers UNet whose adapters were weighted with its own
    set_adapters, then switched with PEFT's set_adapter."""
    from peft.functional import set_adapter

    from fdlora.fixtures import tiny_pipeline as tiny

    unet = tiny.sd15().unet
    for i, n in enumerate(NAMES):
        r = (4, 8, 4, 16)[i]
        unet.load_lora_adapter(_lora_state(unet, UNET_TARGETS[i], r, 3 * r // 2 + i, 10 + i, ""), adapter_name=n,
                               prefix=None)
    unet.set_adapters(NAMES, weights=[0.7, 0.5, 0.3, 0.2])
    unet.set_adapters(["a0"], weights=[0.61])
    ref, fd = copy.deepcopy(unet), copy.deepcopy(unet)
    for m in (ref, fd):
        set_adapter(m, ["a0", "a3"], inference_mode=True)  # PEFT's: a3 active again at its last weight (0.2)
    from support.tiny import unet_inputs

    x = unet_inputs(unet)
    with torch.no_grad():
        now = ref(**x).sample
        fdlora.from_peft(fd)
        assert _rel(fd(**x).sample, now) <= TOL
        assert fdlora.handle(fd).state.active == {"a0": pytest.approx(0.61), "a3": pytest.approx(0.2)}
        for ws in LATER:
            ref.set_adapters(NAMES, weights=ws)
            fdlora.set_adapters(fd, NAMES, ws)
            assert _rel(fd(**x).sample, ref(**x).sample) <= TOL, ws
