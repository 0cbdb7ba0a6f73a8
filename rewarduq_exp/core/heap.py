"""glibc's malloc policy for large CPU blocks, set where a phase needs one: freed blocks back to the operating system
at once (passes sized to the free memory), or kept for the next allocation (many steps of the same sizes).

**Back at once** (:func:`return_large_frees_to_os`). The planner sizes a CPU pass with a backward (LA-LoRA's curvature
and its Jacobian scoring) so that its peak fits the memory that is free; that holds only if what one pass frees is
free again for the next. glibc's malloc does not guarantee it: its mmap threshold rises (up to 32 MiB on 64-bit) each
time a large mmapped block is freed, after which blocks of that size come from the heap, whose freed pieces stay with
the process, fragmented. Measured on SmolLM2-135M (160 texts in passes of 68, 80 and 12): with the default the process
grew until the kernel killed it at 24 GB; with the threshold fixed at 64 KiB the same call peaked at 15.2 GB, inside
the plan, and fell back to 2.2 GB after.

**Kept** (:func:`keeping_freed_memory`). A head trained on cached features allocates and frees the same blocks every
step (gradients, activations, AdamW's denominators: 10 MB each for ENS-MLP's K = 20 heads on 1024 features). glibc
gives the top of its heap back whenever more than its trim threshold (twice the sliding mmap threshold) is free, so
each step faulted those pages in again: 230k-550k page faults an epoch, a fifth of its time on 2 cores (1.8-2.0 s
against 1.5 s with the blocks kept, every number the same).

A fixed threshold turns off glibc's sliding one for the whole process, so each policy is set only around the phase
that needs it (``GLIBC_TUNABLES`` / ``MALLOC_MMAP_THRESHOLD_`` in the environment would do the same for a whole process,
but must be set before Python starts). Where the environment does set glibc's thresholds, the kept policy leaves them
as they are: whoever set them chose for the whole process (the planner's memory tests do, so that the resident size
follows what is held). Elsewhere (not glibc: macOS, musl) nothing is done.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 64 * 1024
GLIBC_MMAP_MAX = 32 << 20        # the sliding threshold's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
KEEP_TRIM_BYTES = 1 << 30        # while kept: give nothing back below 1 GiB free
_policy: str | None = None       # "return", "keep" or None (glibc's own sliding thresholds)


@functools.cache
def _libc():
    """glibc's ``mallopt`` and ``malloc_trim``, or None where there are none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):   # not glibc (musl has no mallopt)
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return mallopt, malloc_trim


def _thresholds_set_by_environment() -> bool:
    if any(os.environ.get(name) for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return True
    return "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")


def _set(mmap_threshold: int, trim_threshold: int) -> bool:
    found = _libc()
    if found is None:
        return False
    mallopt, _ = found
    return mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1


def return_large_frees_to_os() -> bool:
    """Fix glibc's mmap threshold at 64 KiB for this process; True where it is now set."""
    global _policy
    if _policy == "return":
        return True
    # glibc's default trim threshold (128 KiB): a kept phase before must not leave its 1 GiB
    if _set(MMAP_THRESHOLD_BYTES, 128 * 1024):
        _policy = "return"
        log.debug("glibc mmap threshold fixed at %d bytes", MMAP_THRESHOLD_BYTES)
        return True
    return False


@contextlib.contextmanager
def keeping_freed_memory():
    """Inside: blocks up to 32 MiB come from the heap and what is freed stays for the next allocation (unless the
    environment sets glibc's thresholds). After: what was kept goes back to the OS and the previous policy returns
    (glibc's own sliding one cannot be restored, so after it the thresholds stay at its steady state: 32 MiB,
    trimmed above 64 MiB free)."""
    global _policy
    before = _policy
    if before == "keep" or _thresholds_set_by_environment() or not _set(GLIBC_MMAP_MAX, KEEP_TRIM_BYTES):
        yield
        return
    _policy = "keep"
    try:
        yield
    finally:
        _policy = None
        if before == "return":
            return_large_frees_to_os()
        else:
            _set(GLIBC_MMAP_MAX, 2 * GLIBC_MMAP_MAX)
        _libc()[1](0)
