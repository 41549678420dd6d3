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
extras="dev,diffusers,transformers,train,demo,serve"
[ "$(uname -s)" = "Linux" ] && extras="$extras,triton,quant"
"$PY" -m pip install -q --disable-pip-version-check -e ".[$extras]"
# LyCORIS (in the dev extra too) is the LoHa / LoKr / DoRA oracle of tests/hub/test_lycoris.py
"$PY" -c "import lycoris" >/dev/null 2>&1 || "$PY" -m pip install -q --disable-pip-version-check "lycoris-lora>=4.1,<5"
# The demo's browser test drives Debian's chromium through Playwright (no `playwright install`).
# Best effort: without /usr/bin/chromium that test skips and says so.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium for the demo's browser test"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
        || echo "[setup] chromium install failed; the browser test will skip"
fi
