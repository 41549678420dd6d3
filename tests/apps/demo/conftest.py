"""One demo server per test session: the embedded tiny pipeline on 127.0.0.1, an automatic port."""

from __future__ import annotations

import os

import pytest

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"


@pytest.fixture(scope="session")
def demo_app():
    pytest.importorskip("gradio", reason="gradio is not installed: pip install 'fd-lora[demo]'")
    from fdlora.apps.demo import build

    app = build(steps=2)
    app.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture(scope="session")
def demo_url(demo_app):
    return demo_app.local_url
