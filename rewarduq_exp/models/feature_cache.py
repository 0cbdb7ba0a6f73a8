"""Where backbone features are kept: on disk for runs (shared by every run and process), in memory for the API.

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

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock

from rewarduq_exp.core import distributed
from rewarduq_exp.core.atomic_write import atomic_path, write_atomic
from rewarduq_exp.core.hashing import stable_hash, texts_fingerprint


class FeatureCache:
    """The disk store of a run: one entry per (backbone, probe, list of texts), shared by the processes of a run."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def lookup(self, meta: dict, texts: list[str], compute_rows: Callable[[np.ndarray], torch.Tensor],
               ) -> tuple[torch.Tensor, bool]:
        """Features of ``texts`` (``meta`` says how they are read); collective under a distributed run."""
        meta = {**meta, "texts": texts_fingerprint(texts), "n": len(texts)}
        return self.get_or_compute_sharded(stable_hash(meta, n=24), len(texts), compute_rows, meta)

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



class MemoryFeatures:
    """A bounded in-memory store of feature ROWS, for scoring through the Python API.

    An RL loop scores new texts at every step, for days: one disk entry per call would grow without bound and each
    call's entry is never read again. Rows are keyed by (how they are read, the text) and the least recently used
    rows leave once ``max_bytes`` is exceeded, so a repeated text (a prompt's reference answer, a best-of-n candidate
    scored under several k) is computed once. Lookups are local to the calling process: under torchrun each process
    scores its own texts and never waits for another.
    """

    def __init__(self, max_bytes: int = 256 * 2**20):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        self.max_bytes = int(max_bytes)
        self.rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.nbytes = 0

    def lookup(self, meta: dict, texts: list[str], compute_rows: Callable[[np.ndarray], torch.Tensor],
               ) -> tuple[torch.Tensor, bool]:
        prefix = stable_hash(meta, n=24)
        keys = [hashlib.sha256(f"{prefix}\0{t}".encode()).hexdigest() for t in texts]
        first_of = {}  # a text repeated in one call is computed once
        for i, key in enumerate(keys):
            if key not in self.rows:
                first_of.setdefault(key, i)
        computed = {}
        if first_of:
            missing = np.fromiter(first_of.values(), dtype=np.int64, count=len(first_of))
            block = compute_rows(missing)
            computed = {keys[i]: block[j] for j, i in enumerate(missing)}
        out = torch.stack([computed[k] if k in computed else self.rows[k] for k in keys]) if keys else torch.empty(0)
        for key in keys:
            if key in self.rows:
                self.rows.move_to_end(key)
        for key, row in computed.items():
            self._put(key, row.clone())  # a view would keep the whole computed block alive
        return out, not first_of

    def _put(self, key: str, row: torch.Tensor) -> None:
        size = row.numel() * row.element_size()
        if size > self.max_bytes:
            return
        self.rows[key] = row
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, old = self.rows.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()
