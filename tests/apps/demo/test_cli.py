"""`fdlora demo` without Gradio says how to install it, in one line."""

from __future__ import annotations

import sys

from fdlora.apps.cli import main


def test_demo_without_gradio_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradio", None)  # import gradio -> ModuleNotFoundError
    assert main(["demo", "--port", "0"]) == 1
    assert "pip install 'fd-lora[demo]'" in capsys.readouterr().err
