#!/usr/bin/env bash
# Install fd-lora and what its tests and quickstart need into the current Python.
# Keeps an installed torch; on a machine with none, installs torch==2.13.0 (a local CPU wheel on our CI machines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] no torch found: installing torch==2.13.0"
    "$PY" -m pip install -q "torch==2.13.0"
fi
# The core install is torch, safetensors, huggingface_hub, tqdm, pyyaml (+ triton on Linux); the tests need every extra
# (diffusers, transformers, demo, serve = ray[serve] + fastapi, quant = bitsandbytes + torchao + gguf on Linux).
extras="dev,docs,diffusers,transformers,train,demo,serve"  # docs: mkdocs-material + mkdocstrings (the site build)
[ "$(uname -s)" = "Linux" ] && extras="$extras,triton,quant"
"$PY" -m pip install -q --disable-pip-version-check -e ".[$extras]"
# LyCORIS (in the dev extra too) is the LoHa / LoKr / DoRA oracle of tests/hub/test_lycoris.py
"$PY" -c "import lycoris" >/dev/null 2>&1 || "$PY" -m pip install -q --disable-pip-version-check "lycoris-lora>=4.1,<5"
# The browser tests (the demo's, through Playwright; the docs site's, tests/docs/) drive Debian's chromium
# (no `playwright install`): as root on Debian this runs apt-get, and says so first. Without it those tests skip.
if { [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; } && [ "$(id -u)" = "0" ] \
        && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Debian packages chromium and chromium-driver with apt-get (for the browser tests)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
        || echo "[setup] chromium install failed; the browser tests will skip"
fi
# On a CUDA machine with nvcc: the CUDA C++ extension, whose bound calls are the fast per-call LoRA paths (the
# registry's `auto` takes it once built; without it the Triton and cuBLAS paths run).
if command -v nvcc >/dev/null 2>&1 && "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "[setup] building fd-lora's CUDA extension (about a minute, once)"
    "$PY" -m fdlora env --build-cuda >/dev/null || echo "[setup] the CUDA extension did not build; Triton paths run"
fi
