"""Temperature recalibration of label rankers, and the KL / Jeffreys keys beside the rank-wise ECE.

* Each distribution's temperature (PL log-weights / T, Mallows theta / T, RPC pairwise logits / T, RankClassifier
  logits / T) fitted by maximum likelihood on rankings drawn from the distribution tempered with a known T = 2.5
  recovers it (within 5 %, relative, at 6000 rankings: the standard error is about 1 % there);
* T = 1 is the distribution itself; tempering never moves the modal ranking (so Kendall tau is unchanged);
* the run's calibration share is a seeded random part of each training fold, disjoint from the fit and test rows;
* ``rank/<kind>_<k>/kl`` and ``/jeff`` equal ``binary_ece(..., discrepancy="kl" / "jeff")`` on the same events;
* with ``metric.ranking.recalibrate=false`` a run gives the numbers the code gave before recalibration existed
  (recorded from that code on the shipped iris fixture); with it on, every metric also comes as ``recal/...``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ROOT
from entry_points import run_entry_point
from sklearn.model_selection import KFold

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.label_ranking import fit_distribution_temperature
from rewarduq_exp.metrics.ranking import binary_ece, ranking_evaluation
from rewarduq_exp.metrics.ranking.events import event_labels, sub_k_events, top_k_events
from rewarduq_exp.ranking.categorical import RankCategorical
from rewarduq_exp.ranking.distribution import ExplicitDistribution
from rewarduq_exp.ranking.mallows import Mallows
from rewarduq_exp.ranking.pairwise import PairwiseOnly
from rewarduq_exp.ranking.permutations import all_orderings, orderings_to_ranks
from rewarduq_exp.ranking.plackett_luce import PlackettLuce
from rewarduq_exp.runner.label_ranking_run import calibration_split

TRUE_T = 2.5
N_DRAWS = 6000
FIXTURES = ROOT / "tests" / "fixtures" / "label_ranking"


def _pl(rng, n=N_DRAWS, m=5):
    return PlackettLuce(rng.normal(size=(n, m)) * 2.0)


def _draw_pl(dist: PlackettLuce, rng) -> np.ndarray:
    return orderings_to_ranks(dist.sample(rng, 1)[:, 0])


def _draw_categorical(probs: np.ndarray, orderings: np.ndarray, rng) -> np.ndarray:
    cdf = np.cumsum(probs, axis=1)
    pick = np.minimum((cdf < rng.random((len(probs), 1))).sum(axis=1), probs.shape[1] - 1)
    return orderings_to_ranks(orderings[pick])


def _every_kind(rng, n=200, m=4):
    """One distribution of each kind (PL, Mallows, RPC's pairs, RankClassifier's two constructions, explicit)."""
    lw = rng.normal(size=(n, m)) * 2.0
    orderings = all_orderings(m)
    logits = rng.normal(size=(n, 10)) * 2.0
    return {
        "pl": PlackettLuce(lw),
        "mallows": Mallows(rng.permutation(m), 0.8, n=n),
        "pairwise": PairwiseOnly(PlackettLuce(lw).pairwise()),
        "rc_unseen_mass": RankCategorical.from_unseen_mass(orderings[:10], logits, 0.05),
        "rc_rest_logit": RankCategorical(orderings[:10], logits, -1.0),
        "explicit": ExplicitDistribution(orderings, np.exp(PlackettLuce(lw).log_prob(orderings))),
    }


# ------------------------------------------------------------------------------------------------ recovering T
def test_plackett_luce_temperature_is_recovered():
    rng = np.random.default_rng(0)
    model = _pl(rng)
    ranks = _draw_pl(model.temper(TRUE_T), rng)
    fit = fit_distribution_temperature(model, ranks)
    assert fit.temperature == pytest.approx(TRUE_T, rel=0.05)
    assert fit.nll_after < fit.nll_before and not fit.at_bound and fit.rows == N_DRAWS


def test_mallows_dispersion_is_recovered():
    rng = np.random.default_rng(1)
    model = Mallows(rng.permutation(6), 1.2, n=N_DRAWS)
    ranks = orderings_to_ranks(model.temper(TRUE_T).sample(rng, N_DRAWS))
    fit = fit_distribution_temperature(model, ranks)
    assert fit.temperature == pytest.approx(TRUE_T, rel=0.05)
    # theta / T: the tempered model is the Mallows model with the maximum-likelihood theta for this center
    assert model.temper(fit.temperature).theta == pytest.approx(1.2 / fit.temperature)


def test_pairwise_temperature_is_recovered_from_the_pairs():
    """RPC's pairwise probabilities of a PL model are sigmoid(log-weight differences): dividing their logits by T is
    exactly the PL model with log-weights / T, so the pairwise likelihood recovers T as well."""
    rng = np.random.default_rng(2)
    model = _pl(rng)
    ranks = _draw_pl(model.temper(TRUE_T), rng)
    fit = fit_distribution_temperature(PairwiseOnly(model.pairwise()), ranks)
    assert fit.temperature == pytest.approx(TRUE_T, rel=0.05)


def test_rank_classifier_temperature_is_recovered():
    rng = np.random.default_rng(3)
    orderings = all_orderings(3)
    model = RankCategorical.from_unseen_mass(orderings, rng.normal(size=(N_DRAWS, 6)) * 3.0, 0.0)
    ranks = _draw_categorical(model.temper(TRUE_T).seen_probs, orderings, rng)
    assert fit_distribution_temperature(model, ranks).temperature == pytest.approx(TRUE_T, rel=0.05)


def test_a_flat_likelihood_keeps_temperature_one():
    """theta = 0 (uniform) does not depend on T: T stays 1 rather than wherever the search stopped."""
    model = Mallows(np.arange(4), 0.0, n=50)
    ranks = orderings_to_ranks(np.random.default_rng(4).permuted(np.tile(np.arange(4), (50, 1)), axis=1))
    assert fit_distribution_temperature(model, ranks).temperature == 1.0


# ------------------------------------------------------------------------------------------------ what T does
def test_temperature_one_is_the_distribution_itself():
    for name, dist in _every_kind(np.random.default_rng(5)).items():
        assert dist.temper(1.0) is dist, name
        assert dist.temper(1) is dist, name


def test_tempering_is_each_models_natural_parameter():
    rng = np.random.default_rng(6)
    kinds = _every_kind(rng)
    pl = kinds["pl"]
    lw = pl.log_weights
    np.testing.assert_allclose(pl.temper(2.0).pairwise()[:, 0, 1], 1 / (1 + np.exp(-(lw[:, 0] - lw[:, 1]) / 2.0)),
                               rtol=1e-12)
    assert kinds["mallows"].temper(4.0).theta == pytest.approx(0.2)
    p = kinds["pairwise"].P[:, 1, 2]
    np.testing.assert_allclose(kinds["pairwise"].temper(0.5).P[:, 1, 2], 1 / (1 + ((1 - p) / p) ** 2), rtol=1e-10)
    rc = kinds["rc_unseen_mass"]
    hot = rc.temper(3.0)
    np.testing.assert_allclose(hot.unseen_mass, rc.unseen_mass)  # RankClassifier's unseen mass is a constant
    np.testing.assert_allclose(hot.seen_probs.sum(axis=1), 1 - rc.unseen_mass)
    assert hot.seen_probs.max() < rc.seen_probs.max()  # flatter
    # Every tempered distribution is still a distribution: top-1 marginals sum to 1.
    for name, dist in kinds.items():
        if dist.max_top_k >= 1:
            np.testing.assert_allclose(dist.temper(1.7).top_k(np.arange(4)[:, None]).sum(axis=1), 1.0, atol=1e-9,
                                       err_msg=name)


def test_the_vectorised_likelihood_equals_tempering_then_scoring():
    rng = np.random.default_rng(7)
    for name, dist in _every_kind(rng).items():
        ranks = _draw_pl(PlackettLuce(rng.normal(size=(dist.n, dist.m))), rng)
        if name in ("rc_unseen_mass", "rc_rest_logit", "explicit"):
            ranks = orderings_to_ranks(all_orderings(4)[rng.integers(0, 10, dist.n)])  # observed classes
        nll = dist.temperature_nll(ranks)
        for t in (0.4, 1.0, 3.0):
            # (rel 1e-9: the tempered RPC probabilities round-trip through sigmoid and logit near 0 and 1)
            assert nll(t) == pytest.approx(-np.mean(dist.temper(t).log_likelihood(ranks)), rel=1e-9), (name, t)


def test_tempering_never_moves_the_modal_ranking():
    rng = np.random.default_rng(8)
    for name, dist in _every_kind(rng).items():
        true = _draw_pl(PlackettLuce(rng.normal(size=(dist.n, dist.m))), rng)
        before = ranking_evaluation(dist, true, full_rank=False, max_k=2)
        for t in (0.05, 0.5, 2.5, 80.0):
            tempered = dist.temper(t)
            np.testing.assert_array_equal(tempered.mode_ranks(), dist.mode_ranks(), err_msg=f"{name} T={t}")
            after = ranking_evaluation(tempered, true, full_rank=False, max_k=2)
            assert after.metrics["rank/kendall_tau"] == before.metrics["rank/kendall_tau"]
    # For PL it is the same ranking mathematically, not only by keeping it: the tempered weights sort the same way.
    pl = PlackettLuce(rng.normal(size=(50, 6)))
    np.testing.assert_array_equal(np.argsort(-pl.temper(3.0).log_weights, axis=1), np.argsort(-pl.log_weights, axis=1))


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "hot"])
def test_a_bad_temperature_is_one_line(bad):
    with pytest.raises(UserError, match="temperature must be a finite number > 0") as info:
        PlackettLuce(np.zeros((1, 3)) + [0.0, 1.0, 2.0]).temper(bad)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------ the split
def test_the_calibration_share_is_random_and_disjoint_from_fit_and_test_rows():
    n = 150
    shares = []
    for fold, (train_idx, test_idx) in enumerate(KFold(5, shuffle=True, random_state=0).split(np.zeros(n))):
        fit_idx, cal_idx = calibration_split(train_idx, 0.2, seed=0, fold=fold)
        assert len(cal_idx) == round(0.2 * len(train_idx)) and len(fit_idx) + len(cal_idx) == len(train_idx)
        assert not set(cal_idx) & set(fit_idx) and not set(cal_idx) & set(test_idx)
        assert set(cal_idx) | set(fit_idx) == set(train_idx)
        assert not np.array_equal(cal_idx, np.sort(train_idx)[-len(cal_idx):])  # not the reference's tail slice
        again = calibration_split(train_idx, 0.2, seed=0, fold=fold)
        assert all(np.array_equal(a, b) for a, b in zip(again, (fit_idx, cal_idx)))  # seeded
        shares.append(cal_idx)
    other_seed = calibration_split(KFold(5, shuffle=True, random_state=0).split(np.zeros(n)).__next__()[0], 0.2,
                                   seed=1, fold=0)[1]
    assert not np.array_equal(other_seed, shares[0])
    with pytest.raises(UserError, match="cal_fraction=0.01 leaves 0 calibration"):
        calibration_split(np.arange(40), 0.01, seed=0, fold=0)


# ------------------------------------------------------------------------------------------------ KL / Jeffreys
def test_kl_and_jeffreys_keys_equal_binary_ece_on_the_same_events():
    rng = np.random.default_rng(9)
    n, m = 120, 4
    dist = PlackettLuce(rng.normal(size=(n, m)) * 1.5)
    true = _draw_pl(PlackettLuce(dist.log_weights * 0.6), rng)
    plain = ranking_evaluation(dist, true, full_rank=False, max_k=3)
    both = ranking_evaluation(dist, true, full_rank=False, max_k=3, divergences=["kl", "jeff"])
    assert {k: v for k, v in both.metrics.items() if k in plain.metrics} == plain.metrics  # ece keys untouched
    for kind, k in (("sub", 2), ("sub", 3), ("top", 1), ("top", 2), ("top", 3)):
        events = sub_k_events(true, k) if kind == "sub" else top_k_events(true, k)
        labels = event_labels(kind, true, events)
        probs = dist.sub_k(events) if kind == "sub" else dist.top_k(events)
        for name in ("kl", "jeff", "abs"):
            expected = binary_ece(labels, probs, discrepancy=name).ece.mean()
            key = f"rank/{kind}_{k}/{'ece' if name == 'abs' else name}"
            assert both.metrics[key] == pytest.approx(expected, rel=1e-12, abs=1e-15), key
    # One binning pass for all: the extra discrepancies equal separate calls exactly.
    events = sub_k_events(true, 2)
    labels, probs = event_labels("sub", true, events), dist.sub_k(events)
    once = binary_ece(labels, probs, also=("kl", "jeff", "abs"))
    for name in ("kl", "jeff", "abs"):
        np.testing.assert_array_equal(once.also[name], binary_ece(labels, probs, discrepancy=name).ece)
    with pytest.raises(UserError, match="divergences='l2' is invalid"):
        ranking_evaluation(dist, true, full_rank=False, divergences=["l2"])


# ------------------------------------------------------------------------------------------------ through the run
def _run(tmp_path, method, *args):
    argv = [f"paths.output_root={tmp_path / 'outputs'}", f"paths.cache_dir={tmp_path / 'cache'}", "progress=false",
            "dataset=label_ranking/iris", f"method={method}", f"paths.label_ranking_dir={FIXTURES}",
            "metric.diagrams=false", f"hydra.run.dir={tmp_path / method}", *args]
    proc = run_entry_point(ROOT / "train.py", argv, tmp_path)
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / method
    return (json.loads((folder / "metrics.json").read_text())["iris"],
            json.loads((folder / "metrics_per_fold.json").read_text()),
            json.loads((folder / "status.json").read_text()))


# Recorded from the code before recalibration existed (commit ff8168c), iris fixture, seed 0, 5 folds.
TODAY_RPC = {"rank/kendall_tau": 0.9155555555555555, "rank/footrule": 0.2533333333333333,
             "rank/footrule_norm": 0.06333333333333332, "rank/top1_accuracy": 0.9733333333333333,
             "rank/sub_2/ece": 0.1588844044537973, "rank/sub_2/n_events": 6.0,
             "rank/full/sub_2/ece": 0.21949532303912492, "rank/full/sub_2/n_subsets": 3.0,
             "n_folds": 5, "n_samples": 150, "n_items": 3}
TODAY_MALLOWS = {"rank/kendall_tau": 0.008888888888888832, "rank/sub_2/ece": 0.13734924127474385,
                 "rank/top_1/ece": 0.10628600092066662, "rank/full/sub_2/ece": 0.2746984824759245,
                 "rank/sub_3/ece": 0.10363994106648886, "rank/full/top_2/ece": 0.6232434062453411}


def test_recalibration_off_gives_todays_numbers(tmp_path):
    block, _, status = _run(tmp_path, "rpc", "metric.ranking.recalibrate=false", "metric.ranking.divergences=[]")
    # to the last bits: another CPU's kernels (AVX-512 against the AVX2 machine that wrote them) round differently
    assert {k: v for k, v in block.items() if not k.endswith("_std")} == pytest.approx(TODAY_RPC, rel=1e-12)
    assert "recalibration" not in status
    block, _, _ = _run(tmp_path, "mallows", "metric.ranking.recalibrate=false")  # divergences only add keys
    assert {k: block[k] for k in TODAY_MALLOWS} == pytest.approx(TODAY_MALLOWS, rel=1e-12)
    assert "rank/sub_2/kl" in block and "rank/top_2/jeff" in block
    assert not any(k.startswith("recal/") for k in block)


def test_a_recalibrated_run_reports_raw_and_tempered_metrics(tmp_path):
    block, per_fold, status = _run(tmp_path, "mallows")
    assert block["n_folds"] == 5 and block["recal/temperature"] > 0 and "recal/temperature_std" in block
    for key in ("rank/sub_2/ece", "rank/sub_2/kl", "rank/sub_2/jeff", "rank/top_1/ece", "rank/full/top_2/ece"):
        assert f"recal/{key}" in block and f"recal/{key}_std" in block
    folds = status["recalibration"]["folds"]
    assert status["recalibration"]["cal_fraction"] == 0.2 and len(folds) == 5
    assert all(f["calibration_rows"] == 24 for f in folds)  # 20 % of 120 training rows
    for fold, record in zip(per_fold, folds):
        assert fold["recal/temperature"] == record["temperature"]
        assert fold["recal/rank/kendall_tau"] == fold["rank/kendall_tau"]  # the mode never moves
        assert fold["recal/cal_nll"] <= fold["recal/cal_nll_raw"]
    # The before/after table reads the folder: one row, raw -> recalibrated, the fitted temperature.
    import importlib.util

    script = ROOT / "scripts" / "label_ranking_recalibration_table.py"
    spec = importlib.util.spec_from_file_location("recal_table", script)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    (row,) = table.collect(table.find_runs([tmp_path / "mallows"]))
    assert (row["dataset"], row["learner"], row["largest_k"]) == ("iris", "mallows", "top_2")
    assert row["temperature"] == pytest.approx(block["recal/temperature"])
    assert (row["sub2_ece_raw"], row["sub2_ece_recal"]) == (block["rank/sub_2/ece"], block["recal/rank/sub_2/ece"])
    assert (row["big_kl_raw"], row["big_jeff_recal"]) == (block["rank/top_2/kl"], block["recal/rank/top_2/jeff"])
    assert "| iris | 3 | MM |" in table.markdown([row])


def test_a_bad_calibration_fraction_is_one_line(tmp_path):
    argv = [f"paths.output_root={tmp_path / 'outputs'}", "progress=false", "dataset=label_ranking/iris",
            "method=mallows", f"paths.label_ranking_dir={FIXTURES}", "metric.ranking.cal_fraction=1.5"]
    proc = run_entry_point(ROOT / "train.py", argv, tmp_path)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "metric.ranking.cal_fraction=1.5 is invalid: a fraction in (0, 1)" in lines[0]
