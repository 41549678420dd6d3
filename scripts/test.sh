#!/usr/bin/env bash
# Set up, then run the test suite (CPU; GPU tests run too when CUDA is present). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="${PYTHON:-python3}"
set +e
"$PY" -m pytest -q -p no:cacheprovider tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "[test] pytest collected no tests"; exit 0; fi
exit "$rc"
