"""LoRA over quantized or low-precision-stored bases: what kind of weight a base holds, and the merges into the
weight such a base dequantizes on every call (torchao weight-only, diffusers GGUF)."""
