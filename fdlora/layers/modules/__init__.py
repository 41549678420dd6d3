"""The nn.Module types swapped into a model: fused linear / conv layers, DoRA, MoE experts and routers, and the
one-shrink groups of layers that read the same input."""
