"""task=active_learning's comparison with random, paired by repeat (every strategy of a repeat starts from the same
initial set and model seed): the paired t-interval by hand and against scipy, its coverage in a simulation where
the repeats share a large effect (and how much narrower it is than the unpaired interval there), summary_rows'
columns, and the figure drawn from hand-made curves. No model is trained."""

import numpy as np
import pandas as pd
import pytest
from scipy.stats import t as t_dist
from scipy.stats import ttest_rel

from rewarduq_exp.downstream import active_learning as al
from rewarduq_exp.downstream.active_learning import (
    paired_differences,
    repeat_values,
    summary_rows,
    summary_table,
)
from rewarduq_exp.downstream.active_learning_figure import plot_active_learning
from rewarduq_exp.downstream.statistics import paired_t_interval

# Per repeat (rows) and round (columns): random's win rate, and the reviewer's example of ENS-MLP ranking_score,
# ahead of random by +0.052, +0.046, +0.053 averaged over rounds (the same at the last round here).
RANDOM = np.array([[0.60, 0.64, 0.66], [0.55, 0.58, 0.61], [0.63, 0.65, 0.70]])
AHEAD = np.array([0.052, 0.046, 0.053])


def make_curves(levels: dict, truth: bool = True, run: str = "ENS-MLP") -> pd.DataFrame:
    """curves.csv's layout from ``{strategy: (repeats, rounds) win rates}``; ECE = 1 - win rate (any number)."""
    rows = []
    for strategy, table in levels.items():
        for repeat, line in enumerate(np.asarray(table, float)):
            for round_, value in enumerate(line):
                rows.append({"run": run, "method": "ens_mlp", "strategy": strategy, "repeat": repeat,
                             "round": round_, "labels": 100 * (round_ + 1), "win_rate": value,
                             "truth/ece": (1 - value) / 4 if truth else np.nan, "ece": (1 - value) / 3,
                             "rs_0.2": 0.1})
    return pd.DataFrame(rows)


def reviewer_curves(**kwargs) -> pd.DataFrame:
    worse = RANDOM + np.array([0.01, -0.02, 0.004])[:, None]  # behind random in one repeat of three
    return make_curves({"random": RANDOM, "ranking_score": RANDOM + AHEAD[:, None], "uncertainty": worse}, **kwargs)


def test_the_paired_interval_by_hand_on_three_repeats():
    iv = paired_t_interval(AHEAD)
    mean = AHEAD.mean()
    half = t_dist.ppf(0.975, 2) * AHEAD.std(ddof=1) / np.sqrt(3)  # t_{0.975, 2} = 4.303
    assert float(iv.mean) == pytest.approx(mean, abs=1e-12) and mean == pytest.approx(0.0503333, abs=1e-6)
    assert float(iv.lo) == pytest.approx(mean - half, abs=1e-12) and float(iv.hi) == pytest.approx(mean + half)
    assert (float(iv.lo), float(iv.hi)) == pytest.approx((0.04093, 0.05974), abs=1e-5)
    reference = ttest_rel(RANDOM[:, -1] + AHEAD, RANDOM[:, -1])
    assert float(iv.p) == pytest.approx(reference.pvalue, rel=1e-9) and float(iv.p) == pytest.approx(0.0019, abs=1e-4)
    assert int(iv.n) == 3 and int(iv.wins) == 3
    # One repeat: a difference but no interval; NaN repeats are left out of the count.
    one = paired_t_interval([0.2])
    assert float(one.mean) == 0.2 and np.isnan(one.lo) and np.isnan(one.hi) and np.isnan(one.p)
    holes = paired_t_interval([0.1, np.nan, -0.3])
    assert int(holes.n) == 2 and int(holes.wins) == 1 and float(holes.mean) == pytest.approx(-0.1)


