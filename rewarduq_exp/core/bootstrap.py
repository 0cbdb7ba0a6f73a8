"""The two pieces every bootstrap interval of the project is built from: multinomial resampling counts (a resampled
mean is a weighted mean, so B draws cost one matrix product instead of B copies) and the percentile interval.
Used by the downstream tasks' paired intervals (``downstream.statistics``) and by the recalibration report's
(``analysis.recalibration_intervals``)."""

from __future__ import annotations

import numpy as np

LEVEL = 0.95


def bootstrap_weights(n: int, draws: int, rng: np.random.Generator) -> np.ndarray:
    """(draws, n) multinomial counts: how often each of n units enters a resample of size n."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=draws).astype(np.float64)


def percentile_interval(draws: np.ndarray, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """The (1 - level) / 2 and (1 + level) / 2 quantiles over the first axis; an infinite draw (a peak beyond the
    data) is taken as it is, without interpolating across it."""
    tail = (1 - level) / 2
    return (np.quantile(draws, tail, axis=0, method="inverted_cdf"),
            np.quantile(draws, 1 - tail, axis=0, method="inverted_cdf"))
