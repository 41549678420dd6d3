#!/usr/bin/env bash
# The main job on a fresh machine: install fd-lora with what the quickstart needs (the core + the diffusers extra:
# diffusers, transformers, peft, accelerate, pillow), then run it on an embedded tiny default (no download).
# Nothing for the tests, the demo, serving or browsers, and nothing from apt: `bash scripts/test.sh` is the full setup.
# Keeps an installed torch; on a machine with none, installs torch==2.13.0. Where torch has no CUDA device (or is not
# installed yet), Triton (1 GB, GPU kernels only) is left out. Extra args go to `fdlora quickstart`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
start=$SECONDS
# the core's and the [diffusers] extra's requirements, read from pyproject.toml, in one pip call
mapfile -t reqs < <("$PY" - <<'PYEOF'
import importlib.util
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
cuda = False
if importlib.util.find_spec("torch") is None:
    print("torch==2.13.0")
else:
    import warnings

    warnings.filterwarnings("ignore")  # torch warns when numpy is not installed yet
    import torch

    cuda = torch.cuda.is_available()
for req in project["dependencies"] + project["optional-dependencies"]["diffusers"]:
    if not (req.startswith("triton") and not cuda):
        print(req)
print("setuptools>=69")  # builds the editable install below without an isolated build environment
PYEOF
)
printf '%s\n' "${reqs[@]}" | grep -q '^torch==' && echo "[quickstart] no torch found: installing torch==2.13.0"
echo "[quickstart] installing fd-lora: the core + [diffusers]"
"$PY" -m pip install -q --no-compile --disable-pip-version-check "${reqs[@]}"  # .pyc files come on first import
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
echo "[quickstart] installed in $((SECONDS - start)) s; running fdlora quickstart"
exec "$PY" -m fdlora quickstart "$@"
