"""Shared by every test module, so it stays import-cheap (stdlib only, no torch).

huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when it is imported, so the loopback Hub
server starts here, before any test module can import it: all Hub traffic of the suite goes to
127.0.0.1, and the client cache is a fresh temporary folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from support.fakehub import FakeHub

_ROOT = tempfile.mkdtemp(prefix="fdlora-tests-")
HUB_STORE = os.path.join(_ROOT, "hub-store")  # what the server serves (HF cache layout)
os.makedirs(HUB_STORE)
_HUB = FakeHub(HUB_STORE).__enter__()
os.environ["HF_ENDPOINT"] = _HUB.url
os.environ["HF_HOME"] = os.path.join(_ROOT, "hf-home")
os.environ.pop("HF_HUB_CACHE", None)
os.environ.pop("HF_HUB_OFFLINE", None)
os.environ.pop("TRANSFORMERS_OFFLINE", None)
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


def pytest_configure(config):
    config.fakehub = _HUB


def pytest_unconfigure(config):
    _HUB.__exit__(None, None, None)
    shutil.rmtree(_ROOT, ignore_errors=True)


@pytest.fixture(autouse=True)
def _triton_tests_run_on_triton(request):
    """Tests marked `triton` are about the Triton backend as `auto` picks it: they skip where triton is not
    installed and ignore a forced FDLORA_BACKEND (the GPU suite also runs under FDLORA_BACKEND=cuda)."""
    if request.node.get_closest_marker("triton") is None:
        yield
        return
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from fdlora.kernels import registry

    order = registry.AUTO_ORDER  # auto as it picks without the extension: Triton (its tests assert the name)
    registry.AUTO_ORDER = tuple(n for n in order if n != "triton+cuda")
    try:
        with registry.use_backend("auto"):
            yield
    finally:
        registry.AUTO_ORDER = order
