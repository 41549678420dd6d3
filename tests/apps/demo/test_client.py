"""The demo's named endpoints through gradio_client, as an API user calls them."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gradio_client")

SLIDERS = 8  # fdlora.apps.demo.MAX_ADAPTERS: one weight per slider slot, unused slots ignored


def weights(*w: float) -> list[float]:
    return [*w, *[1.0] * (SLIDERS - len(w))]


def pixels(path: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)


def test_generate_weights_change_image_and_status(demo_url):
    from gradio_client import Client

    c = Client(demo_url, verbose=False)
    both = ["pixel", "watercolor"]
    img_a, status_a = c.predict("a cat", both, *weights(1.0, 1.0), api_name="/generate")
    img_b, status_b = c.predict("a cat", both, *weights(0.25, 1.0), api_name="/generate")
    assert "pixel=1.00, watercolor=1.00" in status_a and "pixel=0.25, watercolor=1.00" in status_b
    assert "step" in status_b and "set_adapters" in status_b and " ms" in status_b
    assert np.abs(pixels(img_a) - pixels(img_b)).max() > 0
    img_a2, _ = c.predict("a cat", both, *weights(1.0, 1.0), api_name="/generate")
    np.testing.assert_array_equal(pixels(img_a), pixels(img_a2))  # same request, same image: no bleed


def test_gallery_one_image_per_prompt(demo_url):
    from gradio_client import Client

    c = Client(demo_url, verbose=False)
    gallery, status = c.predict("a cat\na dog\na cow", ["pixel", "watercolor"], *weights(1.0, 0.5),
                                api_name="/gallery")
    assert len(gallery) == 3 and "3 prompts in one batch" in status
    assert [g["caption"] for g in gallery] == ["a cat [pixel=1.00]", "a dog [watercolor=0.50]",
                                               "a cow [pixel=1.00]"]
    cat, dog, cow = (pixels(g["image"]) for g in gallery)
    assert np.abs(cat - dog).max() > 0 and np.abs(cat - cow).max() > 0


def test_add_adapter_allowed_by_path_or_short_name(demo_app, allowed_lora):
    from gradio_client import Client

    c = Client(demo_app.local_url, verbose=False)
    *_, status = c.predict(str(allowed_lora), ["pixel"], api_name="/add_adapter")
    assert "as 'pytorch_lora_weights'" in status
    *_, status = c.predict("pytorch_lora_weights", ["pixel"], api_name="/add_adapter")
    assert "as 'pytorch_lora_weights_'" in status
    *_, status = c.predict("fdlora-demo/watercolor", ["pixel"], api_name="/add_adapter")  # a bundled one
    assert "as 'watercolor_'" in status


def test_add_adapter_refuses_everything_else_alike(demo_app, allowed_lora, tmp_path):
    """Not a file oracle: paths outside the allowlist, '..', absolute paths, directories, existing or not,
    all get the same one-line refusal, and no file is opened for them."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    (tmp_path / "secret.safetensors").write_bytes(b"x" * 64)
    attempts = [
        "/etc/passwd", "/etc/does-not-exist", "../../../../etc/passwd", "..", str(allowed_lora.parent),
        str(allowed_lora.parent) + "/", str(allowed_lora.parent / ".." / allowed_lora.parent.name / allowed_lora.name),
        str(tmp_path / "secret.safetensors"), str(tmp_path), "secret", "some-user/some-repo", "", " ",
    ]
    c = Client(demo_app.local_url, verbose=False)
    messages = set()
    names = list(demo_app.fd_demo.names)
    for src in attempts:
        with pytest.raises(AppError) as e:
            c.predict(src, ["pixel"], api_name="/add_adapter")
        messages.add(str(e.value))
    assert len(messages) == 1, messages
    (msg,) = messages
    assert "not an adapter this demo offers" in msg and "\n" not in msg.strip()
    assert "passwd" not in msg and "header" not in msg and "exist" not in msg and str(tmp_path) not in msg
    assert demo_app.fd_demo.names == names  # nothing loaded


def test_add_refusal_opens_nothing(demo_app, monkeypatch):
    """The decision is made from the string alone: no filesystem call for a refused request."""
    import builtins
    import os

    from fdlora.errors import FdLoraError

    touched = []
    for mod, attr in ((builtins, "open"), (os, "stat"), (os, "listdir"), (os, "scandir")):
        real = getattr(mod, attr)
        monkeypatch.setattr(mod, attr, lambda *a, _real=real, **k: (touched.append(a[:1]), _real(*a, **k))[1])
    with pytest.raises(FdLoraError, match="not an adapter this demo offers"):
        demo_app.fd_demo.add("/etc/passwd")
    monkeypatch.undo()
    assert touched == []
