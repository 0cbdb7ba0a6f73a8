"""The order of events and classes (rewarduq_exp.metrics.ranking.events, "Order of events and classes"): ours is
lexicographic; the reference code's is itertools order for m < 8 (equal to ours) and the iteration order of a Python
set of 1-based tuples from m = 8 on, where ``aggregate="most_confident"`` with tied masses and simplex binning of a
restricted problem can give other values (the m = 8 example of the docstring: 0.2000 here, 0.2308 there)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rewarduq_exp.metrics import ranking as rm
from rewarduq_exp.ranking.distribution import ExplicitDistribution
from rewarduq_exp.ranking.permutations import orderings_to_ranks, ranks_to_orderings

# The docstring's example: m = 8, the true best item of each of 13 samples.
EXAMPLE_BEST = [0, 0, 1, 1, 2, 3, 4, 4, 5, 5, 5, 6, 7]


def ordering(best: int, m: int = 8) -> list[int]:
    """The ranking with ``best`` first and the other items in ascending order."""
    return [best] + [i for i in range(m) if i != best]


def ranks_with_best(best: list[int], m: int = 8) -> np.ndarray:
    return orderings_to_ranks(np.array([ordering(b, m) for b in best]))


def set_order(rows) -> list[tuple[int, ...]]:
    """The reference's listing of observed events from m = 8 on: each row's tuple, 1-based, added to a Python set in
    row order, then the set iterated. Hashes of int tuples do not depend on PYTHONHASHSEED, so this order is fixed."""
    seen: set[tuple[int, ...]] = set()
    for row in rows:
        seen.add(tuple(int(i) + 1 for i in row))
    return [tuple(i - 1 for i in t) for t in seen]


def reference_events(true_ranks: np.ndarray, k: int) -> np.ndarray:
    """The sub-k or top-k events (0-based) in the order the reference code lists them: ``itertools.permutations``
    of the items below m = 8; from m = 8 on the observed top-k prefixes in set order (its most_confident exists for
    top-k only, so its observed sub-k order matters nowhere)."""
    m = true_ranks.shape[1]
    if m < 8:
        return np.array(list(itertools.permutations(range(m), k))).reshape(-1, k)
    return np.array(set_order(ranks_to_orderings(true_ranks)[:, :k]))


def reference_most_confident(event_ece, pred_mass) -> float:
    """The reference's most_confident: events sorted by normalised predicted mass, descending (Python's sort keeps
    the listed order of ties), the 5 first ECEs summed and divided by 5."""
    total = float(np.sum(pred_mass))
    rows = sorted(zip(event_ece, pred_mass), key=lambda r: r[1] / total, reverse=True)
    return sum(e for e, _ in rows[:5]) / 5.0


def the_example() -> tuple[np.ndarray, ExplicitDistribution]:
    ranks = ranks_with_best(EXAMPLE_BEST)
    rankings = np.array([ordering(0), ordering(1)])  # 0 > 1 > ... > 7 and 1 > 0 > 2 > ... > 7
    return ranks, ExplicitDistribution(rankings, np.full((len(ranks), 2), 0.5))


@pytest.mark.parametrize("m", range(2, 8))
def test_below_8_items_our_events_and_classes_are_the_reference_order(m):
    """Where the order matters (the events most_confident ranks, for every k; the classes of the 2- and 3-class
    problems that simplex binning accepts), ours equals the reference's itertools order for every m < 8."""
    ranks = ranks_with_best([i % m for i in range(2 * m)], m)
    for k in range(1, m):
        assert np.array_equal(rm.top_k_events(ranks, k), reference_events(ranks, k)), (m, k)
    for k in range(2, m + 1):
        assert np.array_equal(rm.sub_k_events(ranks, k), reference_events(ranks, k)), (m, k)

    def marginals(tuples):
        return np.zeros((len(ranks), len(tuples)))

    for q, subset in zip(rm.sub_k_full_rank_problems(ranks, marginals, rm._all_subsets(m, 2)),
                         itertools.combinations(range(m), 2)):
        assert [tuple(c) for c in q.classes] == list(itertools.permutations(subset, 2))
    if m <= 3:  # top-1 has m classes: binning takes it up to m = 3
        q = rm.top_k_full_rank_problem(ranks, marginals, 1)
        assert [tuple(c) for c in q.classes] == list(itertools.permutations(range(m), 1))


