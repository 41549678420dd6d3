"""Packaging lives in pyproject.toml. This file only adds the CUDA C++ extension when asked, built ahead of time:

    FDLORA_BUILD_CUDA=1 pip install --no-build-isolation .      (needs nvcc, ninja and a CUDA torch)

Without the flag nothing is compiled: the extension builds itself on first use instead (fdlora.kernels.cuda.build).
Compute capabilities: $FDLORA_CUDA_ARCHS, else the release list (fdlora.kernels.cuda.build.ARCHS).
"""

import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("FDLORA_BUILD_CUDA") == "1":
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    from fdlora.kernels.cuda.build import compiler  # one linking libstdc++ as a shared library (build.py says why)

    os.environ["CXX"] = compiler() or os.environ.get("CXX", "c++")
    os.environ["TORCH_CUDA_ARCH_LIST"] = os.environ.get("FDLORA_CUDA_ARCHS") or "8.0;8.9;9.0;10.0;12.0+PTX"
    csrc = "fdlora/kernels/cuda/csrc"
    ext_modules = [CUDAExtension("fdlora.kernels.cuda._C", [f"{csrc}/ops.cpp", f"{csrc}/kernels.cu"],
                                 extra_compile_args={"cxx": ["-O3"],
                                                     "nvcc": ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
                                                              "--threads=0"]})]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
