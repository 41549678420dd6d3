"""The C heap of a serving process (glibc; a no-op elsewhere).

A call decodes and encodes megabyte images and host tensors on whichever threads serve it. glibc serves a buffer
above its mmap threshold with its own mapping, returned to the OS on free, but it raises that threshold to the size
of every such buffer freed (up to 32 MiB on 64-bit), so after the first few requests the same buffers land in the
per-thread arenas, where freed pages stay with the arena. The RSS then follows the threads that ever ran and the
fragmentation they left rather than the data that lives. `pin_mmap_threshold` fixes the threshold once per
process (1 MiB: large buffers map and unmap, small ones stay in the arenas), unless the caller set
`MALLOC_MMAP_THRESHOLD_` in the environment; `trim` gives the arenas' free pages back after each call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 1 << 20
_libc = None
_pinned = False


def _glibc():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else False
        except OSError:
            _libc = False
    return _libc


def pin_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at 1 MiB for this process; True when it is fixed (here or by the environment)."""
    global _pinned
    if _pinned or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return True
    lib = _glibc()
    _pinned = bool(lib) and lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return _pinned


def trim() -> None:
    """Give the arenas' free pages back to the OS (malloc_trim)."""
    lib = _glibc()
    if lib:
        lib.malloc_trim(0)
