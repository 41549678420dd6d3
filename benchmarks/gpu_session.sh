#!/usr/bin/env bash
# One device call; GPU results land in $OUT/results/*.json (copy them to benchmarks/results/<gpu>/).
#   bash benchmarks/gpu_session.sh tests pipeline profile     # stages, in order
#   carry .whl: diffusers==0.42.1 importlib_metadata gguf torchao lycoris-lora toml bitsandbytes (pip download --no-deps,
#   ~53 MB; the device image has pytest-xdist, execnet, hypothesis, accelerate, peft, transformers)
#   stages: tests (GPU-marked tests), layers (GPU-marked layer + transformers tests), pipeline (SDXL + Flux steps), profile / profile-percall (SDXL step
#           host/GPU profile, merged-weight cache on / off), llm (decode / prefill), llm-profile (the same
#           + host profiles of eager decode steps), layer (host time of one fused layer's eager forward), load (SDXL-size adapter load), fused / fused-measure
#           (layer paths; dispatch by the cost model / by FDLORA_DISPATCH=measure), delta (delta kernels),
#           sweep (every delta config per shape; fused vs split components), probe-tma (Hopper TMA GEMM vs cuBLAS),
#           probe-padded-k (per-call LoRA forms vs the cuBLAS base GEMM), probe-rss (RSS over new batch shapes),
#           serve (bench_serve.py, full-size SDXL, alone on its GPU: the whole 10-minute call), serve-soak (the same
#           serving configuration, one 16-client run at 3 steps until 1000 requests or the call's end, memory read every
#           15 s, then the faults: the whole call),
#           captured (SDXL + Flux steps in CUDA graphs: merged-weight cache checked on the device vs per-call),
#           tests-fast (GPU-marked tests, 6 workers: ~3 min; .whl must hold pytest-xdist + execnet), tests-cuda (the same
#           under FDLORA_BACKEND=cuda), tests-notriton (triton's package moved away for the run, then back),
#           cuda-backend (per-op table + layer host time), train (bench_train.py), train-profile (profile_train.py: SDXL and ViT
#           training steps, fd-lora vs PEFT, torch.profiler top ops), breadth (bench_breadth*.py), quantized
#           (bench_quantized.py: Flux over torchao / GGUF bases, rows added under "quantized" to this GPU's committed breadth.json),
#           fullsize-sdxl / fullsize-flux / fullsize-llama (the headline table, one model per call: each takes minutes),
#           fullsize-profile (Llama per-row decode and the SDXL cached step: torch.profiler ops, then cProfile's Python
#           functions per step and per fused layer), fullsize-cuda (the per-call cases again under FDLORA_BACKEND=cuda), offload (bench_offload.py),
#           gpu-memory (tests/reliability/test_gpu_memory.py), prefetch-stall (probe_prefetch_stall.py: which piece of a
#           background load slows the steps), pressure (bench_pressure.py: full-size SDXL steps
#           at 3 / 2 / 1.5 / 1 GiB free, fd-lora vs diffusers+PEFT: reliability.json with a "gpu" key, to copy back), prefetch (bench_prefetch.py), shared-shrink
#           (bench_shared_shrink.py), per-prompt-forms (probe_per_prompt_forms.py, SDXL and Flux: the extension's
#           bound per-sample forms vs percall's torch forms; after build-cuda), probe-merge (probe_merge_kernel.py: the
#           extension's merge kernel, the Triton one, addmm, a copy and the candidate merge_stream.cu on every
#           full-size weight; after build-cuda), build-cuda (the extension, before anything that should
#           run on the triton+cuda backend auto takes once it is built), quant-tests (the GPU tests of the
#           dequant-merge kernels and layers, and of training), offload-flux (bench_offload's Flux model-offload
#           rows alone), calibrate (`fdlora plan --calibrate`, its JSON <device>.json copied to results/)
#           train-multi (2 GPUs: the GPU tests of test_fsdp / test_ddp, then bench_train.py --ddp --fsdp at 1 and 2
#           processes, rows merged into train_multigpu.json; ~4 min of its 7 min limit on an H100 pair)
#   While helpers edit the tree, run from a snapshot of HEAD: `git archive -o .snap.tar HEAD` here (the name is in
#   .git/info/exclude), carry it, and start the call with `mkdir -p /tmp/w && tar -xf .snap.tar -C /tmp/w &&
#   cp -r .whl /tmp/w/ && cd /tmp/w && bash benchmarks/gpu_session.sh ...` (the device copy's .git may be stale:
#   never `git checkout` there)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export TRANSFORMERS_VERBOSITY=error DIFFUSERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT/results"
nvidia-smi --query-gpu=name --format=csv,noheader
step() { local t=$1 s=$SECONDS; shift; echo "== $*"; timeout "$t" "$@" 2>&1 | grep -v "^\[transformers\]\|Warning\|warnings.warn" | tee -a "$OUT/log.txt" | tail -${TAIL:-40}; local rc=${PIPESTATUS[0]}; echo "== took $((SECONDS - s)) s (exit ${rc/#137/137: killed, host memory?})"; }
for stage in "$@"; do
  case $stage in
    layer) TAIL=3 step 120 python3 benchmarks/probes/profile_layer.py --out "$OUT/results/layer_host.json" ;;
    tests) TAIL=15 step 560 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests ;;
    tests-fast) TAIL=25 step 540 python3 -m pytest -q -rf -m gpu -p no:cacheprovider -n 8 tests ;;
    tests-cuda) TAIL=15 FDLORA_BACKEND=cuda step 400 python3 -m pytest -q -m gpu -p no:cacheprovider -n 6 tests ;;
    tests-notriton) T=$(python3 -c "import triton, os; print(os.path.dirname(triton.__file__))"); mv "$T" /tmp/triton_hidden
        TAIL=15 step 300 python3 -m pytest -q -m gpu -p no:cacheprovider -n 6 tests; mv /tmp/triton_hidden "$T" ;;
    cuda-backend) step 300 python3 benchmarks/bench_cuda_backend.py --out "$OUT/results/cuda_backend.json" ;;
    train) step 500 python3 benchmarks/bench_train.py --out "$OUT/results/train.json" ;;
    train-profile) for c in sdxl vit; do TAIL=60 step 200 python3 benchmarks/probes/profile_train.py --case $c \
        --out "$OUT/results/profile_train_$c.json"; done ;;
    breadth) GPU_DIR=benchmarks/results/$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-')
        cp "$GPU_DIR/breadth.json" "$OUT/results/breadth.json" 2>/dev/null  # this GPU's committed rows are kept
        step 330 python3 benchmarks/bench_breadth.py --out "$OUT/results/breadth.json"
        step 200 python3 benchmarks/bench_breadth_lycoris.py --out "$OUT/results/breadth.json" ;;
    quantized) GPU_DIR=benchmarks/results/$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-')
        cp "$GPU_DIR/breadth.json" "$OUT/results/breadth.json" 2>/dev/null  # this GPU's committed rows are kept
        step 400 python3 benchmarks/bench_quantized.py --out "$OUT/results/breadth.json" ;;
    layers) TAIL=15 step 300 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/layers tests/integrations/transformers ;;
    pipeline) step 300 python3 benchmarks/bench_pipeline.py --models sdxl,flux --depth 6 --repeats 10 \
        --out "$OUT/results/pipeline.json" ;;
    profile) TAIL=70 step 150 python3 benchmarks/probes/profile_step.py --model sdxl --depth 6 --out "$OUT/results/profile_sdxl.json" ;;
    profile-percall) TAIL=70 step 120 python3 benchmarks/probes/profile_step.py --model sdxl --depth 2 --merge-cache 0 \
        --out "$OUT/results/profile_sdxl_percall.json" ;;
    llm) step 240 python3 benchmarks/bench_llm.py --out "$OUT/results/llm.json" ;;
    llm-profile) TAIL=150 step 240 python3 benchmarks/bench_llm.py --profile --reps 10 --out "$OUT/results/llm_profile.json" ;;
    load) TAIL=80 step 240 python3 benchmarks/bench_load.py --profile --out "$OUT/results/load.json" ;;
    captured) step 360 python3 benchmarks/bench_captured.py --out "$OUT/results/captured.json" ;;
    fused) step 300 python3 benchmarks/bench_fused.py --out "$OUT/results/fused.json" ;;
    fused-measure) step 300 python3 benchmarks/bench_fused.py --dispatch measure --out "$OUT/results/fused_measured.json" ;;
    delta) step 300 python3 benchmarks/bench_delta.py --out "$OUT/results/delta.json" ;;
    sweep) TAIL=30 step 400 python3 benchmarks/probes/sweep_delta.py --parts decode,diffusion,components \
        --out "$OUT/results/sweep_delta.json" ;;
    build-cuda) TAIL=5 step 200 python3 -m fdlora env --build-cuda ;;
    fullsize-sdxl|fullsize-flux|fullsize-llama) TAIL=30 step 560 python3 benchmarks/bench_fullsize.py \
        --model "${stage#fullsize-}" --out "$OUT/results/fullsize.json" ;;
    fullsize-profile) for mc in llama:decode32_mixed4 sdxl:cache_1; do TAIL=60 FDLORA_TRACE_DIR=$OUT/results step 200 python3 benchmarks/bench_fullsize.py \
        --model ${mc%%:*} --cases ${mc#*:} --profile ${mc#*:} --rounds 4; done ;;
    fullsize-cuda) for m in sdxl flux; do TAIL=12 FDLORA_BACKEND=cuda step 280 python3 benchmarks/bench_fullsize.py \
        --model $m --cases nocache_1,per_prompt_2,slider_every_step,cache_1 --out "$OUT/results/fullsize_cuda.json"; done ;;
    offload) step 400 python3 benchmarks/bench_offload.py --out "$OUT/results/offload.json" ;;
    prefetch) step 400 python3 benchmarks/bench_prefetch.py --out "$OUT/results/prefetch.json"
        FDLORA_PREFETCH_READER=thread step 200 python3 benchmarks/bench_prefetch.py --steps-only \
        --out "$OUT/results/prefetch_thread_reader.json" ;;
    prefetch-stall) TAIL=12 step 300 python3 benchmarks/probes/probe_prefetch_stall.py --out "$OUT/results/prefetch_stall.json" ;;
    shared-shrink) step 300 python3 benchmarks/bench_shared_shrink.py --out "$OUT/results/shared_shrink.json" ;;
    pressure) cp benchmarks/results/reliability.json "$OUT/results/reliability.json"  # the CPU figures stay
        TAIL=40 step 400 python3 benchmarks/bench_pressure.py --out "$OUT/results/reliability.json" ;;
    gpu-memory) TAIL=15 step 300 python3 -m pytest -q -p no:cacheprovider tests/reliability/test_gpu_memory.py ;;
    quant-tests) TAIL=15 step 240 python3 -m pytest -q -rf -m gpu -p no:cacheprovider -n 4 tests/layers/test_dequant_merge.py \
        tests/layers/test_gguf_merge.py tests/training/test_gpu.py ;;
    offload-flux) step 500 python3 benchmarks/bench_offload.py --model flux --modes model --out "$OUT/results/offload_flux.json" ;;
    calibrate) TAIL=3 step 120 python3 -m fdlora plan --calibrate && cp ~/.cache/fdlora/plan/*.json "$OUT/results/" ;;
    train-multi) [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || echo "train-multi: fewer than 2 GPUs (the 2-GPU cases skip)"
        TAIL=12 step 160 python3 -m pytest -q -rfs -m gpu -p no:cacheprovider tests/training/test_fsdp.py tests/training/test_ddp.py
        L="accelerate launch --num_machines 1 --mixed_precision no --dynamo_backend no"
        B="benchmarks/bench_train.py --ddp --fsdp --cases llama sdxl vit --steps 5 --out $OUT/results/train_multigpu.json"
        TAIL=12 step 110 $L --num_processes 1 $B
        TAIL=12 step 150 $L --multi_gpu --num_processes 2 $B ;;
    probe-tma) TAIL=5 step 300 python3 benchmarks/probes/probe_tma_gemm.py --out "$OUT/results/probe_tma.json" ;;
    probe-padded-k) TAIL=40 step 150 python3 benchmarks/probes/probe_padded_k.py --out "$OUT/results/padded_k.json" ;;
    probe-rss) TAIL=10 step 120 python3 benchmarks/probes/probe_rss_shapes.py --out "$OUT/results/rss_shapes.json" ;;
    serve) TAIL=30 step 590 python3 benchmarks/bench_serve.py --model sdxl --budget-s 545 --max-batch 16 --max-call 8 --out "$OUT/results/serve.json" ;;
    serve-soak) TAIL=20 step 590 python3 benchmarks/bench_serve.py --model sdxl --budget-s 565 --soak --steps 3 \
        --max-batch 16 --max-call 8 --max-requests 1000 --out "$OUT/results/serve_soak.json" ;;
    probe-merge) TAIL=18 step 300 python3 benchmarks/probes/probe_merge_kernel.py --stream --out "$OUT/results/merge_kernel.json" ;;
    per-prompt-forms) for m in sdxl flux; do TAIL=6 step 200 python3 benchmarks/probes/probe_per_prompt_forms.py \
        --model $m --out "$OUT/results/per_prompt_forms_$m.json"; done ;;
  esac
done
