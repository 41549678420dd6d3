#!/usr/bin/env bash
# One device call (GPU results land in $OUT/results/*.json; copy them to benchmarks/results/<gpu>/).
#   bash benchmarks/gpu_session.sh            # LLM decode/prefill, and SDXL steps on the torch backend
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export TRANSFORMERS_VERBOSITY=error DIFFUSERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT/results"
nvidia-smi --query-gpu=name --format=csv,noheader
step() { local t=$1; shift; echo "== $*"; timeout "$t" "$@" 2>&1 | grep -v "^\[transformers\]" | tail -40; }
step 200 python3 benchmarks/bench_llm.py --out "$OUT/results/llm.json"
FDLORA_BACKEND=torch step 150 python3 benchmarks/bench_pipeline.py --models sdxl --depth 6 --repeats 5 \
    --out "$OUT/results/pipeline_torch_backend.json"