def test_summary_rows_reports_the_paired_difference_to_random_per_repeat():
    curves = reviewer_curves()
    summary = summary_rows(curves).set_index("strategy")
    assert list(summary.index) == ["random", "ranking_score", "uncertainty"] and (summary.repeats == 3).all()
    rs = summary.loc["ranking_score"]
    reference = ttest_rel(RANDOM[:, -1] + AHEAD, RANDOM[:, -1])
    for kind in ("final", "auc"):  # the gap is the same at every round here
        iv = paired_t_interval(AHEAD)
        assert rs[f"win_rate_{kind}_vs_random"] == pytest.approx(float(iv.mean), abs=1e-12)
        assert rs[f"win_rate_{kind}_vs_random_lo"] == pytest.approx(float(iv.lo), abs=1e-9)
        assert rs[f"win_rate_{kind}_vs_random_hi"] == pytest.approx(float(iv.hi), abs=1e-9)
        assert rs[f"win_rate_{kind}_vs_random_p"] == pytest.approx(reference.pvalue, rel=1e-6)
        assert rs[f"win_rate_{kind}_higher"] == "3/3"
        assert rs[f"ece_{kind}_higher"] == "0/3"  # ECE = (1 - win rate) / 3 falls in every repeat
    assert rs.win_rate_final == pytest.approx((RANDOM[:, -1] + AHEAD).mean())
    assert rs.win_rate_auc == pytest.approx((RANDOM + AHEAD[:, None]).mean())
    unc = summary.loc["uncertainty"]
    assert unc.win_rate_final_higher == "2/3" and unc.win_rate_final_vs_random == pytest.approx(-0.002, abs=1e-12)
    assert unc.win_rate_final_vs_random_lo < 0 < unc.win_rate_final_vs_random_hi
    # random's own row: no difference to itself
    vs = [c for c in summary.columns if "_vs_random" in c or c.endswith("_higher")]
    assert len(vs) == 3 * 2 * 5 and summary.loc["random", vs].isna().all()
    assert not [c for c in summary.columns if c.endswith("_wins")]   # renamed: "wins" read as "better"
    text = summary_table(summary.reset_index())
    assert "+0.050 [+0.041, +0.060] 3/3" in text and "truth/ece - random" in text
    assert "higher than random's (for the win rate better, for ECE worse)" in text   # k/R says its direction


def test_paired_table_holds_one_difference_per_repeat():
    curves = pd.concat([reviewer_curves(), reviewer_curves(run="BAY-LIN")], ignore_index=True)
    paired = paired_differences(repeat_values(curves))
    assert list(paired.columns) == list(al.PAIRED_COLUMNS)
    assert len(paired) == 2 * 2 * 3 * 2 * 3  # runs x strategies but random x metrics x kinds x repeats
    assert "random" not in set(paired.strategy)
    rs = paired[(paired.run == "BAY-LIN") & (paired.strategy == "ranking_score") & (paired.metric == "win_rate")
                & (paired.kind == "auc")].sort_values("repeat")
    np.testing.assert_allclose(rs["diff"], AHEAD, atol=1e-12)
    np.testing.assert_allclose(rs["random"], RANDOM.mean(1), atol=1e-12)


def test_without_random_there_is_nothing_to_pair_with():
    curves = make_curves({"uncertainty": RANDOM, "bald": RANDOM + 0.01})
    summary = summary_rows(curves)
    assert not [c for c in summary.columns if "vs_random" in c or c.endswith("_higher")]
    assert {"win_rate_final", "win_rate_auc", "repeats"} <= set(summary.columns)
    assert paired_differences(repeat_values(curves)) is None
    assert "—" in summary_table(summary)


def test_summary_rows_takes_its_intervals_from_paired_t_interval(monkeypatch):
    calls = []

    def spy(diffs, *args, **kwargs):
        calls.append(np.asarray(diffs))
        return paired_t_interval(diffs, *args, **kwargs)

    monkeypatch.setattr(al, "paired_t_interval", spy)
    summary_rows(reviewer_curves())
    assert len(calls) == 2 * 3 * 2  # strategies but random x metrics x kinds
    assert any(np.allclose(c, AHEAD) for c in calls)


