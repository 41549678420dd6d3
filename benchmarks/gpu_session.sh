#!/usr/bin/env bash
# One device call: the pipeline and load benchmarks (and a diagnostic LLM run); results in $OUT/results/*.json.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export TRANSFORMERS_VERBOSITY=error DIFFUSERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT/results"
nvidia-smi --query-gpu=name --format=csv,noheader
step() { local t=$1; shift; echo "== $*"; timeout "$t" "$@" 2>&1 | grep -v "^\[transformers\]" | tail -45; }
step 260 python3 benchmarks/bench_pipeline.py --depth 6 --repeats 8 --out "$OUT/results/pipeline.json"
step 200 python3 benchmarks/bench_load.py --depth 0.5 --out "$OUT/results/load.json"
CUDA_LAUNCH_BLOCKING=1 step 90 python3 benchmarks/bench_llm.py --layers 1 --reps 5 --out "$OUT/results/llm.json"
