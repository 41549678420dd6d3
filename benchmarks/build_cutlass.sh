#!/usr/bin/env bash
# Build the CUTLASS LoRA-fused GEMM (fdlora/kernels/cutlass/csrc) into a self-contained sm_90a library.
#
# Needs no CUDA toolkit or GPU on the building machine: nvcc 13.0, the CUDA runtime and CUTLASS 4.2's headers
# come from pip wheels, unpacked into a scratch folder. The library links the runtime statically, so the GPU
# machine needs only a driver for CUDA 13. fdlora looks for it at ~/.cache/fdlora/cutlass/libfdlora_sm90.so
# (the default OUT) or at $FDLORA_CUTLASS_LIB (built elsewhere and carried to the GPU machine).
#   bash benchmarks/build_cutlass.sh [OUT]     (~2.5 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$HOME/.cache/fdlora/cutlass/libfdlora_sm90.so}
tools=${FDLORA_CUDA_TOOLS:-/tmp/fdlora-cuda-tools}
if [ ! -x "$tools/nvidia/cu13/bin/nvcc" ]; then
  mkdir -p "$tools/wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$tools/wheels" nvidia-cutlass==4.2.0.0 "nvidia-cuda-nvcc==13.0.*" \
    "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*"
  for w in "$tools"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tools"; done
  chmod +x "$tools"/nvidia/cu13/bin/* "$tools"/nvidia/cu13/nvvm/bin/*
fi
cutlass=$tools/cutlass_library/source
mkdir -p "$(dirname "$out")"
PATH=$tools/nvidia/cu13/bin:$PATH nvcc -std=c++17 -O3 -arch=sm_90a -DNDEBUG --expt-relaxed-constexpr \
  -I"$cutlass/include" -I"$cutlass/tools/util/include" -shared -Xcompiler -fPIC -cudart static \
  -L"$tools/nvidia/cu13/lib" -o "$out" fdlora/kernels/cutlass/csrc/lora_gemm_sm90.cu
echo "built $out"
