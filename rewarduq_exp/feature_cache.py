"""On-disk cache of backbone features shared by every run and every process (DESIGN section 3).

An entry is one tensor file plus a JSON sidecar describing what it holds. Entries are written to a temporary name
and renamed, under a per-entry file lock, so that 27 sweep jobs asking for the same features compute them once: the
first takes the lock and extracts, the others wait on the lock and then read the finished file. A reader never sees a
half-written tensor, and a killed writer leaves only a stray temp file (ignored).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from filelock import FileLock

from rewarduq_exp.atomic_write import write_atomic  # re-exported: run_folder and methods import it from here


class FeatureCache:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}.pt"

    def get(self, key: str) -> torch.Tensor | None:
        path = self.path(key)
        if not path.exists():
            return None
        # weights_only: loading a cache entry must never execute code (DESIGN section 6).
        return torch.load(path, map_location="cpu", weights_only=True)

    def get_or_compute(self, key: str, compute: Callable[[], torch.Tensor], meta: dict) -> tuple[torch.Tensor, bool]:
        """Return ``(tensor, hit)``; ``compute`` runs at most once per key across all processes."""
        cached = self.get(key)
        if cached is not None:
            return cached, True
        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.path(key)) + ".lock"):
            cached = self.get(key)  # another process may have finished it while we waited for the lock
            if cached is not None:
                return cached, True
            tensor = compute().contiguous()
            write_atomic(self.root / f"{key}.json", json.dumps({**meta, "shape": list(tensor.shape),
                                                                 "dtype": str(tensor.dtype)}, indent=1, default=str))
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.root)
            os.close(fd)
            try:
                torch.save(tensor, tmp)
                os.replace(tmp, self.path(key))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return tensor, False

