"""Giving freed memory back to the system (glibc; a no-op elsewhere).

A refused oversized header is tens of MB that gRPC received and Python freed at once. glibc keeps such memory:
after a large block it frees, it raises its mmap threshold (later large blocks then come from arenas that never
shrink), and each thread that allocates may get an arena of its own: without the tuning at start-up and the release
after each refusal, a server that refuses a few concurrent oversized headers keeps their memory as resident set for
good.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8
MMAP_THRESHOLD = 128 << 10  # glibc's starting value; set explicitly, it no longer grows after a large free
ARENAS = 2

_libc = None


def _glibc():
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _libc = lib if lib is not None and hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except OSError:
            _libc = False
    return _libc or None


def tune_allocator() -> bool:
    """Fix glibc's mmap threshold (large buffers are mapped and unmapped, not kept in arenas) and cap its arenas.
    Call once, early in the server process; returns whether it applied."""
    libc = _glibc()
    return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_ARENA_MAX, ARENAS))


def release_freed() -> bool:
    """Return freed heap memory to the system (malloc_trim: a few milliseconds, against the tens of MB of a header
    that was received only to be refused)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
