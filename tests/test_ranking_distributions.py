"""Closed-form marginals of the ranking distributions against brute-force enumeration (ExplicitDistribution over all
m! rankings), for every m <= 6 and every k; Monte-Carlo sub-k of Mallows against the exact value; relabelling
invariance; top-k events summing to one; numerical extremes; and the pairwise-only distribution's limits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.ranking.categorical import RankCategorical
from rewarduq_exp.ranking.distribution import ExplicitDistribution
from rewarduq_exp.ranking.mallows import Mallows, expected_distance
from rewarduq_exp.ranking.pairwise import PairwiseOnly
from rewarduq_exp.ranking.permutations import (
    all_orderings,
    kendall_distance,
    ordered_tuples,
    orderings_to_ranks,
)
from rewarduq_exp.ranking.plackett_luce import PlackettLuce

SIZES = [2, 3, 4, 5, 6]


def brute_pl(log_weights: np.ndarray, orderings: np.ndarray) -> np.ndarray:
    """PL probabilities of every listed ordering by the textbook product, one Python loop per ranking."""
    w = np.exp(log_weights)
    out = np.empty((len(w), len(orderings)))
    for r, o in enumerate(orderings):
        p = np.ones(len(w))
        for t in range(len(o)):
            p *= w[:, o[t]] / w[:, o[t:]].sum(axis=1)
        out[:, r] = p
    return out


def brute_mallows(center: np.ndarray, theta: float, orderings: np.ndarray) -> np.ndarray:
    d = kendall_distance(orderings, center[None])
    p = np.exp(-theta * d)
    return p / p.sum()


def assert_same_marginals(dist, reference: ExplicitDistribution, sub_ks, top_ks, atol=1e-12):
    m = reference.m
    for k in sub_ks:
        ev = ordered_tuples(m, k)
        np.testing.assert_allclose(dist.sub_k(ev), reference.sub_k(ev), rtol=0, atol=atol, err_msg=f"sub-{k}")
    for k in top_ks:
        ev = ordered_tuples(m, k)
        np.testing.assert_allclose(dist.top_k(ev), reference.top_k(ev), rtol=0, atol=atol, err_msg=f"top-{k}")
    np.testing.assert_allclose(dist.pairwise(), reference.pairwise(), rtol=0, atol=atol)


# ------------------------------------------------------------------------------------------------ Plackett-Luce
@pytest.mark.parametrize("m", SIZES)
def test_plackett_luce_matches_enumeration(m):
    rng = np.random.default_rng(m)
    lw = rng.normal(scale=1.5, size=(4, m))
    orderings = all_orderings(m)
    ref = ExplicitDistribution(orderings, brute_pl(lw, orderings))
    dist = PlackettLuce(lw)
    assert_same_marginals(dist, ref, range(1, m + 1), range(1, m + 1))
    np.testing.assert_allclose(np.exp(dist.log_prob(orderings)), ref.probs, atol=1e-12)
    np.testing.assert_array_equal(dist.mode_ranks(), ref.mode_ranks())


def test_plackett_luce_relabelling_and_scale_invariance():
    rng = np.random.default_rng(0)
    m = 6
    lw = rng.normal(size=(3, m))
    perm = rng.permutation(m)  # new item id of old item a is perm[a]
    relabelled = np.empty_like(lw)
    relabelled[:, perm] = lw
    a, b = PlackettLuce(lw), PlackettLuce(relabelled + 17.0)  # shifting all log-weights changes nothing
    for k in (2, 3, 4):
        ev = ordered_tuples(m, k)
        np.testing.assert_allclose(a.sub_k(ev), b.sub_k(perm[ev]), atol=1e-12)
        np.testing.assert_allclose(a.top_k(ev), b.top_k(perm[ev]), atol=1e-12)


@pytest.mark.parametrize("m", [3, 6, 9])
def test_top_k_events_sum_to_one(m):
    rng = np.random.default_rng(1)
    dists = [PlackettLuce(rng.normal(scale=2.0, size=(3, m))),
             Mallows(rng.permutation(m), 0.7, n=3)]
    obs = np.unique(np.array([rng.permutation(m) for _ in range(12)]), axis=0)
    dists.append(RankCategorical.from_unseen_mass(obs, rng.normal(size=(3, len(obs))), 0.1))
    for dist in dists:
        for k in range(1, min(m, 4) + 1):
            total = dist.top_k(ordered_tuples(m, k)).sum(axis=1)
            np.testing.assert_allclose(total, 1.0, atol=1e-10, err_msg=f"{type(dist).__name__} top-{k}")
        pw = dist.pairwise()
        off = ~np.eye(m, dtype=bool)
        np.testing.assert_allclose((pw + pw.transpose(0, 2, 1))[:, off], 1.0, atol=1e-10)


def test_plackett_luce_extreme_weights_stay_finite():
    m = 8
    lw = np.array([[0.0, -700.0, -1400.0, -2100.0, 5.0, -40.0, -900.0, 30.0],
                   [800.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -800.0]])
    dist = PlackettLuce(lw)
    for k in (1, 2, 3):
        ev = ordered_tuples(m, k)
        top, sub = dist.top_k(ev), dist.sub_k(ev)
        assert np.isfinite(top).all() and np.isfinite(sub).all()
        assert (top >= 0).all() and (top <= 1).all() and (sub >= 0).all() and (sub <= 1 + 1e-15).all()
        np.testing.assert_allclose(top.sum(axis=1), 1.0, atol=1e-12)
    # The second sample: item 0 is first almost surely; then the six middle items are exchangeable
    np.testing.assert_allclose(dist.top_k(np.array([[0, 1]]))[1], [1 / 6], rtol=1e-12)
    # after the two dominant items of sample 0 (7 then 4) only ~1e-13 of the weight is left: 1 - S would keep just
    # three digits of it; the exact log-sum-exp over the other items keeps the third factor exact
    p = dist.top_k(np.array([[7, 4, 0]]))[0, 0]
    e = math.exp
    exact = 1 / (1 + e(-25) + e(-30) + e(-70)) / (1 + e(-5) + e(-45)) / (1 + e(-40))
    np.testing.assert_allclose(p, exact, rtol=1e-13)
    p5 = dist.top_k(np.array([[7, 4, 0, 5]]))[0, 0]
    np.testing.assert_allclose(p5, exact / (1 + e(-660)), rtol=1e-13)
    # sub-k among items ~700 below the best: their ratios are still order one (linear space would give 0/0)
    np.testing.assert_allclose(dist.sub_k(np.array([[7, 1, 6], [1, 6, 2]]))[0],
                               [1 / (1 + e(-200)), 1 / (1 + e(-200) + e(-700))], rtol=1e-13)


def test_plackett_luce_gumbel_sampling_matches_probabilities():
    lw = np.log(np.array([[3.0, 2.0, 1.0]]))
    dist = PlackettLuce(lw)
    draws = dist.sample(np.random.default_rng(0), 60000)[0]
    orderings = all_orderings(3)
    freq = (draws[:, None, :] == orderings[None]).all(-1).mean(0)
    expected = np.array([1 / 3, 1 / 6, 1 / 4, 1 / 12, 1 / 10, 1 / 15])  # notes: PL [3,2,1], lexicographic order
    np.testing.assert_allclose(np.exp(dist.log_prob(orderings))[0], expected, atol=1e-12)
    assert np.abs(freq - expected).max() < 0.01


# ------------------------------------------------------------------------------------------------ Mallows
@pytest.mark.parametrize("m", SIZES)
@pytest.mark.parametrize("theta", [0.0, 0.35, 2.0, -0.5, 1e-4])
def test_mallows_matches_enumeration(m, theta):
    rng = np.random.default_rng(10 * m)
    center = rng.permutation(m)
    orderings = all_orderings(m)
    ref = ExplicitDistribution(orderings, np.repeat(brute_mallows(center, theta, orderings)[None], 2, axis=0))
    dist = Mallows(center, theta, n=2)
    assert_same_marginals(dist, ref, range(1, m + 1), range(1, m + 1), atol=1e-11)
    np.testing.assert_array_equal(dist.mode_ranks()[0], orderings_to_ranks(center[None])[0])
    assert dist.last_standard_error is not None and (dist.last_standard_error == 0).all()


def test_mallows_expected_distance_and_relabelling():
    m, theta = 6, 0.8
    orderings = all_orderings(m)
    center = np.array([3, 1, 5, 0, 2, 4])
    p = brute_mallows(center, theta, orderings)
    assert expected_distance(theta, m) == pytest.approx((p * kendall_distance(orderings, center[None])).sum())
    perm = np.array([2, 0, 1, 5, 3, 4])
    a, b = Mallows(center, theta), Mallows(perm[center], theta)
    ev = ordered_tuples(m, 3)
    np.testing.assert_allclose(a.sub_k(ev), b.sub_k(perm[ev]), atol=1e-12)
    np.testing.assert_allclose(a.top_k(ev), b.top_k(perm[ev]), atol=1e-12)


def test_mallows_monte_carlo_sub_k_is_within_its_standard_error():
    """m = 8 is past exact_max_m: sub-3/sub-4 are estimates; compare with enumeration of all 8! rankings."""
    m, theta = 8, 0.4
    center = np.array([2, 7, 0, 5, 1, 6, 3, 4])
    orderings = all_orderings(m)
    ref = ExplicitDistribution(orderings, brute_mallows(center, theta, orderings)[None])
    dist = Mallows(center, theta, n=1, mc_samples=20000, mc_seed=3)
    rng = np.random.default_rng(0)
    for k in (3, 4):
        ev = ordered_tuples(m, k)[rng.choice(math.perm(m, k), 60, replace=False)]
        p, se = dist.sub_k_estimate(ev)
        exact = ref.sub_k(ev)[0]
        assert (se > 0).any()
        z = np.abs(p - exact) / np.maximum(se, 1e-4)
        assert z.max() < 4.5, z.max()
        np.testing.assert_array_equal(dist.sub_k(ev)[0], p)  # same seeded samples on every call
        np.testing.assert_array_equal(dist.last_standard_error, se)
    # exact pieces stay exact past m = 7: pairwise, top-k and full rankings
    np.testing.assert_allclose(dist.sub_k(ordered_tuples(m, 2)), ref.sub_k(ordered_tuples(m, 2)), atol=1e-12)
    np.testing.assert_allclose(dist.top_k(ordered_tuples(m, 3)), ref.top_k(ordered_tuples(m, 3)), atol=1e-12)
    full = orderings[rng.choice(len(orderings), 50)]
    np.testing.assert_allclose(dist.sub_k(full), ref.sub_k(full), atol=1e-15)


def test_mallows_sampling_is_exact():
    m, theta = 4, 0.6
    center = np.array([1, 3, 0, 2])
    orderings = all_orderings(m)
    dist = Mallows(center, theta)
    draws = dist.sample(np.random.default_rng(5), 100000)
    freq = (draws[:, None, :] == orderings[None]).all(-1).mean(0)
    expected = brute_mallows(center, theta, orderings)
    assert np.abs(freq - expected).max() < 0.006
    assert (np.sort(dist.sample(np.random.default_rng(0), 50), axis=1) == np.arange(m)).all()


def test_mallows_large_m_without_enumeration():
    m = 26
    dist = Mallows(np.arange(m)[::-1], 0.05, n=3, mc_samples=2000)
    top1 = dist.top_k(ordered_tuples(m, 1))
    np.testing.assert_allclose(top1.sum(axis=1), 1.0, atol=1e-12)
    assert top1[0, m - 1] == top1[0].max()
    p = dist.sub_k(np.array([[25, 24, 23], [0, 1, 2]]))
    assert p.shape == (3, 2) and p[0, 0] > p[0, 1]


# ------------------------------------------------------------------------------------------------ RankCategorical
@pytest.mark.parametrize("m", SIZES)
def test_rank_categorical_matches_enumeration(m):
    rng = np.random.default_rng(100 + m)
    orderings = all_orderings(m)
    c = max(1, len(orderings) // 3)
    seen_idx = np.sort(rng.choice(len(orderings), c, replace=False))
    logits = rng.normal(size=(3, c))
    rest = np.array([-1.0, 0.5, -np.inf])
    dist = RankCategorical(orderings[seen_idx], logits, rest)
    # brute force: seen rankings by softmax, unseen share exp(rest) uniformly
    z = np.concatenate([logits, rest[:, None]], axis=1)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    probs = np.zeros((3, len(orderings)))
    n_unseen = len(orderings) - c
    if n_unseen:
        probs[:] = (p[:, -1] / n_unseen)[:, None]
    probs[:, seen_idx] = p[:, :c]
    ref = ExplicitDistribution(orderings, probs)
    assert_same_marginals(dist, ref, range(1, m + 1), range(1, m + 1))
    np.testing.assert_array_equal(dist.mode_ranks(), orderings_to_ranks(orderings[seen_idx])[logits.argmax(1)])


def test_rank_categorical_all_rankings_observed_has_no_remainder():
    orderings = all_orderings(3)
    dist = RankCategorical.from_unseen_mass(orderings, np.zeros((1, 6)), 0.3)
    assert dist.unseen_mass[0] == 0.0
    np.testing.assert_allclose(dist.top_k(ordered_tuples(3, 1)), 1 / 3)


def test_rank_categorical_26_items_without_enumeration():
    """letter-sized: m = 26, m! ~ 4e26 rankings; the unseen mass is a fixed total, not a per-ranking logit."""
    m = 26
    rng = np.random.default_rng(0)
    obs = np.unique(np.array([rng.permutation(m) for _ in range(300)]), axis=0)
    dist = RankCategorical.from_unseen_mass(obs, rng.normal(size=(2, len(obs))), [0.25, 0.0])
    np.testing.assert_allclose(dist.seen_probs.sum(axis=1), [0.75, 1.0])
    assert 0 < dist.unseen_probability[0] < 1e-26
    for k in (1, 2):
        np.testing.assert_allclose(dist.top_k(ordered_tuples(m, k)).sum(axis=1), 1.0, atol=1e-12)
    # a pair: unseen mass contributes exactly half of itself to each direction (m!/2 rankings, minus observed ones)
    pw = dist.pairwise()
    seen_part = dist.seen_probs @ (orderings_to_ranks(obs)[:, 0] < orderings_to_ranks(obs)[:, 1])
    np.testing.assert_allclose(pw[:, 0, 1], seen_part + dist.unseen_mass * 0.5, atol=1e-12)
    # the top-3 event of an observed prefix gets that ranking's mass plus (23! - 1) unseen rankings' mass
    ev = obs[:1, :3]
    expected = dist.seen_probs[:, (obs[:, :3] == ev).all(1)].sum(1) + dist.unseen_probability * (
        math.factorial(23) - int((obs[:, :3] == ev).all(1).sum()))
    np.testing.assert_allclose(dist.top_k(ev)[:, 0], expected, rtol=1e-12)


def test_rank_categorical_rejects_bad_input():
    with pytest.raises(ValueError):
        RankCategorical(np.array([[0, 1, 2], [0, 1, 2]]), np.zeros((1, 2)))
    with pytest.raises(ValueError):
        RankCategorical.from_unseen_mass(np.array([[0, 1, 2]]), np.zeros((1, 1)), 1.0)


# ------------------------------------------------------------------------------------------------ PairwiseOnly
def test_pairwise_only_reads_the_matrix_and_refuses_the_rest():
    P = np.array([[[0, .8, .6], [.2, 0, .7], [.4, .3, 0]]])
    dist = PairwiseOnly(P)
    np.testing.assert_allclose(dist.sub_k(np.array([[0, 1], [2, 1], [1, 0]])), [[.8, .3, .2]])
    np.testing.assert_allclose(dist.sub_k(np.array([[1]])), [[1.0]])
    np.testing.assert_allclose(dist.pairwise(), P)
    np.testing.assert_array_equal(dist.mode_ranks(), [[1, 2, 3]])  # Borda: 1.4, 0.9, 0.7
    with pytest.raises(UserError, match="pairwise"):
        dist.sub_k(ordered_tuples(3, 3))
    with pytest.raises(UserError, match="top-k"):
        dist.top_k(ordered_tuples(3, 1))
    with pytest.raises(ValueError, match="complementary"):
        PairwiseOnly(np.array([[[0, .8], [.8, 0]]]))


def test_pairwise_only_agrees_with_a_distribution_pairwise():
    dist = PlackettLuce(np.random.default_rng(2).normal(size=(5, 5)))
    rpc = PairwiseOnly(dist.pairwise())
    ev = ordered_tuples(5, 2)
    np.testing.assert_allclose(rpc.sub_k(ev), dist.sub_k(ev), atol=1e-12)
    np.testing.assert_array_equal(rpc.mode_ranks(), dist.mode_ranks())  # Borda of a PL pairwise = weight order
