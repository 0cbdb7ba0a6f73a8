"""Rank-wise sub-k and top-k ECE (Definitions 6 and 7): one binary calibration problem per event, label 1 where the
true ranking contains the event, probability = the predicted marginal of the event; the per-event ECEs
(:func:`~rewarduq_exp.metrics.ranking.binary_ece.binary_ece`) are combined by
:func:`~rewarduq_exp.metrics.ranking.binary_ece.aggregate_ece`.

``also`` adds the same binned quantity under further discrepancies, from the same bins. Appendix E proposes the
Kullback-Leibler and the symmetric Jeffreys divergence "where p denotes the empirical frequency and q the predicted
distribution" in place of ECE's absolute difference, but its equations were lost in the text. The reading taken
here: per event, the binned ECE sum_b (n_b / n) d(p_b, q_b) with d the Bernoulli divergence between the bin's label
frequency p_b and mean prediction q_b, i.e. ``binary_ece(..., discrepancy="kl")`` = KL(p_b || q_b) (empirical
first, as the sentence orders them: it is this direction that "detects miscalibration even when the model
underestimates the true probability mass", growing like p_b log(p_b / q_b) as q_b -> 0, where |p_b - q_b| stays
below p_b) and ``discrepancy="jeff"`` = the reference code's Jeffreys form 1 - exp(-(KL(p~||q) + KL(q||p~))) with
the smoothed frequency p~ = (sum of labels + 1/2) / (n_b + 1). Why these: the bins are the ECE's own, so the three
numbers differ only in d and can be read side by side; and they are the forms the authors' code computed for the
figure (Figure 5) that motivates them, so they can be compared with it. Neither is a calibration error in ECE's
units: KL is unbounded (q_b -> 0 with p_b > 0 costs about 27.6 p_b at eps = 1e-12), Jeffreys lies in [0, 1) and is
> 0 even for a perfectly calibrated bin (the smoothing: to first order (1/2 - q)^2 / ((n_b + 1)^2 q (1 - q)), large
for small bins of probabilities near 0 or 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rewarduq_exp.core.checks import check_choice
from rewarduq_exp.metrics.ranking.binary_ece import AGGREGATES, aggregate_ece, binary_ece
from rewarduq_exp.metrics.ranking.events import (
    _CHUNK_ELEMENTS,
    _MAX_EVENTS_PER_CALL,
    Marginals,
    _marginals,
    check_true_ranks,
    event_labels,
    sub_k_events,
    top_k_events,
)


@dataclass(frozen=True, eq=False)
class RankwiseECE:
    """A rank-wise sub-k / top-k result: the aggregated ECE and the per-event details (for figures)."""

    ece: float
    events: np.ndarray  # (E, k) ordered tuples, 0-based items
    event_ece: np.ndarray  # (E,)
    prevalence: np.ndarray  # (E,) mean label
    pred_mass: np.ndarray  # (E,) mean predicted probability
    also: dict[str, float] = field(default_factory=dict)  # the aggregate under each further discrepancy
    event_also: dict[str, np.ndarray] = field(default_factory=dict)  # per event (E,)


def rankwise_ece(kind: str, true_ranks, marginals: Marginals, tuples, *, n_bins: int = 10,
                 discrepancy: str = "abs", spacing: str = "linear", aggregate: str = "uniform",
                 also=()) -> RankwiseECE:
    """Rank-wise ECE over the given events (``kind`` "sub" or "top"): one :func:`binary_ece` per event, combined
    by :func:`aggregate_ece`. Events are processed in chunks so that n x chunk arrays stay small. ``also``: further
    discrepancies (e.g. ``("kl", "jeff")``) from the same bins, aggregated the same way (see the module)."""
    r = check_true_ranks(true_ranks)
    tuples = np.asarray(tuples, dtype=np.int64)
    n = len(r)
    # most_confident is accepted for sub-k as well (the reference raises there): one metric.ranking.aggregate value
    # applies to the whole sub-k / top-k sweep, and "the 5 events with the most predicted mass" is as well defined
    # for sub-k events as for prefixes, so refusing it would only make such a run fail half-way.
    check_choice("aggregate", aggregate, AGGREGATES)
    step = max(1, min(_MAX_EVENTS_PER_CALL, _CHUNK_ELEMENTS // n))
    parts = []
    for lo in range(0, len(tuples), step):
        t = tuples[lo: lo + step]
        parts.append(binary_ece(event_labels(kind, r, t), _marginals(marginals, t, n), n_bins=n_bins,
                                discrepancy=discrepancy, spacing=spacing, also=also))
    if parts:
        ece = np.concatenate([p.ece for p in parts])
        prev = np.concatenate([p.prevalence for p in parts])
        mass = np.concatenate([p.pred_mass for p in parts])
        event_also = {name: np.concatenate([p.also[name] for p in parts]) for name in also}
    else:
        ece = prev = mass = np.zeros(0)
        event_also = {name: np.zeros(0) for name in also}
    return RankwiseECE(ece=aggregate_ece(ece, prev, mass, aggregate), events=tuples, event_ece=ece,
                       prevalence=prev, pred_mass=mass,
                       also={name: aggregate_ece(v, prev, mass, aggregate) for name, v in event_also.items()},
                       event_also=event_also)


def rankwise_sub_k_ece(true_ranks, marginals: Marginals, k: int, *, events: str = "auto", subsets=None,
                       n_bins: int = 10, discrepancy: str = "abs", spacing: str = "linear",
                       aggregate: str = "uniform") -> RankwiseECE:
    """Rank-wise sub-k ECE (Definition 6): events from :func:`sub_k_events`, marginals = P(a1 > ... > ak | x).

    With all P(m, k) events both (i, j) and (j, i) count for k = 2 (their ECEs are equal under ``abs``), and the
    uniform mean is dominated by rare events for large k, as in the paper's figures.
    """
    tuples = sub_k_events(true_ranks, k, events=events, subsets=subsets)
    return rankwise_ece("sub", true_ranks, marginals, tuples, n_bins=n_bins, discrepancy=discrepancy,
                        spacing=spacing, aggregate=aggregate)


def rankwise_top_k_ece(true_ranks, marginals: Marginals, k: int, *, events: str = "auto", n_bins: int = 10,
                       discrepancy: str = "abs", spacing: str = "linear", aggregate: str = "uniform") -> RankwiseECE:
    """Rank-wise top-k ECE (Definition 7): events from :func:`top_k_events`, marginals = P(first k = a1..ak | x).

    Top-(m-1) is the same event as the full ranking, so top-(m-1) = top-m = sub-m.
    """
    tuples = top_k_events(true_ranks, k, events=events)
    return rankwise_ece("top", true_ranks, marginals, tuples, n_bins=n_bins, discrepancy=discrepancy,
                        spacing=spacing, aggregate=aggregate)
