"""The quickstart's pipeline part means something: two LoRAs trained toward a warm and a cool palette move the blend
sweep's mean colour monotonically, and fd-lora equals diffusers+PEFT on the trained files."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")


def test_palette_sweep_is_monotonic_and_the_quickstart_passes(tmp_path, capsys):
    from fdlora.apps.quickstart.pipeline import run

    assert run(tmp_path, repeats=1) is True  # checks: equal to diffusers+PEFT, per-prompt, monotonic sweep
    out = capsys.readouterr().out
    assert "(monotonic)" in out and "all checks passed" in out
    assert (tmp_path / "blend_grid.png").stat().st_size > 0 and (tmp_path / "per_prompt.png").stat().st_size > 0


def test_a_palette_lora_moves_the_preview_toward_its_colour(tmp_path):
    import fdlora  # noqa: F401
    from fdlora.fixtures import tiny_pipeline as tiny
    from fdlora.training import palette

    pipe = tiny.sd15()
    pipe.set_progress_bar_config(disable=True)
    kw = dict(output_type="latent")
    with torch.inference_mode():
        before = palette.latent_preview(pipe(**tiny.generate_kwargs(pipe, **kw)).images).mean(dim=(0, 2, 3))
    for name, data in palette.train(pipe, (0.9, 0.3, 0.2), steps=30).items():
        (tmp_path / name).write_bytes(data)
    pipe.load_fd_lora(str(tmp_path), adapter_name="warm")
    with torch.inference_mode():
        after = palette.latent_preview(pipe(**tiny.generate_kwargs(pipe, **kw)).images).mean(dim=(0, 2, 3))
    target = torch.tensor([0.9, 0.3, 0.2])
    assert (after - target).norm() < 0.5 * (before - target).norm(), (before, after)
