#!/usr/bin/env bash
# The main job on a fresh machine: install fd-lora with what the quickstart needs (the core + the diffusers extra:
# diffusers, transformers, peft, accelerate, pillow), then run it on an embedded tiny default (no download).
# Nothing for the tests, the demo, serving or browsers, and nothing from apt: `bash scripts/test.sh` is the full setup.
# Keeps an installed torch; on a machine with none, installs torch==2.13.0. Where torch has no CUDA device, Triton
# (1 GB, GPU kernels only) is left out. Extra args go to `fdlora quickstart`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[quickstart] no torch found: installing torch==2.13.0"
    pip_install "torch==2.13.0"
fi
# the core's and the [diffusers] extra's requirements, read from pyproject.toml (triton only where CUDA is)
reqs=$("$PY" - <<'PYEOF'
import tomllib
import warnings

warnings.filterwarnings("ignore")  # torch warns when numpy is not installed yet
import torch  # noqa: E402

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["diffusers"]:
    if req.startswith("triton") and not torch.cuda.is_available():
        continue
    print(req)
PYEOF
)
echo "[quickstart] installing fd-lora (core + [diffusers])"
mapfile -t reqs <<< "$reqs"
pip_install "${reqs[@]}"
pip_install --no-deps --no-build-isolation -e . 2>/dev/null || pip_install --no-deps -e .
exec "$PY" -m fdlora quickstart "$@"