def test_the_set_order_is_fixed_whatever_the_hash_seed():
    """The emulated reference order is a property of the tuples, not of the process: two interpreters with other
    string-hash seeds list the example's set in the same order as this one."""
    code = ("import json, sys; s = set(); [s.add((b + 1,)) for b in json.loads(sys.argv[1])]; "
            "print(json.dumps([t[0] - 1 for t in s]))")
    ours = [t[0] for t in set_order([[b] for b in EXAMPLE_BEST])]
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code, json.dumps(EXAMPLE_BEST)], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        assert json.loads(out) == ours
    assert ours == [5, 1, 4, 7, 3, 0, 6, 2]  # the order the events docstring names


def test_most_confident_at_8_items_is_0_2_here_and_3_13_in_set_order():
    ranks, dist = the_example()
    ours = rm.rankwise_top_k_ece(ranks, dist.top_k, 1, aggregate="most_confident")
    # By hand: items 0 and 1 carry mass 1/2 and are best in 2 of 13 samples each (ECE 1/2 - 2/13); items 2..7 carry
    # no mass (ECE = how often each is best: 1, 1, 2, 3, 1, 1 of 13) and tie; lexicographic order keeps 2, 3, 4.
    assert list(ours.events.ravel()) == list(range(8))
    assert ours.event_ece == pytest.approx([1 / 2 - 2 / 13] * 2 + [1 / 13, 1 / 13, 2 / 13, 3 / 13, 1 / 13, 1 / 13])
    assert ours.ece == pytest.approx((2 * (1 / 2 - 2 / 13) + 1 / 13 + 1 / 13 + 2 / 13) / 5)
    assert ours.ece == pytest.approx(0.2)
    evaluation = rm.ranking_evaluation(dist, ranks, ks_sub=[], ks_top=[1], aggregate="most_confident",
                                       full_rank=False)
    assert evaluation.metrics["rank/top_1/ece"] == pytest.approx(0.2)

    # The same events in the reference's set order: ties now keep items 5, 4, 7.
    ref_events = reference_events(ranks, 1)
    assert sorted(ref_events.ravel()) == list(range(8)) and list(ref_events.ravel()) != list(range(8))
    ref = rm.rankwise_top_k_ece(ranks, dist.top_k, 1, events="observed", aggregate="most_confident")
    per_event = dict(zip(ref.events.ravel(), zip(ref.event_ece, ref.pred_mass)))
    ece, mass = zip(*(per_event[e] for e in ref_events.ravel()))
    assert reference_most_confident(ece, mass) == pytest.approx((1 - 4 / 13 + 3 / 13 + 2 / 13 + 1 / 13) / 5)
    assert round(reference_most_confident(ece, mass), 4) == 0.2308
    # ... and our own aggregation, handed the events in that order, agrees: only the order differs.
    assert rm.rankwise_ece("top", ranks, dist.top_k, ref_events, aggregate="most_confident").ece == \
        pytest.approx(3 / 13)


def test_simplex_binning_of_a_restricted_problem_at_8_items_depends_on_the_class_order():
    """restrict=top_10 at m = 8: the top-1 classes are the observed best items 0, 1, 5 (no "other" class), binned on
    the first two. The reference lists them in set order (5, 0, 1), which bins samples 3 and 4 apart."""
    best = [0, 1, 5, 1]
    ranks = ranks_with_best(best)
    probs = np.array([[.8, .1, .1], [.1, .8, .1], [.05, .41, .54], [.05, .49, .46]])
    dist = ExplicitDistribution(np.array([ordering(b) for b in (0, 1, 5)]), probs)
    evaluation = rm.ranking_evaluation(dist, ranks, ks_sub=[], ks_top=[1], restrict="top_10",
                                       full_rank_estimator="binning")
    # By hand: samples 1 and 2 alone (L1 errors 0.4 each), samples 3 and 4 share the cell p_0 in [0, .1),
    # p_1 in [.4, .5) with mean (.05, .45, .5) against labels 5 and 1 (mean one-hot (0, .5, .5)): 0.1 over 2 samples.
    assert evaluation.metrics["rank/full/top_1/ece"] == pytest.approx((0.4 + 0.4 + 2 * 0.1) / 4)
    q = rm.top_k_full_rank_problem(ranks, dist.top_k, 1, class_ranks=ranks, other_class=False)
    ref_classes = reference_events(ranks, 1).ravel()
    assert list(q.classes.ravel()) == [0, 1, 5] and list(ref_classes) == [5, 0, 1]
    perm = [list(q.classes.ravel()).index(c) for c in ref_classes]
    ref = rm.simplex_binning_ece(q.probs[:, perm], np.argsort(perm)[q.labels])
    # Set order: every sample alone; samples 3 and 4 err by .05 + .41 + .46 and .05 + .51 + .46.
    assert ref == pytest.approx((0.4 + 0.4 + 0.92 + 1.02) / 4)