def test_the_paired_interval_covers_the_true_difference_despite_a_large_repeat_effect():
    """R = 5 repeats; a repeat moves both strategies by N(0, 1) (its initial set); the strategy is better by 0.3;
    each value has its own noise of sd 0.1. Over 2000 studies the paired 95 % interval covers 0.3 about 95 % of the
    time, and is far narrower than the unpaired interval, which counts the repeat effect as noise."""
    rng = np.random.default_rng(20240607)
    studies, repeats, delta = 2000, 5, 0.3
    shared = rng.normal(0.0, 1.0, (studies, repeats))
    random = 0.6 + shared + rng.normal(0.0, 0.1, (studies, repeats))
    strategy = 0.6 + delta + shared + rng.normal(0.0, 0.1, (studies, repeats))
    iv = paired_t_interval(strategy - random, axis=1)
    assert iv.mean.shape == (studies,) and (iv.n == repeats).all()
    coverage = np.mean((iv.lo <= delta) & (delta <= iv.hi))
    assert 0.93 <= coverage <= 0.97, coverage
    np.testing.assert_allclose(iv.p, ttest_rel(strategy, random, axis=1).pvalue, rtol=1e-8)
    # unpaired: the two samples as independent (pooled-variance t-interval, 2R - 2 degrees of freedom)
    pooled = np.sqrt((strategy.var(axis=1, ddof=1) + random.var(axis=1, ddof=1)) / repeats)
    unpaired_width = 2 * t_dist.ppf(0.975, 2 * repeats - 2) * pooled
    paired_width = iv.hi - iv.lo
    assert paired_width.mean() <= unpaired_width.mean() / 3, (paired_width.mean(), unpaired_width.mean())
    # and the repeat effect alone cannot make the paired comparison claim a difference where there is none
    same = 0.6 + shared + rng.normal(0.0, 0.1, (studies, repeats))  # a strategy no better than random
    null = paired_t_interval(same - random, axis=1)
    assert 0.93 <= np.mean((null.lo <= 0) & (0 <= null.hi)) <= 0.97


@pytest.mark.parametrize("variant", ["truth", "no_truth", "no_truth_column", "one_repeat_no_random"])
def test_the_figure_is_drawn_from_hand_made_curves(tmp_path, variant):
    curves = pd.concat([reviewer_curves(truth=variant == "truth"), reviewer_curves(run="BAY-LIN")],
                       ignore_index=True)
    if variant == "no_truth":
        curves["truth/ece"] = np.nan
    if variant == "no_truth_column":
        curves = curves.drop(columns="truth/ece")
    if variant == "one_repeat_no_random":
        curves = curves[(curves.repeat == 0) & (curves.strategy != "random")]
    path = tmp_path / "figure" / "active_learning.png"
    path.parent.mkdir()
    plot_active_learning(curves, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_effect_over_worlds_is_the_t_interval_of_the_worlds_paired_differences():
    # the same learner in three worlds (and a second run in world 1, averaged with the first inside its world)
    frames = [summary_rows(make_curves({"random": RANDOM, "ranking_score": RANDOM + shift}, run=run))
              for run, shift in (("a", 0.05), ("b", 0.01), ("b2", 0.03), ("c", -0.02))]
    summary = pd.concat(frames, ignore_index=True)
    summary.insert(1, "world", summary.run.map({"a": 0, "b": 1, "b2": 1, "c": 2}))
    over = al.over_worlds_rows(summary, {"a": "ens_mlp", "b": "ens_mlp", "b2": "ens_mlp", "c": "ens_mlp"})
    row = over[(over.strategy == "ranking_score") & (over.statistic == "win_rate_final_vs_random")].iloc[0]
    per_world = np.array([0.05, 0.02, -0.02])
    half = t_dist.ppf(0.975, 2) * per_world.std(ddof=1) / np.sqrt(3)
    assert row.worlds == 3 and row.estimate == pytest.approx(per_world.mean())
    assert (row.lo, row.hi) == pytest.approx((per_world.mean() - half, per_world.mean() + half))
    assert row.per_world == "0:+0.050,1:+0.020,2:-0.020" and row.note == ""
    assert "random over 3 worlds" in al.over_worlds_lines(over)[0]
    # one world only: no row
    assert al.over_worlds_rows(summary[summary.world == 1], {"b": "m", "b2": "m"}).empty
