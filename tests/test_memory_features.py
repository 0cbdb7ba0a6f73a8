"""The API's in-memory feature store: every lookup returns each text's own row, whatever was stored, evicted or
computed in the same call; memory stays within its bound; rows of another shape (another probe) live beside them."""

from __future__ import annotations

import numpy as np
import torch

from rewarduq_exp.models.memory_features import MemoryFeatures


def row_of(text: str, width: int) -> torch.Tensor:
    """A row that only this text gives (its characters' codes, cycled), as a backbone's features would be."""
    codes = torch.tensor([float(ord(c)) for c in text] or [0.0])
    return codes.repeat(width // len(codes) + 1)[:width] + len(text)


def test_random_lookups_always_return_each_texts_own_row_within_the_bound():
    rng = np.random.default_rng(0)
    vocabulary = [f"text {i}" for i in range(60)]
    store = MemoryFeatures(max_bytes=25 * 16 * 4 + 10 * 2 * 3 * 4)   # room for ~25 rows of width 16 (or mixes)
    computed = 0
    for step in range(300):
        width, shape = (16, (16,)) if step % 3 else (6, (2, 3))      # two probes: rows of two shapes
        texts = [vocabulary[i] for i in rng.integers(0, len(vocabulary), rng.integers(1, 12))]

        def compute(rows, width=width, shape=shape, texts=texts):
            nonlocal computed
            computed += len(rows)
            return torch.stack([row_of(texts[i], width).reshape(shape) for i in rows])

        got, all_stored = store.lookup({"probe": width}, texts, compute)
        expected = torch.stack([row_of(t, width).reshape(shape) for t in texts])
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert store.nbytes <= store.max_bytes
        assert store.nbytes == sum(slab.row_bytes for slab, _ in store.rows.values())
    assert computed < 300 * 6   # rows were found again, not all recomputed


def test_a_block_larger_than_the_store_is_returned_whole_and_its_last_rows_kept():
    store = MemoryFeatures(max_bytes=3 * 8 * 4)
    texts = [f"t{i}" for i in range(5)]
    got, _ = store.lookup({}, texts, lambda rows: torch.stack([row_of(texts[i], 8) for i in rows]))
    torch.testing.assert_close(got, torch.stack([row_of(t, 8) for t in texts]))
    asked = []
    store.lookup({}, texts[2:], lambda rows: asked.append(list(rows)) or torch.zeros(len(rows), 8))
    assert asked == [] and len(store.rows) == 3   # t2, t3, t4 were kept


def test_a_store_of_zero_bytes_keeps_nothing_and_still_answers():
    store = MemoryFeatures(max_bytes=0)
    got, stored = store.lookup({}, ["a", "a"], lambda rows: torch.stack([row_of("a", 4) for _ in rows]))
    assert not stored and len(store.rows) == 0 and store.nbytes == 0
    torch.testing.assert_close(got, torch.stack([row_of("a", 4)] * 2))
