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


def test_add_adapter_by_path(demo_app, tmp_path):
    from gradio_client import Client

    from fdlora.pipelines.diffusers import tiny

    pipe = demo_app.fd_demo.pipe
    for name, data in tiny.random_lora_files(tiny.sd15(), seed=7).items():
        (tmp_path / name).write_bytes(data)
    c = Client(demo_app.local_url, verbose=False)
    *_, status = c.predict(str(tmp_path / "pytorch_lora_weights.safetensors"), ["pixel"], api_name="/add_adapter")
    assert "as 'pytorch_lora_weights'" in status
    assert "pytorch_lora_weights" in demo_app.fd_demo.names
    assert "pytorch_lora_weights" in pipe.get_list_adapters()["unet"]
    _, status = c.predict("a cat", ["pytorch_lora_weights"], *weights(1.0, 1.0, 0.5), api_name="/generate")
    assert "active: pytorch_lora_weights=0.50 |" in status
