"""The CUDA C++ backend: csrc/ (TORCH_LIBRARY ops, namespace fdlora_cuda), build.py (how it is built and found),
ops.py (the backend's op module, same functions as fdlora.kernels.ops). Importing this package builds
nothing; importing .ops loads the library, building it on first use."""
