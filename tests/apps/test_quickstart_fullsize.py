"""The quickstart's full-size GPU section, run at toy widths on CPU: every step of it works and its checks against
diffusers+PEFT pass (the section itself only runs on CUDA at full size)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")


def test_fullsize_section_runs_at_toy_widths(capsys):
    from fdlora.apps.quickstart.fullsize import run

    assert run(rounds=1, device="cpu", tiny=True)
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "slider moved every step" in out and "adapter per prompt" in out
