"""Where backbone features are kept on disk for runs (shared by every run and process); the API and the server keep
theirs in memory (:mod:`rewarduq_exp.models.memory_features`).

On disk, features are stored per TEXT: a request for any subset, order or regrouping of texts that were already
extracted with the same backbone and probe costs no backbone pass. The rows of one (backbone, probe) pair live in
one folder, ``<root>/rows/<hash of backbone and probe>/``, as shard files (safetensors: the rows and a 16-byte hash
of each row's text), one shard per batch of rows that had to be computed. A lookup hashes the texts, finds each in
the shards' key lists (read once per process and shard) and computes only the texts found nowhere. Runs know most
keys without the texts (:mod:`rewarduq_exp.models.conversation_index` records them per conversation), so a run
whose rows are all here renders no chat template and loads no tokenizer.

Shards are written to a temporary name and renamed, under a file lock named after the set of missing texts, so
that 27 sweep jobs asking for the same features compute them once: the first takes the lock and extracts, the others
wait on the lock (saying so in one log line, with the holder's pid and host: :mod:`rewarduq_exp.core.file_locks`)
and then find every text in the finished shard. A reader never sees a half-written shard, and a
killed writer leaves only a stray temp file (ignored) and a lock the system releases with the process.

Under a multi-process run (torchrun / accelerate) the processes of ONE run share the missing rows instead: each
computes a contiguous block of them and rank 0 writes the shard. The blocks travel through the cache folder (which
multi-node runs must share anyway), not through the process group: a feature matrix can be gigabytes, too much for
one collective message.

:meth:`FeatureCache.get_or_compute` keeps whole tensors under one key (token counts of a whole list, tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rewarduq_exp.core import distributed, file_locks
from rewarduq_exp.core.atomic_write import atomic_path, write_atomic
from rewarduq_exp.core.hashing import stable_hash

# Bytes of a text's SHA-256 kept as its key: 128 bits, so two texts of one cache never share a key in practice.
TEXT_KEY_BYTES = 16
# A shard is read whole when more than this many separate runs of rows are wanted from it, else run by run.
_MAX_SLICES_PER_SHARD = 64


def text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()[:TEXT_KEY_BYTES]


def unread_shards(folder: Path, prefix: str, read: set[str]) -> list[Path]:
    """The ``<prefix>*.safetensors`` files of ``folder`` not in ``read`` (names), in name order. Every lookup asks
    this, and a cache shared by a long study holds tens of thousands of shards: names are compared as strings and
    only the new ones sorted (sorting every Path of a glob cost a study half of its scoring time)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return [folder / name for name in sorted(n for n in names if n not in read and n.startswith(prefix)
                                             and n.endswith(".safetensors"))]


