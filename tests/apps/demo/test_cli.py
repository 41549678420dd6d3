"""`fdlora demo` without Gradio says how to install it, in one line."""

from __future__ import annotations

import sys

from fdlora.apps.cli import main


def test_demo_without_gradio_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradio", None)  # import gradio -> ModuleNotFoundError
    assert main(["demo", "--port", "0"]) == 1
    assert "pip install 'fd-lora[demo]'" in capsys.readouterr().err


def test_demo_binds_loopback_and_takes_an_allowlist():
    import argparse

    from fdlora.apps.demo import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    assert a.host == "127.0.0.1" and a.allow == []
    a = p.parse_args(["--allow", "/srv/loras/a.safetensors", "--allow", "user/repo", "--host", "0.0.0.0"])
    assert a.allow == ["/srv/loras/a.safetensors", "user/repo"] and a.host == "0.0.0.0"
