"""Give freed large buffers back to the operating system at once, for passes sized to the machine's free memory.

The planner sizes a CPU pass with a backward (LA-LoRA's curvature and its Jacobian scoring) so that its peak fits
the memory that is free; that holds only if what one pass frees is free again for the next. glibc's malloc does not
guarantee it: its mmap threshold rises (up to 32 MiB on 64-bit) each time a large mmapped block is freed, after which
blocks of that size come from the heap, whose freed pieces stay with the process, fragmented. Measured on SmolLM2-135M
(160 texts in passes of 68, 80 and 12): with the default the process grew until the kernel killed it at 24 GB; with
the threshold fixed at 64 KiB the same call peaked at 15.2 GB, inside the plan, and fell back to 2.2 GB after.

A fixed threshold turns off glibc's sliding one for the whole process, so it is set only where such passes run
(``GLIBC_TUNABLES`` / ``MALLOC_MMAP_THRESHOLD_`` in the environment would do the same for a whole process, but must be
set before Python starts). Elsewhere (not glibc: macOS, musl) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3   # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 64 * 1024
_done = False


def return_large_frees_to_os() -> bool:
    """Fix glibc's mmap threshold at 64 KiB for this process (once); True where it is now set."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):   # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    if _done:
        log.debug("glibc mmap threshold fixed at %d bytes", MMAP_THRESHOLD_BYTES)
    return _done
