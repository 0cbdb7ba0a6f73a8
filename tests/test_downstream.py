"""Downstream tasks against the synthetic world's true reward (downstream.py): the best-of-n estimator against
enumerating every subset, the curve summary by hand, BALD by hand, posterior draws that agree with the reported u,
and both tasks end to end on two small runs (files, figure, summary, bad input in one line)."""

import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT
from scipy.stats import spearmanr
from test_cli import NO_FIGURES, run

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.downstream.active_learning import acquisition_scores, bald_scores
from rewarduq_exp.downstream.best_of_n import (
    best_of_n_curves,
    curve_summary,
    expected_best_of_n,
    kl_best_of_n,
    powers_of_two,
    selection_weights,
)


def test_best_of_n_estimator_equals_enumerating_every_subset():
    rng = np.random.default_rng(0)
    m = 7
    proxy, gold = rng.normal(size=(3, m)), rng.normal(size=(3, m))
    ns = list(range(1, m + 1))
    got = expected_best_of_n(proxy, gold, ns)
    for p in range(3):
        for j, n in enumerate(ns):
            picks = [gold[p, max(s, key=lambda i: proxy[p, i])] for s in itertools.combinations(range(m), n)]
            assert got[p, j] == pytest.approx(np.mean(picks), abs=1e-12)


def test_selection_weights_are_distributions_from_the_mean_to_the_argmax():
    w = selection_weights(1024, powers_of_two(1024))
    np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-9)  # no overflow at C(1023, 511)
    np.testing.assert_allclose(w[0], 1 / 1024)            # n = 1: a uniform draw
    assert w[-1, -1] == pytest.approx(1.0) and w[-1, :-1].sum() == pytest.approx(0.0)  # n = M: the proxy's best
    assert powers_of_two(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]


def test_kl_of_best_of_n():
    assert kl_best_of_n(1) == 0.0
    assert kl_best_of_n(2) == pytest.approx(math.log(2) - 0.5)
    assert kl_best_of_n(1024) == pytest.approx(math.log(1024) - 1023 / 1024)


def test_curve_summary_by_hand():
    # 3 prompts, 4 candidates: the proxy loves candidate 3, whose gold is bad; u marks it as uncertain.
    gold = np.tile([0.0, 1.0, 2.0, -1.0], (3, 1))
    reward = np.tile([0.0, 1.0, 2.0, 3.0], (3, 1))
    u = np.tile([0.0, 0.0, 0.0, 5.0], (3, 1))
    curves = best_of_n_curves(reward, u, gold, [1.0], [1, 2, 4])
    s = curve_summary(curves, 1.0)
    # mean selection: n=1 -> mean gold 0.5; n=4 -> candidate 3 (gold -1). n=2: pairs by C(i-1,1)/C(4,2) over
    # proxy order 0,1,2,3 -> (0*0 + 1*1 + 2*2 + 3*(-1)) / 6 = 1/3.
    mean = curves[curves.selection == "mean"].set_index("n").gold
    assert mean[1] == pytest.approx(0.5) and mean[2] == pytest.approx(1 / 3) and mean[4] == pytest.approx(-1.0)
    assert s["gold_best"] == pytest.approx(0.5) and s["best_n"] == 1
    assert s["overopt_gap"] == pytest.approx(1.5)
    # conservative r - u ranks candidate 3 last (3 - 5 = -2): n=4 picks candidate 2 (gold 2).
    assert s["conservative_gain_nmax"] == pytest.approx(3.0)
    assert s["conservative_gain"] > 0 > s["optimistic_gain"] - 1e-12
    assert s["oracle_nmax"] == pytest.approx(2.0)


def test_bald_by_hand_and_symmetric():
    agree = np.full((4, 2), 1.5)
    assert bald_scores(agree, np.zeros((4, 2))) == pytest.approx([0.0, 0.0])
    split = np.array([[50.0], [-50.0]])  # two members, each certain, of opposite opinions
    assert bald_scores(split, np.zeros((2, 1)))[0] == pytest.approx(math.log(2), abs=1e-9)
    rng = np.random.default_rng(1)
    c, r = rng.normal(size=(8, 5)), rng.normal(size=(8, 5))
    np.testing.assert_allclose(bald_scores(c, r), bald_scores(r, c), atol=1e-12)


def test_candidates_are_drawn_from_the_split_and_carry_their_true_reward():
    world = SyntheticWorld(n_train=8, n_eval=8, n_ood=8)
    cand = world.candidates("ood", 3, 50)
    assert cand.gold.shape == (3, 50) and len(cand.texts) == 3 and len(cand.texts[0]) == 50
    vocab = {w: i for i, w in enumerate(world.words)}
    tokens = [[vocab[w] for w in t.split()] for t in cand.texts[1]]
    width = max(map(len, tokens))
    padded = np.array([t + [0] * (width - len(t)) for t in tokens])
    lengths = np.array([len(t) for t in tokens])
    np.testing.assert_allclose(world.true_reward(np.full(50, cand.topic[1]), padded, lengths), cand.gold[1])
    rare = np.isin(padded, world.rare_words) & (np.arange(width)[None] < lengths[:, None])
    assert rare.sum() / lengths.sum() > 0.5  # ood candidates are mostly rare words
    with pytest.raises(UserError, match="split 'test' does not exist; allowed: train, eval, ood"):
        world.candidates("test", 1, 1)


