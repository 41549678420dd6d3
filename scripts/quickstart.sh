#!/usr/bin/env bash
# Set up, then run the main job on an embedded tiny default (no download).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
"${PYTHON:-python3}" -m fdlora quickstart "$@"
