"""Triton merges: W' = W + sum_s w_s B_s A_s for one layer, many layers in one launch, and into a dequantized base
(torchao, GGUF); and the bank scatter that writes staged adapters into every bank in one launch."""
