"""What every label ranker checks on its training data."""

from __future__ import annotations

import numpy as np

from rewarduq_exp.ranking.permutations import check_rankings


def check_xy(X, ranks) -> tuple[np.ndarray, np.ndarray]:
    """X as float64 (n, d) and ranks as checked permutations (n, m) with as many rows (ValueError otherwise)."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise ValueError(f"X must have shape (n, d), got {X.shape}")
    ranks = check_rankings(ranks, what="training rankings")
    if len(X) != len(ranks):
        raise ValueError(f"X has {len(X)} rows but ranks has {len(ranks)}")
    return X, ranks
