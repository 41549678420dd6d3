"""Triton backend: one kernel per file with its launcher and torch.library registration.

Import `fdlora.kernels.triton.ops` (the registry does, lazily) for the op namespace; set
TRITON_INTERPRET=1 before that import to run the kernels on CPU (tests).
"""
