"""Per-prompt batches on per-blend merged copies (FusedLoraLinear._grouped_forward) equal the per-call kernels and
each prompt run alone: CFG on (both halves of the batch share a prompt's blend), several prompts per adapter,
prompts without an adapter, a blend."""

from __future__ import annotations

import pytest
import torch

import fdlora


@pytest.fixture
def cache_on():
    fdlora.set_merge_cache(1 << 30)
    yield
    fdlora.set_merge_cache("auto")


def grouped_layers(pipe) -> int:
    return sum(bool(m.merged.groups) for m in pipe.unet.modules() if hasattr(m, "merged"))


@pytest.mark.parametrize("specs,n", [
    (["style_a", "locon_b", "style_a", "locon_b"], 1),  # CFG halves repeat the blends: one strided bmm per prompt
    (["style_a", None, "style_a", {"style_a": 0.5, "locon_b": 0.5}], 2),  # runs of images per prompt
], ids=["alternating-cfg", "runs-none-blend"])
def test_grouped_per_prompt_equals_per_call_and_each_prompt_alone(sd15, cache_on, specs, n):
    fd = sd15.fd
    prompts = ["a cat", "a dog", "a cow", "a fox"]
    lat = sd15.make_latents(len(prompts) * n, seed=5)
    grouped = sd15.gen(fd, prompt=prompts, fd_lora_adapters=specs, num_images_per_prompt=n, latents=lat)
    assert grouped_layers(fd) > 0  # the path ran (layers with enough rows per sample)
    fdlora.set_merge_cache(0)
    per_call = sd15.gen(fd, prompt=prompts, fd_lora_adapters=specs, num_images_per_prompt=n, latents=lat)
    assert grouped_layers(fd) == 0  # copies released with the budget
    torch.testing.assert_close(grouped, per_call, atol=1e-5, rtol=1e-4)
    fdlora.set_merge_cache(1 << 30)
    for i, (p, spec) in enumerate(zip(prompts, specs)):
        with fdlora.adapters(fd, spec or []):
            alone = sd15.gen(fd, prompt=p, num_images_per_prompt=n, latents=lat[n * i: n * (i + 1)])
        torch.testing.assert_close(grouped[n * i: n * (i + 1)], alone, atol=1e-5, rtol=1e-4)
