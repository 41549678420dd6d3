"""The C heap of a serving process (glibc; a no-op elsewhere).

A call decodes and encodes megabyte images and host tensors on whichever threads serve it. glibc gives each new
thread its own arena (up to 8 per core) and, once a freed buffer has raised its mmap threshold (up to 32 MiB), serves
those buffers from the arenas, where freed pages stay scattered among live ones. The RSS then follows the threads that
ever ran rather than the data that lives: on a 16-core host, hundreds of MB over a few hundred 1024² images.
`limit_arenas` puts every thread on the main arena (unless the caller set `MALLOC_ARENA_MAX`), so freed buffers are
reused, and `trim`, after each call, gives the rest back: `malloc_trim` returns the main arena's top and every arena's
free chunks, but another arena keeps its top mapped up to the trim threshold, which follows the mmap threshold to twice
its size (24 MiB once a 1024² float32 image has been freed). Behind glibc's per-thread caches one arena costs the
threads no measurable time. What a call's answers hold after that (PNG bytes, response bodies) is freed once they are
sent: `trim_later` gives it back when the server has been idle a moment, so an idle server's RSS is the data that
lives. Pinning the mmap threshold instead keeps the RSS as flat but maps and faults in every large host tensor afresh,
a quarter slower on CPU-bound steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)
ARENAS = 1
IDLE_S = 1.0  # seconds without a call before `trim_later` trims
_libc = None
_limited = False
_timer: threading.Timer | None = None
_timer_lock = threading.Lock()


class _Mallinfo2(ctypes.Structure):  # malloc.h's struct mallinfo2 (glibc 2.33+), every field a size_t
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
            if _libc and hasattr(lib, "mallinfo2"):
                lib.mallinfo2.restype = _Mallinfo2
        except OSError:
            _libc = False
    return _libc


def limit_arenas() -> bool:
    """One glibc arena for this process; True when the number is capped (here or by the environment).
    Threads that start later share it; arenas made before stay."""
    global _limited
    if _limited or "MALLOC_ARENA_MAX" in os.environ:
        return True
    lib = _glibc()
    _limited = bool(lib) and lib.mallopt(M_ARENA_MAX, ARENAS) == 1
    return _limited


def trim() -> None:
    """Give the arenas' free pages back to the OS (malloc_trim)."""
    lib = _glibc()
    if lib:
        lib.malloc_trim(0)


def usage() -> dict[str, int | None]:
    """The C heap's bytes in use (blocks malloc handed out and not freed, mmapped ones included) and free (held in the
    arenas' bins, whether or not their pages are resident); None where glibc has no mallinfo2. A rise in use is data
    that lives; a rise in free with the RSS is pages a trim could not return."""
    lib = _glibc()
    if not lib or not hasattr(lib, "mallinfo2"):
        return {"heap_in_use": None, "heap_free": None}
    m = lib.mallinfo2()
    return {"heap_in_use": m.uordblks + m.hblkhd, "heap_free": m.fordblks}


def trim_later(after_s: float = IDLE_S) -> None:
    """Trim once `after_s` seconds pass without another call to this one (each call restarts the wait), on a daemon
    timer thread: under load the wait never ends and each call's own trim is what runs."""
    global _timer
    with _timer_lock:
        if _timer is not None:
            _timer.cancel()
        _timer = threading.Timer(after_s, trim)
        _timer.daemon = True
        _timer.start()
