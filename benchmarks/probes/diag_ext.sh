#!/usr/bin/env bash
# Showed (H100, session 16; printed, no JSON): the crash is in the extension's own static copy of libstdc++ (ostream
# insert called from c10::operator<<); rebuilt with /usr/bin/g++ (libstdc++.so.6 in NEEDED) every probed case raises.
export PYTHONPATH=/tmp/site:$PWD
SO=$(python3 -c "from fdlora.kernels.cuda import build; print(build.status().library)")
echo "CXX=${CXX:-unset} CC=${CC:-unset}; which g++: $(which g++)"; ls -la /opt/gcc/bin/g++ 2>/dev/null
for c in /opt/gcc/bin/g++ /usr/bin/g++; do echo "$c: $($c --version | head -1); libstdc++.so: $($c -print-file-name=libstdc++.so); .a: $($c -print-file-name=libstdc++.a)"; done
echo "== dynamic cxx runtime symbols: ours"; nm -D --defined-only $SO | grep -c "cxa\|gxx_personality\|_ZNSt\|_ZSt"
L=$(ls ~/.cache/torch_extensions/*/inl_plain/*.so 2>/dev/null | head -1)
[ -n "$L" ] && { echo "== inline"; nm -D --defined-only $L | grep -c "cxa\|gxx_personality\|_ZNSt\|_ZSt"; }
cat > /tmp/segv.c <<'C'
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>
static void h(int s) { void* b[64]; int n = backtrace(b, 64); backtrace_symbols_fd(b, n, 2); _exit(139); }
__attribute__((constructor)) static void init(void) { signal(SIGSEGV, h); }
C
gcc -shared -fPIC -o /tmp/segv.so /tmp/segv.c && LD_PRELOAD=/tmp/segv.so python3 benchmarks/probes/probe_device_check.py direct_badshape 2>&1 | tail -25
echo "== rebuilt with /usr/bin/g++"
CXX=/usr/bin/g++ FDLORA_CUDA_CACHE=/tmp/cc2 python3 -c "from fdlora.kernels.cuda import build; print(build.build())" 2>&1 | tail -2
for c in direct_badshape op_scale_cpu; do CXX=/usr/bin/g++ FDLORA_CUDA_CACHE=/tmp/cc2 python3 benchmarks/probes/probe_device_check.py $c 2>&1 | tail -2; echo "  rc=${PIPESTATUS[0]}"; done
S2=$(ls /tmp/cc2/*/fdlora_cuda.so); readelf -d $S2 | grep NEEDED; nm -D --defined-only $S2 | grep -c "cxa\|gxx_personality\|_ZNSt\|_ZSt"
