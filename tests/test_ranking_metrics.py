"""Ranking metrics (rewarduq_exp.metrics.ranking): the reference code's values, the reference test cases,
independent straightforward re-implementations, invariances and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_ranking_kernel import dense_kernel_errors

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics import ranking as rm
from rewarduq_exp.metrics.ranking import ranking_evaluation, ranking_metrics
from rewarduq_exp.ranking.distribution import ExplicitDistribution, RankingDistribution
from rewarduq_exp.ranking.permutations import all_orderings, ordered_tuples, orderings_to_ranks

FIXTURE = Path(__file__).parent / "fixtures" / "ranking_reference.json"
O3 = all_orderings(3)  # 012, 021, 102, 120, 201, 210: the reference's lexicographic order of permutations of 1..3
S6 = orderings_to_ranks(O3)  # notes section 8: the six permutations once each, in that order
AGGREGATES = ("uniform", "prevalence", "pred_mass")


def ranks_of(orderings_1based) -> np.ndarray:
    return orderings_to_ranks(np.asarray(orderings_1based) - 1)


def constant(probs, n: int = 6, orderings=O3) -> ExplicitDistribution:
    return ExplicitDistribution(orderings, np.tile(np.asarray(probs, dtype=float), (n, 1)))


DIST_A = constant([1 / 3, 1 / 12, 1 / 12, 1 / 12, 1 / 12, 1 / 3])
DIST_B = constant([1 / 3, 0, 0, 0, 0, 2 / 3])
DIST_C = constant([1 / 3, 0, 0, 1 / 3, 0, 1 / 3])  # 123, 231, 321


def pl_explicit(logw: np.ndarray) -> ExplicitDistribution:
    """Exact Plackett-Luce distribution per sample by enumerating all m! orderings (small m)."""
    orderings = all_orderings(logw.shape[1])
    lw = logw[:, orderings]  # (n, R, m): log weight of the item at each position
    tail = np.logaddexp.accumulate(lw[..., ::-1], axis=-1)[..., ::-1]  # log sum of weights from position t on
    return ExplicitDistribution(orderings, np.exp((lw - tail).sum(axis=-1)))


class ClosedFormPL(RankingDistribution):
    """Plackett-Luce with closed-form marginals (Luce's choice axiom), for item counts too large to enumerate."""

    def __init__(self, logw: np.ndarray):
        self.w = np.exp(logw - logw.max(axis=1, keepdims=True))
        self.n, self.m = self.w.shape
        self.max_sub_k = self.max_top_k = self.m

    def sub_k(self, tuples):
        w = self.w[:, np.asarray(tuples)]  # (n, E, k)
        return np.prod(w / np.cumsum(w[..., ::-1], axis=-1)[..., ::-1], axis=-1)

    def top_k(self, tuples):
        w = self.w[:, np.asarray(tuples)]
        before = np.cumsum(w, axis=-1) - w
        return np.prod(w / (self.w.sum(axis=1)[:, None, None] - before), axis=-1)

    def mode_ranks(self):
        return orderings_to_ranks(np.argsort(-self.w, axis=1, kind="stable"))


class PairsOnly(RankingDistribution):
    """An RPC-like distribution: pairwise marginals only (max_sub_k = 2, max_top_k = 0)."""

    def __init__(self, inner: RankingDistribution):
        self.inner, self.n, self.m = inner, inner.n, inner.m
        self.max_sub_k, self.max_top_k = 2, 0

    def sub_k(self, tuples):
        assert np.asarray(tuples).shape[1] == 2
        return self.inner.sub_k(tuples)

    def top_k(self, tuples):
        raise AssertionError("no top-k marginals")

    def mode_ranks(self):
        return self.inner.mode_ranks()


# ---------------------------------------------------------------------------------------------------------------
# The reference code's own values (fixture made by tests/fixtures/make_ranking_reference.py)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    data = json.loads(FIXTURE.read_text())
    orderings = np.asarray(data["orderings"]) - 1
    assert (orderings == O3).all()
    n = data["n"]
    ranks = {key: orderings_to_ranks(O3[np.frombuffer(s.encode(), dtype=np.uint8) - ord("0")])
             for key, s in data["labels"].items()}
    assert all(len(r) == n for r in ranks.values())
    lam = (np.arange(n) + 0.5) / n
    preds = {key: np.tile(np.asarray(p), (n, 1)) for key, p in data["predictions"].items()}
    preds["mix"] = lam[:, None] * preds["skewed"] + (1 - lam[:, None]) * preds["uniform"]
    return data, ranks, {key: ExplicitDistribution(O3, p) for key, p in preds.items()}, preds


def test_reference_predictions_are_the_papers_synthetic_distributions(reference):
    data, ranks, _, _ = reference
    pl = data["predictions"]["pl"]  # PL with weights (3, 2, 1) over 123, 132, 213, 231, 312, 321
    expected = [3 / 6 * 2 / 3, 3 / 6 * 1 / 3, 2 / 6 * 3 / 4, 2 / 6 * 1 / 4, 1 / 6 * 3 / 5, 1 / 6 * 2 / 5]
    assert np.allclose(pl, expected, atol=1e-15) and np.allclose(pl, [1 / 3, 1 / 6, 1 / 4, 1 / 12, 1 / 10, 1 / 15])
    # The sampled labels follow their generating distributions (10,000 draws each).
    for key, probs in (("equal", [1 / 6] * 6), ("skewed", data["predictions"]["skewed"]), ("pl", pl)):
        freq = np.bincount((ranks[key] == orderings_to_ranks(O3)[:, None]).all(-1).argmax(0), minlength=6) / 1e4
        assert np.abs(freq - probs).max() < 0.02


def test_rankwise_ece_reproduces_reference_code(reference):
    """All 360 rank-wise cases (3 label sets x 4 predictions x sub-2/3, top-1/2/3 x abs/jeff/kl x linear/log) and
    their 3 weightings: per event and total to 1e-9 of the reference run at double precision, and to 1e-6 of the
    unmodified (float32) reference run."""
    data, ranks, dists, _ = reference
    checked = 0
    for case in data["rankwise"]:
        dist, kind = dists[case["prediction"]], case["kind"]
        fn = rm.rankwise_sub_k_ece if kind == "sub" else rm.rankwise_top_k_ece
        res = fn(ranks[case["labels"]], dist.sub_k if kind == "sub" else dist.top_k, case["k"],
                 discrepancy=case["discrepancy"], spacing=case["spacing"])
        assert (res.events == np.asarray(case["events"]) - 1).all()
        np.testing.assert_allclose(res.event_ece, case["event_ece"], rtol=0, atol=1e-9)
        for agg in AGGREGATES:
            total = rm.aggregate_ece(res.event_ece, res.prevalence, res.pred_mass, agg)
            assert total == pytest.approx(case["ece"][agg], abs=1e-9), (case["labels"], case["prediction"], agg)
            if "ece_float32" in case:
                assert total == pytest.approx(case["ece_float32"][agg], abs=1e-6)
        checked += 1
    assert checked == 360
    # The weighting is also reachable directly.
    case = next(c for c in data["rankwise"] if c["prediction"] == "mix" and c["kind"] == "top" and c["k"] == 1
                and c["discrepancy"] == "jeff" and c["spacing"] == "linear")
    for agg in AGGREGATES:
        res = rm.rankwise_top_k_ece(ranks[case["labels"]], dists["mix"].top_k, 1, discrepancy="jeff",
                                    aggregate=agg)
        assert res.ece == pytest.approx(case["ece"][agg], abs=1e-9)


def test_full_rank_kernel_reproduces_reference_code(reference):
    """Full-rank sub-2/3 and top-1/2 kernel ECE (h=1, p=1 and h=0.2, p=2) on the first 1000 samples: to 1e-9 of the
    double-precision reference run, 1e-5 of the float32 one."""
    data, ranks, _, preds = reference
    kn = data["kernel_n"]
    for case in data["kernel"]:
        dist = ExplicitDistribution(O3, preds[case["prediction"]][:kn])
        r = ranks[case["labels"]][:kn]
        opts = dict(h=case["h"], p=case["p"])
        if case["kind"] == "sub":
            value = rm.full_rank_sub_k_ece(r, dist.sub_k, case["k"], **opts).ece
        else:
            value = rm.full_rank_top_k_ece(r, dist.top_k, case["k"], **opts).ece
        assert value == pytest.approx(case["ece"], abs=1e-9), case
        assert value == pytest.approx(case["ece_float32"], abs=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Straightforward re-implementations of the definitions (notes 2.2, 2.6)
# ---------------------------------------------------------------------------------------------------------------


def loop_binary_ece(y, q, n_bins, discrepancy, spacing):
    """One problem, bin by bin, written from the definition."""
    eps = 1e-12
    if spacing == "linear":
        edges = [b / n_bins for b in range(n_bins + 1)]
    else:
        edges = [0.0] + [10 ** (-12 + 12 * b / n_bins) for b in range(1, n_bins)] + [1.0]
    bins = [min(max(sum(e <= v for e in edges) - 1, 0), n_bins - 1) for v in q]
    total = 0.0
    for b in range(n_bins):
        idx = [i for i, bi in enumerate(bins) if bi == b]
        if not idx:
            continue
        freq = sum(y[i] for i in idx) / len(idx)
        conf = sum(q[i] for i in idx) / len(idx)
        if discrepancy == "abs":
            d = abs(freq - conf)
        else:
            def kl(a, c):
                return a * math.log(a / c) + (1 - a) * math.log((1 - a) / (1 - c))
            if discrepancy == "kl":
                d = kl(min(max(freq, eps), 1 - eps), min(max(conf, eps), 1 - eps))
            else:
                ps = (sum(y[i] for i in idx) + 0.5) / (len(idx) + 1)
                c = min(max(conf, eps), 1 - eps)
                d = 1 - math.exp(-(kl(ps, c) + kl(c, ps)))
        total += len(idx) / len(y) * d
    return total


@pytest.mark.parametrize("discrepancy", ["abs", "jeff", "kl"])
@pytest.mark.parametrize("spacing", ["linear", "log"])
def test_binary_ece_matches_loop_definition(discrepancy, spacing):
    rng = np.random.default_rng(1)
    n, n_events = 200, 6
    q = rng.random((n, n_events)) ** np.array([1, 2, 4, 8, 0.5, 1])  # some events crowd the low bins
    q[:6, 0] = [0.0, 0.5, 1.0, 0.7, 0.1, 0.3]  # values on edges: left-closed bins [0.7, 0.8) etc.
    y = (rng.random((n, n_events)) < q ** 1.3).astype(float)
    for n_bins in (4, 10):
        res = rm.binary_ece(y, q, n_bins=n_bins, discrepancy=discrepancy, spacing=spacing)
        expected = [loop_binary_ece(y[:, e].tolist(), q[:, e].tolist(), n_bins, discrepancy, spacing)
                    for e in range(n_events)]
        np.testing.assert_allclose(res.ece, expected, rtol=0, atol=1e-12)
        np.testing.assert_allclose(res.prevalence, y.mean(axis=0), atol=1e-15)
        np.testing.assert_allclose(res.pred_mass, q.mean(axis=0), atol=1e-15)


def loop_kernel_ece(f, y, h, p):
    """The Dirichlet-kernel estimator with the whole (n, n) kernel matrix at once."""
    return float(dense_kernel_errors(f, y, h, p).mean())


def test_kernel_chunked_equals_unchunked_and_direct_formula():
    rng = np.random.default_rng(2)
    f = rng.dirichlet(np.full(5, 0.7), size=301)
    f[0] = [1, 0, 0, 0, 0]  # a zero entry: log clamped at 1e-8
    y = np.array([rng.choice(5, p=row) for row in f])
    for h, p in ((1.0, 1), (0.1, 1), (0.05, 2), (0.3, 3)):
        whole = rm.dirichlet_kernel_ece(f, y, h=h, p=p, chunk_size=1000)
        for chunk in (1, 7, 300):
            assert rm.dirichlet_kernel_ece(f, y, h=h, p=p, chunk_size=chunk) == pytest.approx(whole, abs=1e-12)
        assert whole == pytest.approx(loop_kernel_ece(f, y, h, p), abs=1e-12)
    inf_norm = rm.dirichlet_kernel_errors(f, y, h=0.2, p=np.inf)
    assert (inf_norm <= rm.dirichlet_kernel_errors(f, y, h=0.2, p=1) + 1e-15).all()


def test_kernel_constant_predictor_is_leave_one_out_frequency():
    """Notes 2.6/8.10: S6 + A, h = 1/6, p = 1: each pair problem has f = (.5, .5) and leave-one-out frequencies
    (.4, .6), so the error is 0.2 (exactly 1 / (5 + 1e-8)) although the predictor is calibrated; S6 + B: 1/3."""
    x = rm.full_rank_sub_k_ece(S6, DIST_A.sub_k, 2, h=1 / 6, p=1)
    assert x.ece == pytest.approx(1 / (5 + 1e-8), abs=1e-12) and x.ece == pytest.approx(0.2, abs=1e-7)
    np.testing.assert_allclose(x.problem_ece, 0.2, atol=1e-7)
    assert (x.subsets == [[0, 1], [0, 2], [1, 2]]).all()
    y = rm.full_rank_sub_k_ece(S6, DIST_B.sub_k, 2, h=1 / 6, p=1)
    assert y.ece == pytest.approx(1 / 3, abs=1e-7)
    assert x.ece < y.ece
    # The bandwidth has no effect for constant predictions.
    assert rm.full_rank_sub_k_ece(S6, DIST_A.sub_k, 2, h=1.0).ece == pytest.approx(x.ece, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# The reference's own test cases (notes section 8)
# ---------------------------------------------------------------------------------------------------------------


def test_binary_ece_reference_cases():
    # Case 1: bins [.5,.75) with y {0,1}, q .5 and [.75,1] with y {1,1,1,0}, q .75: exactly calibrated. Our frequency
    # is exact, so 0 (the reference's test-only estimator divides by n_b + 1e-6 and gives 1.99e-7).
    res = rm.binary_ece([1, 0, 1, 1, 1, 0], [0.75, 0.5, 0.5, 0.75, 0.75, 0.75], n_bins=4)
    assert res.ece[0] == pytest.approx(0.0, abs=1e-12)
    # Case 2: the q = .5 bin holds one sample with y = 0: (1/5) * 0.5.
    res = rm.binary_ece([1, 0, 1, 1, 0], [0.75, 0.5, 0.75, 0.75, 0.75], n_bins=4)
    assert res.ece[0] == pytest.approx(0.1, abs=1e-12)
    assert res.prevalence[0] == pytest.approx(0.6) and res.pred_mass[0] == pytest.approx(0.7)


def test_event_labels_and_marginals_reference_cases():
    """Notes 8.3 and 8.6: sub-ranking (1,2,5) and top-3 prefix (3,1,4) on two 5-item rankings (1-based ids)."""
    true = ranks_of([[3, 1, 4, 2, 5], [2, 1, 3, 4, 5]])
    dist = ExplicitDistribution(np.array([[3, 1, 4, 2, 5], [2, 1, 3, 4, 5]]) - 1, np.array([[0.6, 0.4], [0.3, 0.7]]))
    sub = np.array([[1, 2, 5]]) - 1
    assert rm.event_labels("sub", true, sub)[:, 0].tolist() == [1, 0]
    assert dist.sub_k(sub)[:, 0].tolist() == pytest.approx([0.6, 0.3])
    top = np.array([[3, 1, 4]]) - 1
    assert rm.event_labels("top", true, top)[:, 0].tolist() == [1, 0]
    assert dist.top_k(top)[:, 0].tolist() == pytest.approx([0.6, 0.3])
    true2 = ranks_of([[3, 1, 4, 2, 5], [1, 2, 3, 4, 5]])
    dist2 = ExplicitDistribution(np.array([[3, 1, 4, 2, 5], [1, 2, 3, 4, 5]]) - 1, np.array([[0.6, 0.4], [0.3, 0.7]]))
    assert rm.event_labels("sub", true2, sub)[:, 0].tolist() == [1, 1]
    assert dist2.sub_k(sub)[:, 0].tolist() == pytest.approx([1.0, 1.0])


def test_sub_k_rankwise_reference_cases():
    a = rm.rankwise_sub_k_ece(S6, DIST_A.sub_k, 2)
    assert a.ece == pytest.approx(0.0, abs=1e-9)
    assert a.events.tolist() == [[0, 1], [0, 2], [1, 0], [1, 2], [2, 0], [2, 1]]  # all P(3,2), itertools order
    np.testing.assert_allclose(a.pred_mass, 0.5, atol=1e-12)
    np.testing.assert_allclose(a.prevalence, 0.5, atol=1e-12)
    b = rm.rankwise_sub_k_ece(S6, DIST_B.sub_k, 2)
    assert b.ece == pytest.approx(1 / 6, abs=1e-9)
    np.testing.assert_allclose(b.event_ece, 1 / 6, atol=1e-9)


def test_top_k_rankwise_reference_cases():
    c1 = rm.rankwise_top_k_ece(S6, DIST_C.top_k, 1)
    assert c1.ece == pytest.approx(0.0, abs=1e-9)  # every item: predicted 1/3, true frequency 2/6
    top3 = rm.rankwise_top_k_ece(S6, DIST_C.top_k, 3).ece
    top2 = rm.rankwise_top_k_ece(S6, DIST_C.top_k, 2).ece
    sub3 = rm.rankwise_sub_k_ece(S6, DIST_C.sub_k, 3).ece
    assert min(top3, top2, sub3) > 1e-6
    assert top3 == pytest.approx(1 / 6, abs=1e-9)
    assert top2 == pytest.approx(top3, abs=1e-9) and sub3 == pytest.approx(top3, abs=1e-9)


def test_sub_k_full_rank_problem_reference_case():
    """Notes 8.9: item set {1,2,5}: classes = permutations in itertools order (125, 152, 215, 251, 512, 521)."""
    true = ranks_of([[3, 1, 4, 2, 5], [2, 1, 3, 4, 5]])
    dist = ExplicitDistribution(np.array([[3, 1, 4, 2, 5], [2, 1, 3, 4, 5]]) - 1, np.array([[0.6, 0.4], [0.3, 0.7]]))
    (p125,) = rm.sub_k_full_rank_problems(true, dist.sub_k, np.array([[1, 2, 5]]) - 1)
    assert (p125.classes + 1).tolist() == [[1, 2, 5], [1, 5, 2], [2, 1, 5], [2, 5, 1], [5, 1, 2], [5, 2, 1]]
    assert p125.labels.tolist() == [0, 2] and not p125.has_other
    np.testing.assert_allclose(p125.probs, [[0.6, 0, 0.4, 0, 0, 0], [0.3, 0, 0.7, 0, 0, 0]], atol=1e-15)
    (p12,) = rm.sub_k_full_rank_problems(true, dist.sub_k, np.array([[1, 2]]) - 1)
    assert p12.labels.tolist() == [0, 1]
    np.testing.assert_allclose(p12.probs, [[0.6, 0.4], [0.3, 0.7]], atol=1e-15)


# ---------------------------------------------------------------------------------------------------------------
# Invariances and calibrated vs miscalibrated models
# ---------------------------------------------------------------------------------------------------------------


def test_closed_form_pl_helper_matches_enumeration():
    logw = np.random.default_rng(3).normal(size=(5, 4))
    enum, closed = pl_explicit(logw), ClosedFormPL(logw)
    np.testing.assert_allclose(enum.probs.sum(axis=1), 1.0, atol=1e-12)
    for k in (1, 2, 3, 4):
        tuples = ordered_tuples(4, k)
        np.testing.assert_allclose(closed.top_k(tuples), enum.top_k(tuples), atol=1e-12)
        if k >= 2:
            np.testing.assert_allclose(closed.sub_k(tuples), enum.sub_k(tuples), atol=1e-12)
    assert (closed.mode_ranks() == enum.mode_ranks()).all()


def test_relabelling_items_changes_no_metric():
    rng = np.random.default_rng(4)
    n, m = 300, 4
    orderings = all_orderings(m)
    probs = rng.dirichlet(np.full(len(orderings), 0.3), size=n)
    true = orderings_to_ranks(orderings[[rng.choice(len(orderings), p=row) for row in probs]])
    perm = np.array([2, 0, 3, 1])  # item j is called perm[j] afterwards
    true_p = np.empty_like(true)
    true_p[:, perm] = true
    dist, dist_p = ExplicitDistribution(orderings, probs), ExplicitDistribution(perm[orderings], probs)
    for opts in ({}, {"discrepancy": "jeff", "aggregate": "pred_mass", "kernel_h": 0.2, "kernel_p": 2},
                 {"events": "observed", "aggregate": "prevalence", "spacing": "log"}):
        before, after = ranking_metrics(dist, true, **opts), ranking_metrics(dist_p, true_p, **opts)
        assert before.keys() == after.keys()
        assert {"rank/sub_4/ece", "rank/top_3/ece", "rank/full/sub_3/ece", "rank/full/top_2/ece"} <= before.keys()
        for key in before:
            assert after[key] == pytest.approx(before[key], abs=1e-10), key


@pytest.fixture(scope="module")
def pl_world():
    """50,000 contexts, 4 items, random PL weights per context; labels drawn from that PL by the Gumbel trick."""
    rng = np.random.default_rng(0)
    logw = rng.normal(size=(50_000, 4))
    true = orderings_to_ranks(np.argsort(-(logw + rng.gumbel(size=logw.shape)), axis=1))
    return logw, true


def test_calibrated_pl_has_small_rankwise_ece_and_distorted_does_not(pl_world):
    logw, true = pl_world
    results = {}
    for name, temperature in (("calibrated", 1.0), ("sharp", 3.0), ("flat", 0.3)):
        dist = pl_explicit(logw * temperature)
        results[name] = {f"sub_{k}": rm.rankwise_sub_k_ece(true, dist.sub_k, k).ece for k in (2, 3, 4)}
        results[name].update({f"top_{k}": rm.rankwise_top_k_ece(true, dist.top_k, k).ece for k in (1, 2, 3)})
    assert max(results["calibrated"].values()) < 0.01, results["calibrated"]
    for name in ("sharp", "flat"):
        for key in ("sub_2", "sub_3", "top_1", "top_2"):
            assert results[name][key] > max(0.02, 4 * results["calibrated"][key]), (name, key, results)


def test_calibrated_pl_has_small_kernel_error_and_distorted_does_not(pl_world):
    """Full-rank sub-2 with a narrow kernel (h = 0.02) on 1500 contexts. (With the reference's h = 1 the kernel is
    so wide that a flattened model can score better than the true one; see rm.dirichlet_kernel_ece.)"""
    logw, true = pl_world
    logw, true = logw[:1500], true[:1500]
    value = {name: rm.full_rank_sub_k_ece(true, pl_explicit(logw * t).sub_k, 2, h=0.02).ece
             for name, t in (("calibrated", 1.0), ("sharp", 3.0), ("flat", 0.3))}
    assert value["calibrated"] < 0.07, value
    assert value["sharp"] > 3 * value["calibrated"] and value["flat"] > 2.5 * value["calibrated"], value


# ---------------------------------------------------------------------------------------------------------------
# Accuracy of the modal ranking
# ---------------------------------------------------------------------------------------------------------------


def test_kendall_footrule_top1_by_hand():
    true = np.array([[1, 2, 3, 4]] * 4)
    pred = np.array([[1, 2, 3, 4], [4, 3, 2, 1], [2, 1, 3, 4], [1, 3, 4, 2]])
    # identical: tau 1; reversed: -1; one adjacent swap: (5 - 1) / 6; item 1 of [1,3,4,2] moved: pairs (1,2) (1,3)
    # concordant... ranks 1,3,4,2: discordant pairs (b,d) and (c,d) -> (4 - 2) / 6.
    np.testing.assert_allclose(rm.kendall_tau_samples(true, pred), [1, -1, 2 / 3, 1 / 3], atol=1e-15)
    np.testing.assert_allclose(rm.footrule_samples(true, pred), [0, 8, 2, 4])
    np.testing.assert_allclose(rm.top1_correct(true, pred), [1, 0, 0, 1])
    acc = rm.ranking_accuracy(true, pred)
    assert acc == pytest.approx({"kendall_tau": (1 - 1 + 2 / 3 + 1 / 3) / 4, "footrule": 3.5,
                                 "footrule_norm": 3.5 / 8, "top1_accuracy": 0.5})
    assert rm.max_footrule(3) == 4 and rm.footrule_samples([[1, 2, 3]], [[3, 2, 1]])[0] == 4
    assert rm.max_footrule(5) == 12 and rm.footrule_samples([[1, 2, 3, 4, 5]], [[5, 4, 3, 2, 1]])[0] == 12
    # A tie in the prediction counts as a discordant pair (sklr's tau_score).
    assert rm.kendall_tau_samples([[1, 2, 3, 4]], [[1, 1, 3, 4]])[0] == pytest.approx(4 / 6)


# ---------------------------------------------------------------------------------------------------------------
# The metric dict (ranking_evaluation / ranking_metrics)
# ---------------------------------------------------------------------------------------------------------------


def test_metric_dict_names_and_reference_values():
    metrics = ranking_metrics(DIST_C, S6, kernel_h=1.0)
    expected_ece = {"rank/sub_2/ece", "rank/sub_3/ece", "rank/top_1/ece", "rank/top_2/ece", "rank/full/sub_2/ece",
                    "rank/full/sub_3/ece", "rank/full/top_1/ece", "rank/full/top_2/ece"}
    assert {k for k in metrics if k.endswith("/ece")} == expected_ece
    assert {"rank/kendall_tau", "rank/footrule", "rank/footrule_norm", "rank/top1_accuracy"} <= metrics.keys()
    assert metrics["rank/top_1/ece"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["rank/top_2/ece"] == pytest.approx(1 / 6, abs=1e-9)
    assert metrics["rank/sub_2/n_events"] == 6 and metrics["rank/full/top_2/n_classes"] == 6
    # Mode of C: the first of three equal maxima, 123 (ranks 1,2,3) for every sample.
    assert metrics["rank/top1_accuracy"] == pytest.approx(2 / 6)
    assert all(isinstance(v, float) for v in metrics.values())


def test_pairs_only_distribution_has_no_top_k_keys():
    metrics = ranking_metrics(PairsOnly(DIST_A), S6)
    assert {k for k in metrics if k.endswith("/ece")} == {"rank/sub_2/ece", "rank/full/sub_2/ece"}
    assert not any(v == -1 for v in metrics.values())


def test_restricted_events_for_many_items():
    """m >= 8: rank-wise events and full-rank classes are those observed in the labels (plus an "other" class that
    keeps every predicted vector on the simplex); subsets are capped by max_subsets with a seeded draw."""
    rng = np.random.default_rng(5)
    n, m = 80, 8
    logw = rng.normal(size=(n, m)) * 1.5
    true = orderings_to_ranks(np.argsort(-(logw + rng.gumbel(size=logw.shape)), axis=1))
    dist = ClosedFormPL(logw)
    ev = ranking_evaluation(dist, true, max_k=3, max_subsets=10, kernel_h=0.5)
    m_ = ev.metrics
    names = ("sub_2", "sub_3", "top_1", "top_2", "top_3", "top_7")  # top-7: the full ranking, always evaluated
    assert {k for k in m_ if k.endswith("/ece")} == {f"rank/{s}/ece" for s in names} | {
        f"rank/full/{s}/ece" for s in names}
    assert m_["rank/full/sub_2/n_subsets"] == 10 and m_["rank/full/sub_3/n_subsets"] == 10
    prefixes = {tuple(o) for o in np.argsort(true, axis=1)[:, :2].tolist()}
    assert {tuple(e) for e in ev.rankwise["top_2"].events.tolist()} == prefixes
    assert m_["rank/full/top_2/n_classes"] == len(prefixes) + 1  # observed prefixes + "other"
    # Every rank-wise sub-3 event is observed and belongs to one of the 10 sampled subsets.
    subsets = {tuple(s) for s in ev.full_rank["sub_3"].subsets.tolist()}
    assert all(tuple(sorted(e)) in subsets for e in ev.rankwise["sub_3"].events.tolist())
    assert (ev.rankwise["sub_3"].prevalence > 0).all()
    problem = rm.top_k_full_rank_problem(true, dist.top_k, 2)
    assert problem.has_other and np.allclose(problem.probs.sum(axis=1), 1.0)
    # Deterministic for a seed; another seed draws other subsets.
    again = ranking_evaluation(dist, true, max_k=3, max_subsets=10, kernel_h=0.5, full_rank=False)
    assert again.metrics["rank/sub_3/ece"] == m_["rank/sub_3/ece"]
    other = ranking_evaluation(dist, true, ks_sub=[3], ks_top=[], max_subsets=10, seed=1, full_rank=False)
    assert {tuple(sorted(e)) for e in other.rankwise["sub_3"].events.tolist()} != \
        {tuple(sorted(e)) for e in ev.rankwise["sub_3"].events.tolist()}
    # The default k cap (5) and "all" events still work on m = 8.
    keys = ranking_metrics(dist, true, full_rank=False, max_subsets=5, events="all").keys()
    assert "rank/sub_5/ece" in keys and "rank/top_5/ece" in keys and "rank/sub_6/ece" not in keys


def test_restricted_events_on_small_m_keep_the_simplex():
    dist = pl_explicit(np.random.default_rng(6).normal(size=(40, 4)) * 2)
    true = orderings_to_ranks(all_orderings(4)[[0, 7, 13, 22] * 10])  # 4 distinct rankings: unobserved prefixes
    problem = rm.top_k_full_rank_problem(true, dist.top_k, 2, events="observed")
    assert problem.has_other and len(problem.classes) < 12
    np.testing.assert_allclose(problem.probs.sum(axis=1), 1.0, atol=1e-12)
    assert (problem.labels < len(problem.classes)).all()
    full = rm.top_k_full_rank_problem(true, dist.top_k, 2, events="all")
    assert not full.has_other and full.probs.shape[1] == 12


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------


def _one_line_error(fn, *args, match: str, **kwargs):
    with pytest.raises(UserError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)


def test_bad_k_is_a_one_line_user_error():
    _one_line_error(rm.rankwise_sub_k_ece, S6, DIST_A.sub_k, 4, match=r"k in 2\.\.3")
    _one_line_error(rm.rankwise_sub_k_ece, S6, DIST_A.sub_k, 1, match=r"k in 2\.\.3")
    _one_line_error(rm.rankwise_top_k_ece, S6, DIST_A.top_k, 0, match=r"k in 1\.\.3")
    _one_line_error(ranking_metrics, DIST_A, S6, ks_sub=[4], match=r"k in 2\.\.3")
    _one_line_error(ranking_metrics, PairsOnly(DIST_A), S6, ks_sub=[3], match=r"k in 2\.\.2 .*max_sub_k=2")
    _one_line_error(ranking_metrics, PairsOnly(DIST_A), S6, ks_top=[1], match="top-k metrics are not available")


def test_bad_options_and_shapes():
    _one_line_error(rm.binary_ece, [1, 0], [0.5, 0.5], discrepancy="l2", match="discrepancy")
    _one_line_error(rm.binary_ece, [1, 0], [0.5, 0.5], n_bins=0, match="n_bins")
    _one_line_error(rm.binary_ece, [1, 0], [0.5, 1.5], match=r"\[0, 1\]")
    _one_line_error(ranking_metrics, DIST_A, S6[:5], match="shape")
    _one_line_error(ranking_metrics, DIST_A, S6, events="some", match="events")
    _one_line_error(ranking_metrics, DIST_A, S6, kernel_h=0, match="bandwidth")
    _one_line_error(ranking_metrics, DIST_A, np.array([[1, 1, 3]] * 6), match="permutation")
    _one_line_error(rm.dirichlet_kernel_ece, np.array([[0.5, 0.5]]), np.array([0]), match="at least 2")


def test_kernel_metrics_on_a_seeded_subset_of_rows(pl_world):
    """kernel_max_samples bounds the O(n^2) kernel: all rows when n is below it; a seeded subset otherwise (same
    seed, same value), while the rank-wise metrics keep every row."""
    logw, true = pl_world
    logw, true = logw[:600], true[:600]
    dist = pl_explicit(logw)
    opts = dict(max_k=2, kernel_h=0.05)
    everything = ranking_metrics(dist, true, kernel_max_samples=None, **opts)
    assert ranking_metrics(dist, true, kernel_max_samples=600, **opts) == everything
    sub = ranking_metrics(dist, true, kernel_max_samples=300, **opts)
    assert sub == ranking_metrics(dist, true, kernel_max_samples=300, **opts)
    assert sub["rank/full/sub_2/ece"] != everything["rank/full/sub_2/ece"]
    assert sub["rank/sub_2/ece"] == everything["rank/sub_2/ece"] and sub["rank/kendall_tau"] == everything[
        "rank/kendall_tau"]
    expected = rm.full_rank_sub_k_ece(true[np.sort(np.random.default_rng([0, 7]).choice(600, 300, replace=False))],
                                      lambda t: dist.sub_k(t)[np.sort(np.random.default_rng([0, 7]).choice(
                                          600, 300, replace=False))], 2, h=0.05).ece
    assert sub["rank/full/sub_2/ece"] == pytest.approx(expected)
    with pytest.raises(UserError, match="kernel_max_samples"):
        ranking_metrics(dist, true, kernel_max_samples=1, **opts)


def test_too_many_exact_events_is_a_one_line_error():
    rng = np.random.default_rng(0)
    true = orderings_to_ranks(np.argsort(rng.random((5, 26)), axis=1))
    with pytest.raises(UserError, match=r"events=all needs all P\(26, 5\) = 7,893,600 top-5 prefixes"):
        rm.top_k_events(true, 5, events="all")
    assert len(rm.top_k_events(true, 5, events="auto")) <= 5  # observed prefixes only


def test_a_probability_summed_onto_a_bin_edge_lands_in_the_bin_of_its_exact_value():
    """0.7 + 0.2 is 0.8999999999999999 in float64: binned as the 0.9 it stands for (the bin [0.9, 1.0) with 10 bins),
    together with an exact 0.9. The exact answer: one bin, frequency 1/2, confidence 0.9, ECE |0.5 - 0.9| = 0.4
    (raw binning put them in two bins: 0.5 * |1 - 0.9| + 0.5 * |0 - 0.9| = 0.5)."""
    from rewarduq_exp.metrics.ranking import bin_edges, bin_index, binary_ece

    summed = 0.7 + 0.2
    assert summed < 0.9
    assert bin_index(np.array([summed, 0.9, 0.8999, 1.0, 0.0]), bin_edges(10)).tolist() == [9, 9, 8, 9, 0]
    result = binary_ece([1.0, 0.0], [summed, 0.9], n_bins=10)
    assert float(result.ece[0]) == pytest.approx(0.4, abs=1e-12)
    # every edge b / 10, reached by float sums of tenths, is binned as its exact value
    for b in range(1, 10):
        tenths = sum([0.1] * b)
        assert bin_index(np.array([tenths]), bin_edges(10))[0] == b, (b, tenths)


# ---------------------------------------------------------------------------------------------------------------
# The reference code's further options (issue 26): discrepancies, most_confident, simplex binning, restrictions
# ---------------------------------------------------------------------------------------------------------------


def pl_probs(logw: np.ndarray, orderings: np.ndarray) -> np.ndarray:
    """Plackett-Luce probabilities (n, R) of the listed orderings (as the fixture script computes them)."""
    lw = logw[:, orderings]
    tail = np.logaddexp.accumulate(lw[..., ::-1], axis=-1)[..., ::-1]
    return np.exp((lw - tail).sum(axis=-1))


def rpc_pairs(logw: np.ndarray) -> np.ndarray:
    n, m = logw.shape
    P = np.zeros((n, m, m))
    for i in range(m):
        for j in range(i + 1, m):
            P[:, i, j] = 1.0 / (1.0 + np.exp(-(logw[:, i] - logw[:, j])))
            P[:, j, i] = 1.0 - P[:, i, j]
    return P


def test_new_discrepancies_reproduce_reference_code(reference):
    """log_ratio / rel_p / rel_q on the 120 synthetic rank-wise cases x 2 spacings: per event and total to 1e-9
    relative (rel_q reaches 6e10 where a bin's confidence is 0) of the double-precision reference run."""
    data, ranks, dists, _ = reference
    cases = data["variants"]["discrepancies"]
    assert len(cases) == 360
    for case in cases:
        dist, kind = dists[case["prediction"]], case["kind"]
        fn = rm.rankwise_sub_k_ece if kind == "sub" else rm.rankwise_top_k_ece
        res = fn(ranks[case["labels"]], dist.sub_k if kind == "sub" else dist.top_k, case["k"],
                 discrepancy=case["discrepancy"], spacing=case["spacing"])
        np.testing.assert_allclose(res.event_ece, case["event_ece"], rtol=1e-9, atol=1e-9)
        assert res.ece == pytest.approx(case["ece"], rel=1e-9, abs=1e-9), case["labels"]
    assert max(c["ece"] for c in cases if c["discrepancy"] == "rel_q") > 1e10  # the explosion near q = 0


def test_most_confident_reproduces_reference_code(reference):
    data, ranks, dists, _ = reference
    cases = data["variants"]["most_confident"]
    assert len(cases) == 72
    for case in cases:
        res = rm.rankwise_top_k_ece(ranks[case["labels"]], dists[case["prediction"]].top_k, case["k"],
                                    discrepancy=case["discrepancy"], aggregate="most_confident")
        assert res.ece == pytest.approx(case["ece"], abs=1e-9), case


def test_simplex_binning_reproduces_reference_code(reference):
    """Full-rank sub-2 (2 classes) and top-1 (3 classes) by simplex binning on all 10,000 samples."""
    data, ranks, dists, _ = reference
    cases = data["variants"]["binning"]
    assert len(cases) == 24
    for case in cases:
        dist, r = dists[case["prediction"]], ranks[case["labels"]]
        if case["kind"] == "sub":
            value = rm.full_rank_sub_k_ece(r, dist.sub_k, 2, estimator="binning").ece
        else:
            value = rm.full_rank_top_k_ece(r, dist.top_k, 1, estimator="binning").ece
        assert value == pytest.approx(case["ece"], abs=1e-9), case


def test_restrictions_reproduce_reference_code(reference):
    """95_prob_mass / top_10 on random cases (m = 3, 4, 8; PL over all m! rankings or over a candidate list; RPC
    pairs): rank-wise (abs, jeff) and full-rank (kernel h = 1, p = 1; binning where defined) values, samples and
    rankings kept, to 1e-9 of the double-precision reference run."""
    data = reference[0]["variants"]
    for entry in data["restricted"]:
        case = data["random_cases"][entry["case"]]
        m = case["m"]
        orderings = np.asarray(case["orderings"])
        true, logw = orderings_to_ranks(orderings), np.asarray(case["logw"])
        if case["pairs"]:
            dist = rm_pairwise(rpc_pairs(logw))
            ks_sub, ks_top = [2], []
        else:
            cands = all_orderings(m) if case["candidates"] is None else np.asarray(case["candidates"])
            dist = ExplicitDistribution(cands, pl_probs(logw, cands))
            ks_sub, ks_top = [2, 3], sorted({1, 2, m - 1})
        opts = dict(ks_sub=ks_sub, ks_top=ks_top, restrict=entry["restrict"], max_subsets=None,
                    kernel_max_samples=None)
        got = {}
        for key, value in ranking_metrics(dist, true, **opts).items():
            got[f"abs|{key}" if "/full/" not in key else f"kernel|{key}"] = value
        for key, value in ranking_metrics(dist, true, discrepancy="jeff", full_rank=False, **opts).items():
            got[f"jeff|{key}"] = value
        if m <= 4:
            ev = ranking_evaluation(dist, true, full_rank_estimator="binning", **opts)
            got.update({f"binning|{key}": value for key, value in ev.metrics.items() if "/full/" in key})
            assert set(ev.skipped) == {f"rank/full/{s}/ece" for s in ["sub_3"] * (not case["pairs"])
                                       + [f"top_{k}" for k in ks_top if math.perm(m, k) > 3]}
        for key, expected in entry["values"].items():
            assert got[key] == pytest.approx(expected, abs=1e-9), (entry["case"], entry["restrict"], key)
        assert got["abs|rank/restrict/n_samples"] == entry["n_samples"]
        assert got["abs|rank/restrict/n_rankings"] == entry["n_rankings"]


def rm_pairwise(P):
    from rewarduq_exp.ranking.pairwise import PairwiseOnly

    return PairwiseOnly(P)


def test_new_discrepancies_by_hand():
    """Two bins of two samples: [.25, .5) with frequency .5 and confidence .25, [.75, 1] with .5 and .75."""
    y, q = [1, 0, 0, 1], [0.25, 0.25, 0.75, 0.75]
    expected = {"abs": 0.25, "rel_p": 0.5, "rel_q": 0.5 * 1 + 0.5 / 3, "log_ratio": 0.5 * math.log(3)}
    for disc, value in expected.items():
        assert rm.binary_ece(y, q, n_bins=4, discrepancy=disc).ece[0] == pytest.approx(value, abs=1e-11), disc
    # A bin with confidence 0 but frequency 1/2: rel_q = 0.5 / 1e-12, log_ratio = ln((0.5 + 1e-12) / 1e-12).
    y0, q0 = [1, 0], [0.0, 0.0]
    assert rm.binary_ece(y0, q0, discrepancy="rel_q").ece[0] == pytest.approx(0.5e12, rel=1e-12)
    assert rm.binary_ece(y0, q0, discrepancy="log_ratio").ece[0] == pytest.approx(math.log(0.5e12), rel=1e-12)
    assert rm.binary_ece(y0, q0, discrepancy="rel_p").ece[0] == pytest.approx(1.0)
    # rel_p explodes the other way round: events that never happen but are predicted.
    assert rm.binary_ece([0, 0], [0.5, 0.5], discrepancy="rel_p").ece[0] == pytest.approx(0.5e12, rel=1e-12)


def test_most_confident_by_hand_and_for_sub_k():
    ece = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    mass = np.array([0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    assert rm.aggregate_ece(ece, None, mass, "most_confident") == pytest.approx(0.3)  # mean of the first five
    assert rm.aggregate_ece(ece[::-1], None, mass[::-1], "most_confident") == pytest.approx(0.3)
    # Fewer than 5 events: still divided by 5. Ties keep the event order.
    assert rm.aggregate_ece([0.3, 0.6], None, [0.5, 0.5], "most_confident") == pytest.approx(0.18)
    assert rm.aggregate_ece([1, 2, 3, 4, 5, 6], None, [1] * 6, "most_confident") == pytest.approx(3.0)
    # Our extension to sub-k (the reference raises there): S6 + B, six pair events each with ECE 1/6.
    res = rm.rankwise_sub_k_ece(S6, DIST_B.sub_k, 2, aggregate="most_confident")
    assert res.ece == pytest.approx(1 / 6, abs=1e-12)
    # Top-1 of S6 + C: every item calibrated (ECE 0).
    assert rm.rankwise_top_k_ece(S6, DIST_C.top_k, 1, aggregate="most_confident").ece == pytest.approx(0.0)
    assert "rank/sub_3/ece" in ranking_metrics(DIST_B, S6, aggregate="most_confident")


def test_frequent_rankings_and_restriction_by_hand():
    """20 samples of m = 3: A (123) x 10, B (213) x 6, C (231) x 3, D (132) x 1, D first. 95 %: A, B, C (cumulative
    share 19/20 = 0.95 reaches it); top_10: all four. Uniform predictions restricted to A, B, C: each keeps 1/6."""
    a, b, c, d = [0, 1, 2], [1, 0, 2], [1, 2, 0], [0, 2, 1]
    orderings = np.array([d] + [a] * 10 + [b] * 6 + [c] * 3)
    true = orderings_to_ranks(orderings)
    assert rm.frequent_rankings(true, "prob_mass_95").tolist() == [a, b, c]
    assert rm.frequent_rankings(true, "top_10").tolist() == [a, b, c, d]
    uniform = ExplicitDistribution(O3, np.full((20, 6), 1 / 6))
    res = rm.restrict_to_frequent_rankings(uniform, true, "prob_mass_95")
    assert res.keep.tolist() == [False] + [True] * 19 and res.dist.n == 19
    np.testing.assert_allclose(res.dist.top_k(np.array([a, b, c, d])[:, :2]), [[1 / 6] * 3 + [0.0]] * 19,
                               atol=1e-15)
    np.testing.assert_allclose(res.dist.top_k(np.array([[0], [1], [2]])), [[1 / 6, 1 / 3, 0.0]] * 19)  # A; B, C
    # Rank-wise top-2 (= full ranking): events all six orderings; frequencies 10/19, 6/19, 3/19 for A, B, C against
    # 1/6 each, and 0 against 0 for the other three (D's mass is removed with D's sample).
    metrics = ranking_metrics(uniform, true, ks_sub=[], ks_top=[2], restrict="prob_mass_95", full_rank=False)
    expected = (abs(10 / 19 - 1 / 6) + abs(6 / 19 - 1 / 6) + abs(3 / 19 - 1 / 6)) / 6
    assert metrics["rank/top_2/ece"] == pytest.approx(expected, abs=1e-12)
    assert metrics["rank/restrict/n_rankings"] == 3 and metrics["rank/restrict/n_samples"] == 19
    assert metrics["rank/kendall_tau"] == ranking_metrics(uniform, true, ks_sub=[], ks_top=[2])["rank/kendall_tau"]
    # Equal counts keep the order of first occurrence: 11 rankings once each, top_10 drops the last one seen.
    eleven = all_orderings(4)[[5, 3, 17, 0, 9, 11, 2, 20, 8, 14, 7]]
    assert rm.frequent_rankings(orderings_to_ranks(eleven), "top_10").tolist() == eleven[:10].tolist()
    # RPC-like pairs: P(a > b) kept where some selected ranking has a before b. Selected A, B, C: 0 > 1 (A),
    # 1 > 0 (B, C), 0 > 2 (A, B), 2 > 0 (C), 1 > 2 (A, B, C), 2 > 1: none (only D, dropped).
    P = np.full((20, 3, 3), 0.5)
    pairs = rm.restrict_to_frequent_rankings(rm_pairwise(P), true, "prob_mass_95").dist
    got = pairs.sub_k(np.array([[0, 1], [1, 0], [0, 2], [2, 0], [1, 2], [2, 1]]))
    np.testing.assert_allclose(got, [[0.5, 0.5, 0.5, 0.5, 0.5, 0.0]] * 19)


def test_simplex_binning_by_hand_and_reference_cases():
    # K = 2: bins of p_1 0.15 and 0.12 -> [0.1, 0.2), 0.55 -> [0.5, 0.6).
    f = np.array([[0.15, 0.85], [0.12, 0.88], [0.55, 0.45]])
    value = rm.simplex_binning_ece(f, [0, 1, 0])
    assert value == pytest.approx(2 / 3 * 2 * abs(0.135 - 0.5) + 1 / 3 * 2 * 0.45, abs=1e-12)
    # K = 3: (0.65, 0.55) overflows (6 + 5 > 10): the larger p_1 is lowered to 10 - 5, the bin of (0.5, 0.55).
    g = np.array([[0.65, 0.55, 0.0], [0.52, 0.58, 0.0], [0.1, 0.1, 0.8]])
    bins = rm.simplex_bins(g)
    assert bins.tolist() == [5 * 11 + 5, 5 * 11 + 5, 1 * 11 + 1]
    # Edge values go to the bin of their exact value (0.3 is in [0.3, 0.4)).
    assert rm.simplex_bins(np.array([[0.3, 0.7], [0.1 + 0.2, 0.7]])).tolist() == [3, 3]
    # The reference's own cases (notes 8.10, 8.12): S6 + A sub-2 and S6 + C top-1 are calibrated: 0.
    assert rm.full_rank_sub_k_ece(S6, DIST_A.sub_k, 2, estimator="binning").ece == pytest.approx(0.0, abs=1e-12)
    assert rm.full_rank_top_k_ece(S6, DIST_C.top_k, 1, estimator="binning").ece == pytest.approx(0.0, abs=1e-12)
    # S6 + B sub-2: f = (1/3, 2/3) or (2/3, 1/3) against frequencies (1/2, 1/2): L1 distance 1/3 per subset.
    assert rm.full_rank_sub_k_ece(S6, DIST_B.sub_k, 2, estimator="binning").ece == pytest.approx(1 / 3)
    with pytest.raises(rm.BinningUndefined, match="2 or 3 classes"):
        rm.full_rank_sub_k_ece(S6, DIST_A.sub_k, 3, estimator="binning")
    # In the metric dict, keys without 2 or 3 classes are left out with the reason.
    ev = ranking_evaluation(DIST_C, S6, full_rank_estimator="binning")
    assert {k for k in ev.metrics if k.startswith("rank/full/") and k.endswith("/ece")} == {
        "rank/full/sub_2/ece", "rank/full/top_1/ece"}
    assert set(ev.skipped) == {"rank/full/sub_3/ece", "rank/full/top_2/ece"}
    assert all("\n" not in reason and "2 or 3 classes" in reason for reason in ev.skipped.values())


def test_full_ranking_is_reported_for_every_m():
    """Top-(m-1) joins the default sweep beyond max_k (m = 7: top_6 with all 5040 rankings; m = 10, auto: the
    observed rankings); events=all beyond 8! rankings leaves it out with a reason instead of failing; RPC has none."""
    rng = np.random.default_rng(8)
    logw = rng.normal(size=(40, 7)) * 2
    true = orderings_to_ranks(np.argsort(-(logw + rng.gumbel(size=logw.shape)), axis=1))
    ev = ranking_evaluation(ClosedFormPL(logw), true, max_k=2, max_subsets=3)
    assert {k for k in ev.metrics if k.endswith("/ece")} == {f"rank/{s}/ece" for s in ("sub_2", "top_1", "top_2",
                                                                                         "top_6")} | {
        f"rank/full/{s}/ece" for s in ("sub_2", "top_1", "top_2", "top_6")}
    assert ev.metrics["rank/full/top_6/n_classes"] == 5040 and ev.metrics["rank/top_6/n_events"] == 5040
    # top-6 is the full ranking: the same events as sub-7.
    sub7 = rm.rankwise_sub_k_ece(true, ClosedFormPL(logw).sub_k, 7)
    assert ev.metrics["rank/top_6/ece"] == pytest.approx(sub7.ece, abs=1e-12)
    assert not ev.skipped
    logw10 = rng.normal(size=(30, 10))
    true10 = orderings_to_ranks(np.argsort(-(logw10 + rng.gumbel(size=logw10.shape)), axis=1))
    auto = ranking_metrics(ClosedFormPL(logw10), true10, max_k=1, max_subsets=2, kernel_h=0.5)
    assert auto["rank/top_9/n_events"] == 30 and auto["rank/full/top_9/n_classes"] == 31  # + "other"
    every = ranking_evaluation(ClosedFormPL(logw10), true10, max_k=1, max_subsets=2, events="all", full_rank=False)
    assert "rank/top_9/ece" not in every.metrics
    assert "10! = 3,628,800" in every.skipped["rank/top_9/ece"] and "\n" not in every.skipped["rank/top_9/ece"]
    pairs = ranking_metrics(PairsOnly(ClosedFormPL(logw)), true, max_subsets=3)
    assert not any(k.startswith(("rank/top_", "rank/full/top_")) for k in pairs)


def test_bad_new_options_are_one_line_errors():
    _one_line_error(ranking_metrics, DIST_A, S6, restrict="top10", match="restrict='top10' is invalid")
    _one_line_error(ranking_metrics, DIST_A, S6, full_rank_estimator="bins", match="full_rank_estimator")
    _one_line_error(ranking_metrics, DIST_A, S6, aggregate="confident", match="most_confident")
    _one_line_error(ranking_metrics, DIST_A, S6, discrepancy="rel", match="rel_q")
