"""fd-lora pipes vs diffusers+PEFT on identical weights, SD1.5 / SDXL / SD3 / Flux.

Bound: |fd-lora - diffusers+PEFT| <= 3x diffusers+PEFT's own fp32 error against a float64 run of
the same pipeline (measured once per architecture), plus a 1e-6 floor.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import ARCHS

CASES = {
    "single": (["style_a"], [1.0]),
    "second-with-conv-or-extra-layers": (["locon_b"], [1.0]),
    "blend": (["style_a", "locon_b"], [0.7, 0.4]),
    "component-dict": (["style_a"], [{"text_encoder": 0.0}]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_diffusers_peft(pair, case):
    names, weights = CASES[case]
    if case == "component-dict":
        weights = [{ARCHS[pair.arch]["den"]: 0.5, "text_encoder": 0.0}]
    pair.ref.set_adapters(names, weights)
    pair.fd.set_adapters(names, weights)
    tol = pair.tolerance()
    pair.ref.set_adapters(names, weights)
    ref, fd = pair.gen(pair.ref), pair.gen(pair.fd)
    assert (ref - pair.gen(pair.base)).abs().max() > 1e-2, "the LoRA must visibly change the image"
    err = float((fd - ref).abs().max())
    assert err <= tol, f"fd-lora vs diffusers+PEFT {err:.3g} > bound {tol:.3g}"
    assert pair.fd.get_active_adapters() == pair.ref.get_active_adapters() == names


def test_per_call_scale_and_disable(pair):
    key = "cross_attention_kwargs" if pair.arch in ("sd15", "sdxl") else "joint_attention_kwargs"
    pair.ref.set_adapters(["style_a"])
    pair.fd.set_adapters(["style_a"])
    ref = pair.gen(pair.ref, **{key: {"scale": 0.3}})
    fd = pair.gen(pair.fd, **{key: {"scale": 0.3}})
    assert float((ref - fd).abs().max()) <= pair.tolerance()
    assert float((pair.gen(pair.fd) - fd).abs().max()) > 1e-3  # the scale applied to this call only
    pair.fd.disable_lora()
    assert torch.equal(pair.gen(pair.fd), pair.gen(pair.base))
    pair.fd.enable_lora()
    assert set(pair.fd.get_list_adapters()) == {ARCHS[pair.arch]["den"], *ARCHS[pair.arch]["te"]}
    assert all(v == ["style_a", "locon_b"] for v in pair.fd.get_list_adapters().values())


def test_diffusers_files_through_load_fd_lora(pair):
    """The same files diffusers loaded, through fd-lora's own Hub/format path (`load_fd_lora(dir)`)."""
    import copy

    fd = copy.deepcopy(pair.base)
    for name, d in pair.dirs.items():
        report = fd.load_fd_lora(d, adapter_name=name)
        assert report.format == "diffusers" and not report.keys_unused and not report.keys_dropped
    assert fd.get_list_adapters() == pair.fd.get_list_adapters()
    names, weights = ["style_a", "locon_b"], [0.6, 0.9]
    pair.ref.set_adapters(names, weights)
    fd.set_adapters(names, weights)
    assert float((pair.gen(fd) - pair.gen(pair.ref)).abs().max()) <= pair.tolerance()


def test_merged_weight_cache_matches_diffusers_peft(pair):
    """With the merged-weight cache on (the GPU default), every fused layer (linear and conv) runs on W',
    and outputs still match diffusers+PEFT, through blends, switches and a per-call scale."""
    import fdlora

    key = "cross_attention_kwargs" if pair.arch in ("sd15", "sdxl") else "joint_attention_kwargs"
    fdlora.set_merge_cache(1 << 30)
    try:
        for names, weights, kw in ((["style_a", "locon_b"], [0.7, 0.4], {}), (["locon_b"], [1.0], {}),
                                   (["style_a"], [1.0], {key: {"scale": 0.3}})):
            pair.ref.set_adapters(names, weights)
            pair.fd.set_adapters(names, weights)
            err = float((pair.gen(pair.fd, **kw) - pair.gen(pair.ref, **kw)).abs().max())
            assert err <= pair.tolerance(), f"{names}: {err:.3g} > {pair.tolerance():.3g}"
        held = {c: [p for p, layer in h.layers.items() if layer.merged.buf is not None]
                for c, h in pair.fd.fd_lora_handles().items()}
        assert all(held.values()) and fdlora.merge_cache_bytes() > 0, held
    finally:
        fdlora.set_merge_cache("auto")
    assert fdlora.merge_cache_bytes() == 0
