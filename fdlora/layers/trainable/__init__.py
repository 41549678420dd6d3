"""Trainable LoRA layers (the training side of the fused layers): the modules, the per-pass half-precision casts
of their adapters, and frozen 4-bit bases run inside their op."""
