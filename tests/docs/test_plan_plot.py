"""`fdlora plan --plot FILE` draws the strategies' time per step and memory (fdlora/plan/plot.py)."""

from __future__ import annotations

import pytest


def test_plan_plot_writes_time_and_memory_panels(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("diffusers")
    from PIL import Image

    from fdlora.apps.plan import main

    out = tmp_path / "plan.png"
    assert main(["sdxl", "--adapters", "4", "--plot", str(out)]) == 0
    assert "written to" in capsys.readouterr().out
    image = Image.open(out)
    assert image.width > image.height > 200  # two panels side by side


def test_plot_function_marks_the_recommended_strategy(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("diffusers")
    from fdlora.plan import plan
    from fdlora.plan.plot import plot

    result = plan("sdxl", adapters=2, gpu="h200")
    plot(result, str(tmp_path / "p.svg"))
    svg = (tmp_path / "p.svg").read_text()
    assert f"recommended: {result.recommended}" in svg and "device memory needed" in svg
