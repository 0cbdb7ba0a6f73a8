"""On-disk cache of backbone features shared by every run and every process.

An entry is one tensor file plus a JSON sidecar describing what it holds. Entries are written to a temporary name
and renamed, under a per-entry file lock, so that 27 sweep jobs asking for the same features compute them once: the
first takes the lock and extracts, the others wait on the lock and then read the finished file. A reader never sees a
half-written tensor, and a killed writer leaves only a stray temp file (ignored).

Under a multi-process run (torchrun / accelerate) the processes of ONE run share an entry's work instead:
:meth:`FeatureCache.get_or_compute_sharded` has each compute a contiguous block of rows, and rank 0 stitches the blocks
into the entry. The blocks travel through the cache folder (which multi-node runs must share anyway), not through the
process group: a feature matrix can be gigabytes, too much for one collective message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from rewarduq_exp.core import distributed
from rewarduq_exp.core.atomic_write import atomic_path, write_atomic


class FeatureCache:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}.pt"

    def get(self, key: str) -> torch.Tensor | None:
        path = self.path(key)
        if not path.exists():
            return None
        # weights_only: loading a cache entry must never execute code.
        return torch.load(path, map_location="cpu", weights_only=True)

    def _save_tensor(self, tensor: torch.Tensor, path: Path) -> None:
        with atomic_path(path) as tmp:
            torch.save(tensor, tmp)

    def get_or_compute_sharded(self, key: str, n: int, compute_rows: Callable[[np.ndarray], torch.Tensor],
                               meta: dict) -> tuple[torch.Tensor, bool]:
        """Like :meth:`get_or_compute` for an entry of ``n`` rows, computed by all processes of a distributed run:
        ``compute_rows(indices)`` gives the rows of this process's block. Every process must call it (collective)."""
        if distributed.world_size() == 1:
            return self.get_or_compute(key, lambda: compute_rows(np.arange(n)), meta)
        # Rank 0 decides hit or miss for all: processes that disagreed would wait for each other forever.
        if distributed.broadcast_from_main(self.get(key) is not None):
            return self.get(key), True
        self.root.mkdir(parents=True, exist_ok=True)
        rows = distributed.shard_rows(n)
        part = self.root / f"{key}.part{distributed.rank()}.pt"
        if len(rows):
            self._save_tensor(compute_rows(rows).contiguous(), part)
        else:
            part.unlink(missing_ok=True)  # a stale block of a crashed run must not be stitched in
        distributed.barrier()
        if distributed.is_main():
            parts = [self.root / f"{key}.part{r}.pt" for r in range(distributed.world_size())]
            # Blocks are contiguous and in rank order; empty blocks (n < world size) wrote no file.
            blocks = [torch.load(p, map_location="cpu", weights_only=True) for p in parts if p.exists()]
            self.get_or_compute(key, lambda: torch.cat(blocks), meta)
            for p in parts:
                p.unlink(missing_ok=True)
        distributed.barrier()
        return self.get(key), False

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
            self._save_tensor(tensor, self.path(key))
            return tensor, False

