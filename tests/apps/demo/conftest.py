"""One demo server per test session: the embedded tiny pipeline on 127.0.0.1, an automatic port, one
extra adapter file allowed."""

from __future__ import annotations

import os

import pytest

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"


@pytest.fixture(scope="session")
def allowed_lora(tmp_path_factory):
    """A LoRA file the operator allows with --allow (the demo's `allow`)."""
    from fdlora.fixtures import tiny_pipeline as tiny

    root = tmp_path_factory.mktemp("allowed")
    for name, data in tiny.random_lora_files(tiny.sd15(), seed=7).items():
        (root / name).write_bytes(data)
    return root / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="session")
def demo_app(allowed_lora):
    pytest.importorskip("gradio", reason="gradio is not installed: pip install 'fd-lora[demo]'")
    from fdlora.apps.demo import build

    app = build(steps=2, allow=[str(allowed_lora)])
    app.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture(scope="session")
def demo_url(demo_app):
    return demo_app.local_url