class RowShards:
    """The shards of one (backbone, probe) folder, and where each text's row is: ``where[key] = (shard, row)``."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.paths: list[Path] = []
        self.names: set[str] = set()
        self.where: dict[bytes, tuple[int, int]] = {}

    def refresh(self) -> None:
        """Index the shards written since the last call (by this or any other process)."""
        for path in unread_shards(self.folder, "shard-", self.names):
            try:
                with safe_open(str(path), framework="pt") as fh:
                    keys = fh.get_tensor("keys").numpy()
            except Exception as err:  # noqa: BLE001 (a damaged shard only costs recomputation)
                warnings.warn(f"feature cache: {path} cannot be read ({type(err).__name__}); its rows will be "
                              "computed again (delete the file to silence this)", stacklevel=2)
                continue
            shard = len(self.paths)
            self.paths.append(path)
            self.names.add(path.name)
            for row, key in enumerate(keys):
                self.where.setdefault(key.tobytes(), (shard, row))

    def gather(self, keys: list[bytes]) -> torch.Tensor:
        """The rows of ``keys`` (all indexed), stacked in order."""
        located = np.array([self.where[k] for k in keys], dtype=np.int64).reshape(-1, 2)
        out = None
        for shard in np.unique(located[:, 0]):
            at = np.flatnonzero(located[:, 0] == shard)
            rows = located[at, 1]
            block = self._read_rows(self.paths[shard], rows)
            if out is None:
                out = torch.empty((len(keys), *block.shape[1:]), dtype=block.dtype)
            out[torch.from_numpy(at)] = block
        return out

    @staticmethod
    def _read_rows(path: Path, rows: np.ndarray) -> torch.Tensor:
        wanted = np.unique(rows)
        starts = np.flatnonzero(np.diff(wanted, prepend=-2) != 1)  # runs of consecutive rows
        with safe_open(str(path), framework="pt") as fh:
            if len(starts) > _MAX_SLICES_PER_SHARD:
                return fh.get_tensor("features")[torch.from_numpy(rows)]
            features = fh.get_slice("features")
            ends = np.append(starts[1:], len(wanted))
            block = torch.cat([features[int(wanted[a]): int(wanted[b - 1]) + 1] for a, b in zip(starts, ends)])
        return block[torch.from_numpy(np.searchsorted(wanted, rows))]

    def write(self, keys: list[bytes], features: torch.Tensor) -> None:
        """Store rows as a new shard (atomically; named after its keys, so writing the same rows twice is one file)."""
        key_array = torch.from_numpy(np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, TEXT_KEY_BYTES).copy())
        name = hashlib.sha256(b"".join(keys)).hexdigest()[:24]
        with atomic_path(self.folder / f"shard-{name}.safetensors") as tmp:
            save_file({"features": features.contiguous(), "keys": key_array}, str(tmp))


class FeatureCache:
    """The disk store of runs: rows per (backbone, probe, text) for features, whole tensors per key otherwise."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._shards: dict[Path, RowShards] = {}

    def lookup(self, meta: dict, texts: list[str], compute_rows: Callable[[np.ndarray], torch.Tensor],
               ) -> tuple[torch.Tensor, bool]:
        """``(rows of texts, hit)``: the rows of ``texts`` (``meta`` says how they are read), computing only the texts
        not stored yet by ``compute_rows(indices into texts)``; hit = nothing was computed. Collective under a
        distributed run."""
        return self.lookup_keys(meta, [text_key(t) for t in texts], compute_rows)

    def lookup_keys(self, meta: dict, keys: list[bytes], compute_rows: Callable[[np.ndarray], torch.Tensor],
                    ) -> tuple[torch.Tensor, bool]:
        """:meth:`lookup` by the texts' keys (:func:`text_key`), for a caller that knows them without the texts
        (:mod:`rewarduq_exp.models.conversation_index`): a run whose rows are all stored renders nothing."""
        folder = self.root / "rows" / stable_hash(meta, n=24)
        shards = self._shards.setdefault(folder, RowShards(folder))
        shards.refresh()
        missing = self._first_missing(keys, shards)
        if distributed.world_size() > 1:
            missing = distributed.broadcast_from_main(missing)  # processes that disagreed would wait forever
        computed = self._compute_missing(folder, meta, shards, keys, missing, compute_rows) if len(missing) else 0
        if not keys:
            return torch.empty(0), True
        return shards.gather(keys), computed == 0

    @staticmethod
    def _first_missing(keys: list[bytes], shards: RowShards) -> np.ndarray:
        """Indices of the texts stored nowhere, each text once (its first occurrence)."""
        first: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            if key not in shards.where:
                first.setdefault(key, i)
        return np.fromiter(first.values(), dtype=np.int64, count=len(first))

    def _compute_missing(self, folder: Path, meta: dict, shards: RowShards, keys: list[bytes], missing: np.ndarray,
                         compute_rows: Callable[[np.ndarray], torch.Tensor]) -> int:
        """Compute and store the missing rows (unless another job stored them meanwhile); returns how many."""
        if distributed.is_main() and not (folder / "meta.json").exists():
            write_atomic(folder / "meta.json", json.dumps(meta, indent=1, default=str))
        lock_name = hashlib.sha256(b"".join(keys[i] for i in missing)).hexdigest()[:24]
        if distributed.world_size() == 1:
            with file_locks.held(folder / f"{lock_name}.lock", "backbone features another process is computing"):
                shards.refresh()  # another job may have stored them while we waited for the lock
                missing = self._first_missing(keys, shards)
                if len(missing):
                    shards.write([keys[i] for i in missing], compute_rows(missing))
        else:
            block = self._computed_in_blocks(folder / lock_name, missing, compute_rows)
            if distributed.is_main():
                shards.write([keys[i] for i in missing], block)
            distributed.barrier()
        shards.refresh()
        return len(missing)

    def _computed_in_blocks(self, stem: Path, rows: np.ndarray, compute_rows) -> torch.Tensor | None:
        """Collective: each process computes its contiguous block of ``rows``; rank 0 gets them all (others None)."""
        stem.parent.mkdir(parents=True, exist_ok=True)
        mine = rows[distributed.shard_rows(len(rows))]
        part = Path(f"{stem}.part{distributed.rank()}.pt")
        if len(mine):
            self._save_tensor(compute_rows(mine).contiguous(), part)
        else:
            part.unlink(missing_ok=True)  # a stale block of a crashed run must not be stitched in
        distributed.barrier()
        if not distributed.is_main():
            return None
        parts = [Path(f"{stem}.part{r}.pt") for r in range(distributed.world_size())]
        # Blocks are contiguous and in rank order; empty blocks (fewer rows than processes) wrote no file.
        blocks = [torch.load(p, map_location="cpu", weights_only=True) for p in parts if p.exists()]
        for p in parts:
            p.unlink(missing_ok=True)
        return torch.cat(blocks)

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

    def get_or_compute(self, key: str, compute: Callable[[], torch.Tensor], meta: dict) -> tuple[torch.Tensor, bool]:
        """Return ``(tensor, hit)``; ``compute`` runs at most once per key across all processes."""
        cached = self.get(key)
        if cached is not None:
            return cached, True
        self.root.mkdir(parents=True, exist_ok=True)
        with file_locks.held(str(self.path(key)) + ".lock", f"the cache entry {key} another process is computing"):
            cached = self.get(key)  # another process may have finished it while we waited for the lock
            if cached is not None:
                return cached, True
            tensor = compute().contiguous()
            write_atomic(self.root / f"{key}.json", json.dumps({**meta, "shape": list(tensor.shape),
                                                                 "dtype": str(tensor.dtype)}, indent=1, default=str))
            self._save_tensor(tensor, self.path(key))
            return tensor, False
