#!/usr/bin/env bash
# One device call: GPU tests of the layer wiring, then the pipeline, load, set_adapters and LLM benchmarks.
# Results land in $OUT/results/*.json (copied into benchmarks/results/<gpu>/ afterwards).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export TRANSFORMERS_VERBOSITY=error DIFFUSERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
mkdir -p "$OUT/results"
nvidia-smi --query-gpu=name --format=csv,noheader
step() { local t=$1; shift; echo "== $*"; timeout "$t" "$@" 2>&1 | grep -v "^\[transformers\]" | tail -60; }
step 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels -x -k "compile or graph or layer or linear_op or opcheck"
step 220 python3 benchmarks/bench_pipeline.py --depth 6 --repeats 8 --out "$OUT/results/pipeline.json"
step 100 python3 benchmarks/bench_load.py --out "$OUT/results/load.json"
step 40 python3 benchmarks/bench_set_adapters.py --device cuda --out "$OUT/results/set_adapters.json"
step 120 python3 benchmarks/bench_llm.py --out "$OUT/results/llm.json"