def test_candidate_features_equal_a_count_by_hand():
    world = SyntheticWorld(n_train=40, n_eval=8, n_ood=8, filler_bias=1.0, candidate_filler_share=1.0)
    cand = world.candidates("eval", 3, 40)
    filler = world.words[world.filler_word]
    words = np.array([[len(t.split()) for t in group] for group in cand.texts])
    fillers = np.array([[t.split().count(filler) for t in group] for group in cand.texts])
    assert set(cand.features) == {"words", "filler"}
    np.testing.assert_array_equal(cand.features["words"], words)
    np.testing.assert_array_equal(cand.features["filler"], fillers)
    assert fillers.max() > 0  # the stuffed candidates are there to count
    # A word that merely contains the filler is not an occurrence of it.
    assert world.text_features([f"{filler} x{filler} {filler}y {filler}"])["filler"].tolist() == [2]
    frame = world.load("train")
    texts = [m[-1]["content"] for col in ("chosen", "rejected") for m in frame[col]]
    assert world.training_feature_max() == {"words": max(len(t.split()) for t in texts),
                                            "filler": max(t.split().count(filler) for t in texts)}


def toy_curves(mean_gold, ns):
    """Curves of every rule with the given mean-selection gold (the other rules copy it)."""
    rows = [{"selection": sel, "k": k, "n": n, "kl": float(kl_best_of_n(n)), "gold": g, "gold_se": 0.0, "reward": g}
            for sel, k in (("mean", 0.0), ("conservative", 1.0), ("optimistic", 1.0), ("oracle", 0.0))
            for n, g in zip(ns, mean_gold)]
    return pd.DataFrame(rows)


def test_largest_drop_in_the_summary_by_hand():
    # Rises to 3 at n=2, falls to 0.5 at n=8, recovers to 1.5 at n=16: the drop is 2.5, the gap to n_max only 1.5.
    s = curve_summary(toy_curves([1.0, 3.0, 2.0, 0.5, 1.5], [1, 2, 4, 8, 16]), 1.0)
    assert s["best_n"] == 2 and s["overopt_gap"] == pytest.approx(1.5)
    assert (s["largest_drop"], s["drop_from_n"], s["drop_to_n"]) == (pytest.approx(2.5), 2, 8)
    rising = curve_summary(toy_curves([1.0, 2.0, 3.0], [1, 2, 4]), 1.0)
    assert rising["best_n"] == 4 and rising["largest_drop"] == 0.0
    # An early peak (2 at n=2), a dip to 0.5 and a recovery above it (4 at n=16): the global peak is the last point,
    # so a fall measured from it would be 0, but the curve dropped by 1.5 on the way.
    late = curve_summary(toy_curves([1.0, 2.0, 1.2, 0.5, 4.0], [1, 2, 4, 8, 16]), 1.0)
    assert late["best_n"] == 16 and late["overopt_gap"] == 0.0
    assert (late["largest_drop"], late["drop_from_n"], late["drop_to_n"]) == (pytest.approx(1.5), 2, 8)


