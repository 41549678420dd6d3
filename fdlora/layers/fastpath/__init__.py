"""The paths that make a fused layer cost what its base costs: the merged-weight cache and its re-merge, the eager
hot path, kept-ready decode launches, and captured (CUDA-graph) steps."""
