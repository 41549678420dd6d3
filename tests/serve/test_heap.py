"""fdlora.serve.heap: a serving process's large host buffers go back to the OS when freed, so its RSS follows the
data that lives. Each case runs in a fresh interpreter, since glibc's mmap threshold is per-process state."""

import ctypes
import ctypes.util
import json
import subprocess
import sys

import pytest

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
pytestmark = pytest.mark.skipif(not hasattr(libc, "mallinfo2"), reason="glibc >= 2.33 only (mallinfo2)")

MAPPED_AFTER_FREE = """
import ctypes, ctypes.util, json, sys
from fdlora.serve import heap

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.mallinfo2.restype = Info
if sys.argv[1] == "pinned":
    assert heap.pin_mmap_threshold()
libc.free(libc.malloc(4 << 20))  # an unpinned glibc raises its threshold past 4 MiB here
before = libc.mallinfo2().hblkhd
p = libc.malloc(4 << 20)
print(json.dumps({"mapped": libc.mallinfo2().hblkhd - before}))
libc.free(p)
"""

THREADED_IMAGES = """
import ctypes, io, json, sys, threading
import numpy as np, torch
from PIL import Image
from fdlora.serve import heap

if sys.argv[1] == "pinned":
    heap.pin_mmap_threshold()

def rss_mb():
    heap.trim()
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

def request(seed):  # what a served image costs the host: the decoded tensor, its PNG, the client's decode of it
    img = torch.rand(1, 3, 1024, 1024, generator=torch.Generator().manual_seed(seed))
    a = (img[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG", compress_level=1)
    back = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"), dtype=np.int16)
    assert np.abs(back - a).max() == 0

request(0)
r0, growth = rss_mb(), []
for k in range(5):
    threads = [threading.Thread(target=request, args=(100 * k + i,)) for i in range(16)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    growth.append(rss_mb() - r0)
print(json.dumps({"growth_mb": growth}))
"""


def run(script: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["pinned", "unpinned"])
def test_a_freed_large_buffer_keeps_the_next_one_mapped_only_when_pinned(mode):
    mapped = run(MAPPED_AFTER_FREE, mode)["mapped"]
    if mode == "pinned":
        assert mapped >= 4 << 20, "a 4 MiB buffer should get its own mapping once the threshold is pinned"
    else:  # glibc's own rule, which pinning is there to stop: the freed buffer raised the threshold past it
        assert mapped == 0


def test_rss_stays_flat_while_threads_make_and_free_megabyte_images():
    growth = run(THREADED_IMAGES, "pinned")["growth_mb"]
    assert max(growth) <= 40, f"RSS grew {growth} MB over 5 rounds of 16 threads with the threshold pinned"
