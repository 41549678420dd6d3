"""Triton forward kernels: the shrink, the expand-add, the fused delta (blend / per-sample and per-row), the fused base
GEMM + LoRA, and the per-shape choice between the paths."""
