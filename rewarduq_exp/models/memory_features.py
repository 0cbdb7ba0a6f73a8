"""A bounded in-memory store of feature rows, for scoring through the Python API and the server.

An RL loop scores new texts at every step, for days: one disk entry per call would grow without bound and each
call's entry is never read again. Rows are keyed by (how they are read, the text) and the least recently used rows
leave once ``max_bytes`` is exceeded, so a repeated text (a prompt's reference answer, a best-of-n candidate scored
under several k) is computed once. Lookups are local to the calling process: under torchrun each process scores its
own texts and never waits for another.

The rows live in one preallocated tensor per row shape (a slab), found by slot: one small tensor per row, as before,
made the interpreter's garbage collector walk hundreds of thousands of tensors (a tenth of a CPU scoring call, and
more as the store filled); a slab is one object, and rows come out and go in with one indexing operation per call.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from rewarduq_exp.core.hashing import stable_hash


class _Slab:
    """Rows of one shape and dtype: ``data[slot]``, grown by doubling up to ``capacity`` rows, freed slots reused."""

    def __init__(self, row: torch.Tensor, capacity: int):
        self.shape, self.dtype, self.capacity = tuple(row.shape), row.dtype, capacity
        self.row_bytes = row.numel() * row.element_size()
        self.data = torch.empty((0, *self.shape), dtype=self.dtype)
        self.free: list[int] = []
        self.used = 0   # slots ever handed out (the data's rows in use or freed)

    def take(self, n: int) -> np.ndarray:
        """``n`` free slots (the caller has made room: at most ``capacity`` in use)."""
        reused = [self.free.pop() for _ in range(min(n, len(self.free)))]
        fresh = n - len(reused)
        if self.used + fresh > len(self.data):
            size = min(self.capacity, max(self.used + fresh, 2 * len(self.data), 64))
            grown = torch.empty((size, *self.shape), dtype=self.dtype)
            grown[:self.used] = self.data[:self.used]
            self.data = grown
        slots = np.concatenate([np.asarray(reused, dtype=np.int64), np.arange(self.used, self.used + fresh)])
        self.used += fresh
        return slots


class MemoryFeatures:
    """Feature rows in memory, at most ``max_bytes`` of them, least recently used first out (module docstring)."""

    def __init__(self, max_bytes: int = 256 * 2**20):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        self.max_bytes = int(max_bytes)
        self.rows: OrderedDict[str, tuple[_Slab, int]] = OrderedDict()   # key -> (slab, slot), oldest first
        self.slabs: dict[tuple, _Slab] = {}
        self.nbytes = 0

    def lookup(self, meta: dict, texts: list[str], compute_rows: Callable[[np.ndarray], torch.Tensor],
               ) -> tuple[torch.Tensor, bool]:
        """Rows of ``texts`` (stacked, in order) and whether every one was stored; ``compute_rows(indices)``
        computes the missing ones (each missing text once, at its first position)."""
        prefix = stable_hash(meta, n=24)
        keys = [hashlib.sha256(f"{prefix}\0{t}".encode()).hexdigest() for t in texts]
        if not keys:
            return torch.empty(0), True
        stored = [self.rows.get(key) for key in keys]
        first_of: dict[str, int] = {}   # a text repeated in one call is computed once
        for i, (key, found) in enumerate(zip(keys, stored)):
            if found is None:
                first_of.setdefault(key, i)
        hits = [i for i, found in enumerate(stored) if found is not None]
        block = None
        if first_of:
            block = compute_rows(np.fromiter(first_of.values(), dtype=np.int64, count=len(first_of))).detach().cpu()
        # rows of one lookup share one probe, hence one shape: they sit in one slab
        template = block[0] if block is not None else stored[hits[0]][0].data[stored[hits[0]][1]]
        out = torch.empty((len(keys), *template.shape), dtype=template.dtype)
        if hits:   # read before storing the new rows: storing may evict them
            slab = stored[hits[0]][0]
            out[torch.as_tensor(hits)] = slab.data[torch.as_tensor([stored[i][1] for i in hits])]
            for i in hits:
                self.rows.move_to_end(keys[i])
        if block is not None:
            column = {key: j for j, key in enumerate(first_of)}
            missing = [i for i, found in enumerate(stored) if found is None]
            out[torch.as_tensor(missing)] = block[torch.as_tensor([column[keys[i]] for i in missing])]
            self._store(list(first_of), block)
        return out, block is None

    def _store(self, keys: list[str], block: torch.Tensor) -> None:
        row = block[0]
        slab = self.slabs.get((tuple(row.shape), row.dtype))
        if slab is None:
            capacity = self.max_bytes // max(1, row.numel() * row.element_size())
            slab = self.slabs[tuple(row.shape), row.dtype] = _Slab(row, capacity)
        keep = min(len(keys), slab.capacity)   # a block larger than the store: its last rows stay
        if keep == 0:
            return
        keys, block = keys[len(keys) - keep:], block[len(block) - keep:]
        while self.rows and self.nbytes + keep * slab.row_bytes > self.max_bytes:
            _, (old, slot) = self.rows.popitem(last=False)
            old.free.append(slot)
            self.nbytes -= old.row_bytes
        slots = slab.take(keep)
        slab.data[torch.as_tensor(slots)] = block
        self.rows.update(zip(keys, ((slab, int(s)) for s in slots)))
        self.nbytes += keep * slab.row_bytes
