"""CUTLASS (CUDA C++) kernels for Hopper: the LoRA-fused GEMM (csrc/) and its ctypes binding (lib.py)."""
