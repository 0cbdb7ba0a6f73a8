"""What this host's memory holds: sizes that multiply (pairs x words of a generated world, prompts x candidates x
words of a best-of-n pool) are compared with it before anything is allocated, so that settings each within its own
bound (:mod:`rewarduq_exp.core.setting_bounds`) cannot together ask for 75 GiB and end in the allocator's traceback.

The figure compared is the host's available memory (``MemAvailable``: free plus reclaimable page cache), shared by
this host's processes of a launcher (``LOCAL_WORLD_SIZE``); an estimate of what an allocation needs is a lower bound
(measured peaks, rounded down), so a refusal is never a false alarm, only a failure that would have come later."""

from __future__ import annotations

import os
from pathlib import Path

from rewarduq_exp.core.errors import UserError

FALLBACK_AVAILABLE_BYTES = 8 * 2**30   # a host whose available memory cannot be read (not Linux)
GIB = 2**30


def local_processes() -> int:
    """Processes of a launcher (torchrun, accelerate, a multi-task Slurm job) that share this host's memory."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def available_bytes() -> float:
    """The host's available memory (``MemAvailable`` of /proc/meminfo) per process of this host's share of a run."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024 / local_processes()
    except OSError:
        pass
    return FALLBACK_AVAILABLE_BYTES / local_processes()


def check_fits_host(needed: float, what: str, lower: str) -> None:
    """One line when ``needed`` bytes (``what``: the settings and what they build) exceed the available memory;
    ``lower``: what to lower."""
    have = available_bytes()
    if needed > have:
        raise UserError(f"{what} needs at least {needed / GIB:.1f} GiB of memory, more than this host has available "
                        f"({have / GIB:.1f} GiB); lower {lower}")