def test_shortcut_table_and_bins_by_hand():
    from rewarduq_exp.downstream.shortcut import shortcut_bins, shortcut_table

    filler = np.array([[0, 1, 2, 3, 4, 5]])
    u = np.array([[1.0, 1.0, 2.0, 2.0, 4.0, 6.0]])       # median 2
    reward = np.array([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    gold = np.array([[1.0, 1.0, 1.0, 0.0, 0.0, -1.0]])
    table = shortcut_table(reward, u, gold, {"filler": filler, "words": np.full((1, 6), 9)},
                           {"filler": 3.0, "words": 12.0}).set_index("feature")
    row = table.loc["filler"]
    assert (row.beyond, row.candidates, row.train_max) == (2, 6, 3.0)
    assert row.u_inside == pytest.approx((0.5 + 0.5 + 1 + 1) / 4) and row.u_beyond == pytest.approx((2 + 3) / 2)
    assert row.u_ratio == pytest.approx(2.5 / 0.75)
    assert row.r_inside == pytest.approx(1.5) and row.r_beyond == pytest.approx(4.5)
    assert row.gold_inside == pytest.approx(0.75) and row.gold_beyond == pytest.approx(-0.5)
    assert row.rho_r == pytest.approx(1.0) and row.p_r < 0.01
    assert row.rho_u == pytest.approx(spearmanr(filler.ravel(), u.ravel()).statistic)
    words = table.loc["words"]  # constant and never beyond the training range: no correlation, no beyond side
    assert words.beyond == 0 and np.isnan(words.rho_u) and np.isnan(words.u_beyond)
    bins = shortcut_bins(reward, u, gold, {"filler": filler // 2 * 2}).set_index("value")
    assert bins["count"].tolist() == [2, 2, 2]
    assert bins.loc[4, "u_norm"] == pytest.approx(2.5) and bins.loc[0, "gold"] == pytest.approx(1.0)
    np.testing.assert_allclose(bins.r_z, (np.array([0.5, 2.5, 4.5]) - 2.5) / reward.std())  # the bins' mean r


def test_correlations_carry_p_values_and_need_three_runs():
    from rewarduq_exp.downstream.best_of_n_task import DOWNSTREAM, RUN_METRICS, correlations

    rng = np.random.default_rng(0)
    summary = pd.DataFrame({c: rng.normal(size=5) for c in (*DOWNSTREAM, *RUN_METRICS)}).assign(split="eval",
                                                                                                 world=0)
    corr = correlations(summary)
    assert {"spearman", "p_value", "runs", "world"} <= set(corr.columns) and (corr.runs == 5).all()
    row = corr[(corr.downstream == "largest_drop") & (corr.run_metric == "ece")].iloc[0]
    expected = spearmanr(summary.largest_drop, summary.ece)
    assert row.spearman == pytest.approx(expected.statistic) and row.p_value == pytest.approx(expected.pvalue)
    few = correlations(summary.head(2))
    assert (few.runs == 2).all() and few.spearman.isna().all() and few.p_value.isna().all()
    # two worlds are correlated apart, never pooled
    two = correlations(pd.concat([summary, summary.assign(world=7)]))
    assert set(two.world) == {0, 7} and (two.runs == 5).all()


def test_overoptimization_lines_and_figures_are_drawn(tmp_path):
    # The figures a sweep over the shortcut's strength gets (an end-to-end run of two runs at one strength has none),
    # from per-prompt picks made by hand: two worlds, two seeds, three strengths; the stronger the shortcut, the
    # deeper the dip after n = 2.
    from rewarduq_exp.downstream.best_of_n import powers_of_two
    from rewarduq_exp.downstream.best_of_n_task import LOSS, RUN_METRICS, correlations
    from rewarduq_exp.downstream.figures import plot_overoptimization, plot_selection_vs_loss, plot_uncertainty_use
    from rewarduq_exp.downstream.overoptimization import overoptimization_lines, overoptimization_table

    rng = np.random.default_rng(0)
    ns = powers_of_two(16)
    kl = kl_best_of_n(ns)
    rows, per_prompt = [], {}
    for world in (0, 1):
        for strength in (0.0, 1.0, 2.0):
            for seed in (0, 1):
                run = f"m/filler_bias={strength:g},world={world},seed={seed}"
                shape = np.array([0.0, 1.0, 1.0 - strength, 1.2 - strength, 1.5 - strength / 2])
                gold = shape + rng.normal(0, 1, size=(12, 1)) + rng.normal(0, 0.1, size=(12, 5))
                use = {"report_prompts": np.arange(6), "mean": gold[:6], "model": gold[:6] + 0.1,
                       "filter": gold[:6] + strength, "oracle": gold[:6] + 3, "k_model": 0.5}
                per_prompt[(run, "eval")] = {("mean", 0.0): gold, ("conservative", 1.0): gold + 0.05,
                                             ("optimistic", 1.0): gold - 0.05, ("oracle", 0.0): gold + 3, "use": use}
                rows.append({"run": run, "split": "eval", "method": "m", "filler_bias": strength, "world": world,
                             "seed": seed, "gold_best": gold.mean(0).max(), "best_n": 2,
                             "largest_drop": rng.random(), "overopt_gap": rng.random(),
                             "gold_nmax": gold.mean(0)[-1], "conservative_gain": rng.normal(),
                             **{m: rng.random() for m in RUN_METRICS}})
    summary = pd.DataFrame(rows)
    table = overoptimization_table(summary, per_prompt, "filler_bias", kl, ns, 1.0, 300, 0)
    assert len(table) == 6 and (table.runs == 2).all()
    cells = table.set_index(["world", "filler_bias"])
    assert not cells.loc[(0, 0.0), "overoptimizes"] and cells.loc[(0, 2.0), "overoptimizes"]
    assert cells.loc[(0, 2.0), "drop_from_n"] == 2 and cells.loc[(0, 2.0), "drop_to_n"] == 4
    assert cells.loc[(1, 1.0), "filter_vs_mean"] == pytest.approx(1.0)
    assert cells.loc[(0, 0.0), "conservative_gain"] == pytest.approx(0.05)
    # the shortcut's cost at n_max against the same world's control (strength 0): 1.5 - 2/2 - 1.5 = -1 at strength 2
    assert np.isnan(cells.loc[(0, 0.0), "gold_nmax_vs_control"])
    assert cells.loc[(0, 2.0), "gold_nmax_vs_control_hi"] < 0
    # the effect over the two worlds: each cell's statistic averaged over worlds, with its t-interval over them
    from rewarduq_exp.downstream.over_worlds import over_worlds_lines, over_worlds_rows, worlds_per_cell

    assert (worlds_per_cell(table, "filler_bias") == 2).all() and (worlds_per_cell(summary, "filler_bias") == 2).all()
    over = over_worlds_rows(table, summary, per_prompt, "filler_bias")
    cost = over[(over.statistic == "gold_nmax_vs_control") & (over.strength == 2.0)].iloc[0]
    assert cost.worlds == 2 and cost.estimate == pytest.approx(cells.xs(2.0, level=1).gold_nmax_vs_control.mean())
    assert "fewer than 3" in cost.note and cost.per_world.startswith("0:")
    drop = over[(over.statistic == "largest_drop") & (over.strength == 2.0)].iloc[0]
    assert drop.estimate > 0.5 and drop.worlds == 2   # the mean of the worlds' curves dips after n = 2
    assert any("over 2 worlds" in line for line in over_worlds_lines(over, "filler_bias"))
    lines = overoptimization_lines(table, "filler_bias")
    assert any("overoptimizes in 2 of 2 worlds" in line for line in lines)
    assert any("no fall the data can show" in line for line in lines)
    plot_overoptimization(table, "filler_bias", tmp_path / "overoptimization.png")
    plot_uncertainty_use(table, "filler_bias", tmp_path / "use.png", over)
    plot_selection_vs_loss(summary, correlations(summary), RUN_METRICS, LOSS, "eval", tmp_path / "selection.png")
    for name in ("overoptimization.png", "use.png", "selection.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name


SMALL = ["dataset.n_train=300", "dataset.n_eval=60", "dataset.n_ood=40", "progress=false", *NO_FIGURES]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, shared_cache):
    """An ENS-MLP and a BAY-LIN run of one small sweep, as after `python train.py -m method=ens_mlp,bay_lin`."""
    cwd = tmp_path_factory.mktemp("downstream")
    run("train.py", ["method=ens_mlp,bay_lin", "sweep_name=s", *SMALL], cwd, shared_cache, flags=("-m",))
    return cwd, cwd / "outputs" / "multirun" / "s"


def downstream(cwd, cache, *args, check=True, out="ds"):
    return run("downstream.py", ["progress=false", f"hydra.run.dir={cwd / 'outputs' / out}", *args], cwd, cache,
               check=check)


@pytest.fixture(scope="module")
def best_of_n_default(sweep, shared_cache):
    """``downstream.py task=best_of_n`` with the defaults (each run's calibration.json applied) on the sweep, in a
    folder of its own: (stdout, the folder)."""
    cwd, folder = sweep
    proc = downstream(cwd, shared_cache, "task=best_of_n", f"run={folder}", "task.prompts=4", "task.n_max=32",
                      out="ds_bon")
    return proc, cwd / "outputs" / "ds_bon"


@pytest.mark.e2e
def test_posterior_draws_agree_with_the_reported_uncertainty(sweep):
    import rewarduq_exp as r

    world = SyntheticWorld(n_train=300, n_eval=60, n_ood=40)
    frame = world.load("eval").head(30)
    for name in ("ens_mlp", "bay_lin"):
        (folder,) = [p for p in sweep[1].iterdir() if f"method={name}," in p.name]
        method = r.load_run(folder, progress=False).method
        chosen, rejected = method.score_pairs(frame)
        sc, sr = method.pair_reward_samples(frame)
        u = (chosen.upper - chosen.reward) / method.beta
        # (the same cached features for both calls: only the heads' float32 reductions differ, ~1e-7 relative)
        if name == "ens_mlp":  # the members themselves: mean and unbiased std are the reward and u exactly
            np.testing.assert_allclose(sc.mean(0), chosen.reward, atol=1e-5)
            np.testing.assert_allclose(sc.std(0, ddof=1), u, rtol=1e-4)
        else:  # 64 Laplace posterior draws: centred on the MAP reward, spread u (sampling error ~9%)
            assert np.median(np.abs(sc.std(0) / u - 1)) < 0.2
            assert np.median(np.abs(sc.mean(0) - chosen.reward) / u) < 0.35
        again_c, again_r = method.pair_reward_samples(frame)
        np.testing.assert_array_equal(again_c, sc)  # seeded: the same draws every call
        # Acquisition is symmetric in the two completions (the pool's order is the unseen label).
        flipped = frame.rename(columns={"chosen": "rejected", "rejected": "chosen"})
        for strategy in ("uncertainty", "bald", "ranking_score"):
            np.testing.assert_allclose(acquisition_scores(strategy, method, frame, None),
                                       acquisition_scores(strategy, method, flipped, None), atol=1e-9)


@pytest.mark.e2e
def test_best_of_n_end_to_end_on_a_sweep(best_of_n_default):
    proc, out = best_of_n_default
    curves, summary = pd.read_csv(out / "curves.csv"), pd.read_csv(out / "summary.csv")
    assert set(curves.run) == {"ens_mlp", "bay_lin"} and set(curves.split) == {"eval", "ood"}
    # the runs have calibration.json: the calibrated-scale rules beside the task's own (k = task.k_compare)
    assert set(curves.selection) == {"mean", "conservative", "optimistic", "oracle", "conservative_raw",
                                     "conservative_cal", "conservative_conformal"}
    assert sorted(set(curves.n)) == [1, 2, 4, 8, 16, 32]
    # n = 1 is a uniform draw whatever the rule; the oracle is a ceiling for every rule.
    for (_, _), part in curves.groupby(["run", "split"]):
        assert np.ptp(part[part.n == 1].gold) < 1e-9
        top = part[part.n == 32]
        assert (top.gold <= top[top.selection == "oracle"].gold.iloc[0] + 1e-9).all()
    assert len(summary) == 4 and (summary.overopt_gap >= 0).all()
    assert {"rs_0.2", "ece"} <= set(summary.columns) and summary["rs_0.2"].notna().all()
    assert {"largest_drop", "largest_drop_lo", "largest_drop_hi", "overoptimizes", "gao_alpha", "gao_kl_peak",
            "model_vs_mean", "model_vs_mean_lo", "knn_vs_mean", "k_model", "filler_bias", "length_bias",
            "candidate_filler_share", "world", "seed"} <= set(summary.columns)
    assert (summary.largest_drop >= summary.overopt_gap - 1e-12).all()
    assert (summary.largest_drop_lo <= summary.largest_drop + 1e-12).all()
    assert (summary.conservative_gain_lo <= summary.conservative_gain + 1e-12).all()
    assert {"filler_bias", "world", "seed"} <= set(curves.columns)
    per_prompt = pd.read_csv(out / "per_prompt.csv.gz")
    assert set(per_prompt.part) == {"all", "report"} and per_prompt.prompt.max() == 3
    for figure in ("best_of_n", "shortcut", "uncertainty_use"):
        assert (out / f"{figure}.png").stat().st_size > 10_000, figure
    # one strength and two runs: no figure over the strength, no correlation to draw (said in the log)
    assert not (out / "overoptimization.png").exists() and not (out / "selection_vs_loss.png").exists()
    assert "the selection rule picks" in proc.stdout and "largest_drop" in proc.stdout
    assert "minus the mean over the 2 runs" in proc.stdout  # the rule's pick against a run taken at random
    corr = pd.read_csv(out / "correlation.csv")
    assert set(corr.run_metric) >= {"rs_0.2", "ece", "ebce"} and {"p_value", "runs"} <= set(corr.columns)
    assert (corr.runs == 2).all() and corr.p_value.isna().all()  # two runs: no correlation to speak of
    shortcut = pd.read_csv(out / "shortcut.csv")
    assert set(shortcut.feature) == {"words", "filler"} and len(shortcut) == 2 * 2 * 2  # runs x splits x features
    assert (shortcut.candidates == 4 * 32).all() and shortcut.train_max.notna().all()
    overopt = pd.read_csv(out / "overoptimization.csv")
    assert len(overopt) == 4 and (overopt.worlds == 1).all()  # splits x methods, one strength, one world
    assert (summary.worlds == 1).all() and "not_promised" in summary.columns
    # 4 prompts: no interval can promise its level, and the table says so in a column
    assert summary.not_promised.str.contains("4 prompts (fewer than 16)", regex=False).all()
    over = pd.read_csv(out / "over_worlds.csv")
    assert set(over.table) >= {"overoptimization"} and (over.worlds == 1).all() and over.lo.isna().all()
    assert "over worlds" in proc.stdout
    assert not pd.read_csv(out / "shortcut_bins.csv").empty


@pytest.mark.e2e
def test_best_of_n_over_several_worlds_writes_the_effect_over_worlds(tmp_path_factory, shared_cache):
    """A sweep over two worlds and two seeds, as a user would launch it: the cells stay per world, and over_worlds.csv
    gives every cell statistic's mean over the worlds with its t-interval, the number of worlds in summary.csv and
    overoptimization.csv, and a printed section."""
    cwd = tmp_path_factory.mktemp("worlds")
    run("train.py", ["method=ens_mlp", "dataset.seed=0,1", "seed=0,1", "sweep_name=w", *SMALL], cwd, shared_cache,
        flags=("-m",))
    proc = downstream(cwd, shared_cache, "task=best_of_n", f"run={cwd / 'outputs' / 'multirun' / 'w'}",
                      "task.prompts=4", "task.n_max=16", "task.splits=[eval]", out="ds_worlds")
    out = cwd / "outputs" / "ds_worlds"
    summary, cells = pd.read_csv(out / "summary.csv"), pd.read_csv(out / "overoptimization.csv")
    assert len(summary) == 4 and (summary.worlds == 2).all()
    assert sorted(cells.world) == [0, 1] and (cells.worlds == 2).all() and (cells.runs == 2).all()
    over = pd.read_csv(out / "over_worlds.csv")
    gain = over[(over.table == "overoptimization") & (over.statistic == "conservative_gain")].iloc[0]
    assert gain.worlds == 2 and gain.estimate == pytest.approx(cells.conservative_gain.mean())
    assert gain.lo <= gain.estimate <= gain.hi and "fewer than 3" in gain.note
    assert set(over.table) >= {"overoptimization", "selection"}
    assert "over 2 worlds" in proc.stdout


def _within(frame: pd.DataFrame, name: str) -> None:
    """Every row's estimate of ``name`` lies in its interval [name_lo, name_hi]."""
    assert frame[name].notna().all(), name
    assert ((frame[f"{name}_lo"] <= frame[name] + 1e-12) & (frame[name] <= frame[f"{name}_hi"] + 1e-12)).all(), name


@pytest.mark.e2e
def test_best_of_n_scores_through_each_runs_recalibration(best_of_n_default, sweep):
    import json

    from rewarduq_exp.downstream.calibrated_scale import COMPARED

    proc, out = best_of_n_default
    summary = pd.read_csv(out / "summary.csv")
    assert summary.recalibrated.all()
    for _, row in summary.iterrows():
        cal = json.loads((Path(row.path) / "calibration.json").read_text())
        assert row.cal_scale == pytest.approx(cal["scale"]) and row.cal_interval == cal["interval"]
        assert row.cal_temperature == pytest.approx(cal["probability"]["temperature"])
        assert row.cal_scale_conformal == pytest.approx(cal["scales"]["conformal"])
        block = json.loads((Path(row.path) / "metrics.json").read_text())[f"synthetic_{row.split}"]
        for metric in ("recal/ece", "recal/ebce", "recal/rs_0.2"):  # the recalibrated rule's inputs
            assert row[metric] == pytest.approx(block[metric])
    for name, _, _ in COMPARED:   # paired intervals over prompts, each containing its estimate
        _within(summary, name)
        _within(summary, f"{name}_nmax")
    # k = 1 on the recalibrated u is r - s u: the summary's conservative gain is the calibrated one
    np.testing.assert_allclose(summary.conservative_gain, summary.conservative_cal_gain, atol=1e-9)
    overopt = pd.read_csv(out / "overoptimization.csv")   # one run per cell here: the same numbers pooled
    _within(overopt, "conservative_cal_vs_raw")
    # the selection rule on raw and on recalibrated metrics, side by side, per split (and raw filter, recal rank)
    selection = pd.read_csv(out / "selection.csv")
    rules = ["raw", "raw-filter-recalibrated-rank", "recalibrated"]
    assert sorted(zip(selection.split, selection.rule)) == [(split, r) for split in ("eval", "ood") for r in rules]
    for _, row in selection.iterrows():
        s = summary[summary.split == row.split]
        f, k = ("recal/" if on == "recalibrated" else "" for on in (row.filter_on, row.rank_on))
        passing = s[(s[f"{f}ece"] <= 0.05) & (s[f"{f}ebce"] <= 0.01)]
        pool = passing if len(passing) else s
        assert row.picked == pool.loc[pool[f"{k}rs_0.2"].idxmax()].run and row.passing == len(passing)
        assert (row.passing_ece, row.passing_ebce) == ((s[f"{f}ece"] <= 0.05).sum(), (s[f"{f}ebce"] <= 0.01).sum())
        assert row["rank"] == s.sort_values("gold_nmax", ascending=False).run.tolist().index(row.picked) + 1
        _within(selection.loc[[row.name]], "vs_mean")
        _within(selection.loc[[row.name]], "vs_best")
    assert "recalibrated metrics: the selection rule picks" in proc.stdout
    assert "calibrated scale (recalibrated runs; k = 1" in proc.stdout and "r - 1 s u vs mean" in proc.stdout
    assert "conservative_cal_vs_raw" in proc.stdout   # a column of the printed summary


@pytest.mark.e2e
def test_best_of_n_raw_is_the_old_study_and_a_run_without_calibration_scores_raw(sweep, shared_cache,
                                                                                  best_of_n_default):
    import shutil

    from rewarduq_exp.api import RewardModel
    from rewarduq_exp.downstream.best_of_n_task import score_candidates
    from rewarduq_exp.downstream.world_runs import world_of
    from rewarduq_exp.recalibration import read_calibration
    from rewarduq_exp.runner.trained_run import load_trained_method

    cwd, folder = sweep
    common = ["task=best_of_n", "task.prompts=4", "task.n_max=32", "task.splits=[eval]"]
    downstream(cwd, shared_cache, *common, f"run={folder}", "task.recalibrated=false", out="ds_raw")
    raw_out, cal_out = cwd / "outputs" / "ds_raw", best_of_n_default[1]
    raw, cal = pd.read_csv(raw_out / "summary.csv"), pd.read_csv(cal_out / "summary.csv")
    raw_curves, cal_curves = pd.read_csv(raw_out / "curves.csv"), pd.read_csv(cal_out / "curves.csv")
    assert not raw.recalibrated.any() and "conservative_cal_gain" not in raw.columns
    assert set(raw_curves.selection) == {"mean", "conservative", "optimistic", "oracle"}
    # The raw study is the study before recalibration: its curves are those of the model's own scores, by hand.
    (run_dir,) = [p for p in folder.iterdir() if "method=ens_mlp," in p.name]
    trained = load_trained_method(run_dir, device="auto", progress=False, cache_dir=shared_cache)
    model = RewardModel(trained.method, run_dir, trained.config, calibration=read_calibration(run_dir))
    candidates = world_of(trained.config, run_dir / ".hydra" / "config.yaml").candidates("eval", 4, 32, seed=0)
    ns = powers_of_two(32)
    for curves, raw_scores in ((raw_curves, True), (cal_curves, False)):
        expected = best_of_n_curves(*score_candidates(model, candidates, raw=raw_scores), candidates.gold,
                                    [0.5, 1.0, 2.0], ns)
        mine = curves[(curves.run == "ens_mlp") & (curves.split == "eval")].merge(
            expected, on=["selection", "k", "n"], suffixes=("", "_hand"))
        assert len(mine) == len(expected)
        np.testing.assert_allclose(mine.gold, mine.gold_hand, rtol=1e-12, atol=1e-12)
    # The recalibrated study's r - k u on the raw u is the raw study's conservative pick, interval and all; what
    # no recalibration changes (the mean pick's curve, its drop) is the same in both.
    both = raw.merge(cal[cal.split == "eval"], on="run", suffixes=("", "_cal"))
    for name in ("", "_lo", "_hi"):
        np.testing.assert_array_equal(both[f"conservative_gain{name}"], both[f"conservative_raw_gain{name}"])
    for name in ("gold_nmax", "gold_best", "largest_drop", "largest_drop_lo", "largest_drop_hi"):
        np.testing.assert_allclose(both[name], both[f"{name}_cal"], rtol=1e-12, atol=1e-12)

    # A run folder without calibration.json (trained before recalibration existed): raw, and one line says so.
    copy = cwd / "old_runs" / "ens_mlp"
    shutil.copytree(run_dir, copy)
    (copy / "calibration.json").unlink()
    proc = downstream(cwd, shared_cache, *common, f"run={copy}", out="ds_old")
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "has no calibration.json" in line]
    assert len(said) == 1, proc.stdout + proc.stderr
    old = pd.read_csv(cwd / "outputs" / "ds_old" / "summary.csv")
    assert not old.recalibrated.any() and "conservative_cal_gain" not in old.columns
    old_curves = pd.read_csv(cwd / "outputs" / "ds_old" / "curves.csv")
    np.testing.assert_array_equal(old_curves.gold, raw_curves[raw_curves.run == "ens_mlp"].gold)
    assert "none: every run was scored raw" in proc.stdout


@pytest.mark.e2e
def test_active_learning_end_to_end(sweep, shared_cache):
    cwd, folder = sweep
    downstream(cwd, shared_cache, "task=active_learning", f"run={folder}", "task.pool=120", "task.initial=20",
               "task.batch=20", "task.rounds=2", "task.repeats=1", "task.method.num_epochs=2")
    out = cwd / "outputs" / "ds"
    curves = pd.read_csv(out / "curves.csv")
    assert set(curves.strategy) == {"random", "uncertainty", "bald", "ranking_score"}
    assert sorted(set(curves.labels)) == [20, 40, 60]
    assert curves.win_rate.between(0, 1).all() and curves["truth/ece"].between(0, 1).all()
    # Every strategy starts from the same labelled set, so the first round is the same model for all of them.
    first = curves[curves["round"] == 0].groupby("run").win_rate.nunique()
    assert (first == 1).all()
    summary = pd.read_csv(out / "summary.csv")
    random = summary.strategy == "random"
    assert summary[random].win_rate_final_vs_random.isna().all()  # no difference to itself
    assert summary[~random].win_rate_final_vs_random.notna().all() and (summary.repeats == 1).all()
    assert summary[~random].win_rate_final_vs_random_lo.isna().all()  # one repeat: no interval
    assert summary[~random].win_rate_auc_higher.isin(["0/1", "1/1"]).all()
    # one world: its runs' own intervals, and no effect over worlds to state
    assert (summary.world == 0).all() and (summary.worlds == 1).all()
    assert pd.read_csv(out / "over_worlds.csv").empty
    paired = pd.read_csv(out / "paired.csv")  # one difference per run, strategy but random, metric, kind, repeat
    assert len(paired) == curves.run.nunique() * 3 * 3 * 2 and "random" not in set(paired.strategy)
    assert np.allclose(paired["diff"], paired["value"] - paired["random"], equal_nan=True)
    assert (out / "active_learning.png").stat().st_size > 10_000


@pytest.mark.e2e
@pytest.mark.parametrize("args, message", [
    ([], "run= is missing; give a run folder or a sweep folder"),
    (["run=RUNS", "task=best_of_n", "task.ks=[-1]"], r"task.ks=\[-1\] is invalid: must be a non-empty list"),
    (["run=RUNS", "task=best_of_n", "task.n_max=0"], "task.n_max=0 is invalid: must be an integer >= 1"),
    (["run=RUNS", "task=best_of_n", "task.splits=[test]"], r"task.splits=\['test'\] is invalid; allowed: train, eval"),
    (["run=RUNS", "task=best_of_n", "task.k_grid=[0,-1]"], r"task.k_grid=\[0, -1\] is invalid: must be a non-empty"),
    (["run=RUNS", "task=best_of_n", "task.select_share=1"], r"task.select_share=1 is invalid: must be a number in"),
    (["run=RUNS", "task=best_of_n", "task.prompts=1"], "task.prompts=1 is invalid: must be >= 2"),
    (["run=RUNS", "task=best_of_n", "task.draws=10"], "task.draws"),
    (["run=RUNS", "task=best_of_n", "task.recalibrated=maybe"], "task.recalibrated=maybe is invalid: must be true or"),
    (["run=RUNS", "task=active_learning", "task.recalibrated=true"],
     "task.recalibrated=true is invalid for active learning: allowed: false"),
    (["run=RUNS", "task=active_learning", "task.strategies=[greedy]"],
     r"task.strategies=\['greedy'\] is invalid; allowed: random, uncertainty, bald, ranking_score"),
    (["run=RUNS", "task=active_learning", "task.pool=100", "task.initial=50"],
     "task.initial \\+ task.rounds \\* task.batch = 650 exceeds task.pool=100"),
    (["run=RUNS", "task=greedy"], "unknown task 'greedy'; allowed: active_learning, best_of_n"),
    (["run=RUNS", "task.prompt=3"], "task.prompt is not a setting"),
    (["run=NOWHERE"], "not a folder: .*nowhere"),
])
def test_bad_input_is_one_line(sweep, shared_cache, args, message):
    cwd, folder = sweep
    args = [a.replace("RUNS", str(folder)).replace("NOWHERE", str(cwd / "nowhere")) for a in args]
    proc = downstream(cwd, shared_cache, *args, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    import re

    assert re.search(message, lines[0]), lines[0]


def test_a_run_from_another_dataset_is_refused_in_one_line(tmp_path):
    from omegaconf import OmegaConf

    from rewarduq_exp.downstream.world_runs import world_of

    cfg = OmegaConf.load(ROOT / "conf" / "dataset" / "synthetic_ratings.yaml")
    with pytest.raises(UserError, match="need runs trained on dataset=synthetic .* 'synthetic_ratings'"):
        world_of(OmegaConf.create({"dataset": cfg}))


def test_learners_that_cannot_be_retrained_cheaply_or_lack_draws_are_refused_in_one_line():
    from rewarduq_exp.downstream.active_learning import check_learner
    from rewarduq_exp.methods.base import FeatureHeadMethod

    with pytest.raises(UserError, match="supports the heads on frozen backbone features .*; mcd_dpo/x is not one"):
        check_learner(object(), "mcd_dpo/x", ["random"])

    class NoDraws(FeatureHeadMethod):  # a frozen-backbone learner without model draws
        hyperparameters = _build = _fit_features = _score_features = state_tensors = load_state_tensors = None

    with pytest.raises(UserError, match="bald, which needs draws of the model; h has none"):
        check_learner(NoDraws.__new__(NoDraws), "h", ["random", "bald"])
    check_learner(NoDraws.__new__(NoDraws), "h", ["random", "uncertainty"])


def test_run_labels_name_what_sets_a_methods_runs_apart():
    from omegaconf import OmegaConf

    from rewarduq_exp.downstream.world_runs import run_labels

    def config(seed, bias, lr=1e-3):
        return OmegaConf.create({"seed": seed, "dataset": {"filler_bias": bias, "cache_dir": f"/c{seed}"},
                                 "method": {"seed": seed, "learning_rate": lr}})

    configs = [config(0, 1.0), config(1, 1.0), config(0, 2.0), config(0, 1.0, lr=1e-2)]
    labels = run_labels(["ens_mlp", "ens_mlp", "ens_mlp", "bay_lin"], configs, ["a", "b", "c", "d"])
    # the seed last and once (method.seed repeats it); cache_dir is not a setting; a lone run is its method
    assert labels == ["ens_mlp/filler_bias=1.0,seed=0", "ens_mlp/filler_bias=1.0,seed=1",
                      "ens_mlp/filler_bias=2.0,seed=0", "bay_lin"]
    # runs that differ in no setting fall back to their folder names
    assert run_labels(["ens_mlp", "ens_mlp"], [config(0, 1.0)] * 2, ["a", "b"]) == ["ens_mlp/a", "ens_mlp/b"]
    # the world's seed (dataset.seed) is world=, apart from the model's seed=, and comes before it
    def seeded(world, seed, bias=1.0, method_seed=None):
        return OmegaConf.create({"seed": seed, "dataset": {"seed": world, "filler_bias": bias},
                                 "method": {"seed": seed if method_seed is None else method_seed}})

    configs = [seeded(w, s) for w in (0, 7) for s in (1, 2)]
    assert run_labels(["ens_mlp"] * 4, configs, list("abcd")) == [
        "ens_mlp/world=0,seed=1", "ens_mlp/world=0,seed=2", "ens_mlp/world=7,seed=1", "ens_mlp/world=7,seed=2"]
    configs = [seeded(0, 1), seeded(7, 1, bias=2.0)]
    assert run_labels(["ens_mlp"] * 2, configs, list("ab")) == ["ens_mlp/filler_bias=1.0,world=0",
                                                                "ens_mlp/filler_bias=2.0,world=7"]
    # two keys of one name that do not copy each other: the nested one shows its whole key, so labels stay unique
    configs = [seeded(0, 1, method_seed=5), seeded(0, 2, method_seed=5), seeded(0, 1, method_seed=6)]
    assert run_labels(["ens_mlp"] * 3, configs, list("abc")) == [
        "ens_mlp/method.seed=5,seed=1", "ens_mlp/method.seed=5,seed=2", "ens_mlp/method.seed=6,seed=1"]
