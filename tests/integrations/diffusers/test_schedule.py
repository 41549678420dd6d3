"""Per-step LoRA strengths (`pipe(..., fd_lora_schedule=...)`) equal diffusers+PEFT driven by a step callback."""

from __future__ import annotations

import pytest
import torch

from fdlora.errors import FdLoraError
from fdlora.integrations.diffusers.schedule import strength_at

STEPS = 4


@pytest.mark.parametrize("spec,want", [
    (0.5, [0.5] * STEPS),
    ([1.0, 0.0], [1.0, 2 / 3, 1 / 3, 0.0]),  # a fade out over the steps
    ([0.0, 1.0, 0.0], [0.0, 2 / 3, 2 / 3, 0.0]),
    (lambda i, n: i / n, [0.0, 0.25, 0.5, 0.75]),
])
def test_strength_at(spec, want):
    assert [strength_at(spec, i, STEPS) for i in range(STEPS)] == pytest.approx(want)


def test_schedule_equals_peft_with_a_step_callback_and_restores_the_blend(sd15):
    fd, ref = sd15.fd, sd15.ref
    fd.set_adapters(["locon_b"], [0.4])
    keys = [1.0, 0.0, 0.8]
    got = sd15.gen(fd, steps=STEPS, fd_lora_schedule={"style_a": keys, "locon_b": 0.5})
    assert fd.get_active_adapters() == ["locon_b"]  # the active set of before the call is back

    def cb(p, step, t, kw):
        if step + 1 < STEPS:
            p.set_adapters(["style_a", "locon_b"], [strength_at(keys, step + 1, STEPS), 0.5])
        return kw

    ref.set_adapters(["style_a", "locon_b"], [strength_at(keys, 0, STEPS), 0.5])
    want = sd15.gen(ref, steps=STEPS, callback_on_step_end=cb)
    assert torch.allclose(got, want, atol=sd15.tolerance())
    constant = sd15.gen(fd, steps=STEPS, fd_lora_schedule={"style_a": 1.0, "locon_b": 0.5})
    assert not torch.allclose(got, constant, atol=sd15.tolerance())  # the schedule changed the result
    with pytest.raises(FdLoraError, match="keyframe"):
        sd15.gen(fd, steps=STEPS, fd_lora_schedule={"style_a": "strong"})
