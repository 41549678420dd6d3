#!/usr/bin/env bash
# Showed (H100, session 16; printed, no JSON): load_inline modules raise a failed TORCH_CHECK, the fd-lora extension
# built by the host's /opt/gcc/bin/g++ (static libstdc++) segfaults on it (fixed in fdlora/kernels/cuda/build.py).
#   bash benchmarks/probes/probe_check_crash.sh   (PYTHONPATH with fdlora; the extension built)
set -u
gcc --version | head -1; (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>/dev/null | tail -2
python3 -c "import torch; print('cxx11 abi', torch._C._GLIBCXX_USE_CXX11_ABI); print([l for l in torch.__config__.show().splitlines() if 'CXX_COMPILER' in l or 'GCC' in l][:3])"
which gdb catchsegv 2>/dev/null; ls /lib/x86_64-linux-gnu/libSegFault.so 2>/dev/null
cat > /tmp/inl.py <<'PY'
import sys, torch
from torch.utils.cpp_extension import load_inline
src = r'''
#include <torch/extension.h>
void chk() { TORCH_CHECK(false, "boom from TORCH_CHECK"); }
void thr() { throw std::runtime_error("boom from std::runtime_error"); }
bool inner() { try { TORCH_CHECK(false, "x"); } catch (const c10::Error& e) { return true; } return false; }
'''
m = load_inline("inl_" + sys.argv[1], cpp_sources=src, functions=["chk", "thr", "inner"],
                extra_cflags=["-O3"] if sys.argv[1] == "o3" else [], build_directory=None, verbose=False)
for f in sys.argv[2:]:
    try:
        print(f, "->", getattr(m, f)(), flush=True)
    except Exception as e:
        print(f, "raised", type(e).__name__, str(e).splitlines()[0], flush=True)
PY
for v in ${VARIANTS:-plain o3}; do for f in inner thr chk; do python3 -X faulthandler /tmp/inl.py $v $f 2>&1 | grep -v "^  File\|^Current\|^Extension\|^$" | tail -3; echo "  [$v $f] rc=$?"; done; done
for s in 0 1; do TORCH_SHOW_CPP_STACKTRACES=$s python3 -X faulthandler benchmarks/probes/probe_device_check.py direct_badshape 2>&1 | tail -4; echo "  [ours stacktraces=$s] rc=${PIPESTATUS[0]}"; done
if which gdb >/dev/null 2>&1; then gdb -q -batch -ex run -ex bt --args python3 benchmarks/probes/probe_device_check.py direct_badshape 2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -30; fi
SO=$(python3 -c "from fdlora.kernels.cuda import build; print(build.status().library)"); echo "$SO"; ldd "$SO" | grep -i "stdc\|gcc_s\|c10\|torch" 
