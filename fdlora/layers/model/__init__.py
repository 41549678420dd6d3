"""One model's view: the handle that swaps layers in and out and loads adapters, target selection, and where MoE
layers go."""
