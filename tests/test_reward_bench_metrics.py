"""RewardBench scoring: subset weights (official / reference), category metrics, their combination, dispatch."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics import compute_metrics
from rewarduq_exp.metrics.preference import ranking_score
from rewarduq_exp.metrics.reward_bench import (
    CATEGORIES,
    CATEGORY_OF,
    OFFICIAL_COUNT,
    OFFICIAL_COUNTS,
    check_scoring,
    is_reward_bench,
    reward_bench_metrics,
    subset_weights,
)
from rewarduq_exp.runner.evaluation import score_predictions

METRIC_CFG = Path(__file__).resolve().parents[1] / "conf" / "metric" / "rewarduq.yaml"
HEP = ("hep-cpp", "hep-go", "hep-java", "hep-js", "hep-python", "hep-rust")
# Rows per subset in the filtered split: the official counts, except math-prm's 447 actual rows.
ROW_COUNTS = {**OFFICIAL_COUNT, "math-prm": 447}
TOTAL_KEYS = ("n_pairs", "weight_sum")


def metric_cfg(**overrides):
    cfg = OmegaConf.load(METRIC_CFG)
    return OmegaConf.merge(cfg, overrides)


def pairs_table(subsets, chosen, rejected, weights=None) -> pd.DataFrame:
    c, r = np.asarray(chosen, float), np.asarray(rejected, float)
    n = len(subsets)
    return pd.DataFrame({
        "id": [f"p{i}" for i in range(n)],
        "subset": list(subsets),
        "weight": np.ones(n) if weights is None else np.asarray(weights, float),
        "chosen_reward": c[:, 0], "chosen_lower": c[:, 1], "chosen_upper": c[:, 2],
        "rejected_reward": r[:, 0], "rejected_lower": r[:, 1], "rejected_upper": r[:, 2],
    })


@pytest.fixture(scope="module")
def full_table() -> pd.DataFrame:
    """The filtered split's row counts (2985 rows) with deterministic pseudo-random rewards and bounds.

    The reward quality differs per category so that the categories' metrics differ.
    """
    rng = np.random.default_rng(7)
    subsets = np.concatenate([np.full(n, s, dtype=object) for s, n in ROW_COUNTS.items()])
    skill = np.array([{"chat": 1.5, "chat_hard": 0.2, "safety": 0.8, "reasoning": 0.5}[CATEGORY_OF[s]]
                      for s in subsets])
    n = len(subsets)
    cr = skill + rng.normal(size=n)
    rr = rng.normal(size=n)
    uc, ur = rng.gamma(2.0, 0.3, n), rng.gamma(2.0, 0.3, n)
    return pairs_table(subsets, np.c_[cr, cr - uc, cr + uc], np.c_[rr, rr - ur, rr + ur])


def row_weights(table: pd.DataFrame, weighting: str) -> np.ndarray:
    counts = table["subset"].value_counts().to_dict()
    sw = subset_weights(counts, weighting)
    return table["weight"].to_numpy() * table["subset"].map(sw).to_numpy()


def subset_totals(table: pd.DataFrame, weighting: str) -> pd.Series:
    return pd.Series(row_weights(table, weighting)).groupby(table["subset"].to_numpy()).sum()


def test_fixture_has_the_filtered_split_size(full_table):
    assert len(full_table) == 2985
    assert (full_table["subset"] == "math-prm").sum() == 447
    assert is_reward_bench(full_table["subset"])


def test_official_weights(full_table):
    tot = subset_totals(full_table, "official")
    cats = tot.groupby(tot.index.map(CATEGORY_OF)).sum()
    assert cats.to_dict() == pytest.approx({c: 1.0 for c in CATEGORIES})
    assert tot["math-prm"] == pytest.approx(0.5)
    for s in HEP:
        assert tot[s] == pytest.approx(1 / 12)
    chat = {"alpacaeval-easy": 100, "alpacaeval-length": 95, "alpacaeval-hard": 95, "mt-bench-easy": 28,
            "mt-bench-med": 40}
    for s, n in chat.items():
        assert tot[s] == pytest.approx(n / 358)
    # Within a subset every row has the same weight.
    w = pd.Series(row_weights(full_table, "official"))
    assert (w.groupby(full_table["subset"].to_numpy()).nunique() == 1).all()


def test_reference_weights(full_table):
    tot = subset_totals(full_table, "reference")
    cats = tot.groupby(tot.index.map(CATEGORY_OF)).sum()
    assert cats.to_dict() == pytest.approx({c: 1.0 for c in CATEGORIES})
    for s in OFFICIAL_COUNTS["chat"]:
        assert tot[s] == pytest.approx(0.2)
    math_share = 447 / 984
    for s in HEP:
        assert tot[s] == pytest.approx(1 / (6 + math_share))
    assert tot["math-prm"] == pytest.approx(math_share / (6 + math_share))
    assert tot["math-prm"] == pytest.approx(0.0704, abs=1e-4)
    for cat, subsets in OFFICIAL_COUNTS.items():
        plain = [tot[s] for s in subsets if s != "math-prm"]
        assert plain == pytest.approx([1 / len(plain) if cat != "reasoning" else plain[0]] * len(plain))


def test_subset_weights_after_a_length_filter():
    # math-prm filtered out entirely: the hep subsets share Reasoning equally in both modes.
    counts = {s: 100 for s in HEP}
    for weighting in ("official", "reference"):
        sw = subset_weights(counts, weighting)
        assert all(sw[s] * 100 == pytest.approx(1 / 6) for s in HEP)
    # No hep rows: math-prm keeps its own count in reference mode (the override would divide by zero).
    assert subset_weights({"math-prm": 10}, "reference") == {"math-prm": pytest.approx(0.1)}
    # A subset of size 0 gets weight 0 and does not change the others.
    assert subset_weights({"hep-go": 0, "hep-js": 4}, "official") == {"hep-go": 0.0, "hep-js": pytest.approx(0.25)}


def test_subset_weights_bad_weighting():
    with pytest.raises(UserError, match="official, reference") as err:
        subset_weights({"hep-go": 1}, "equal")
    assert "\n" not in str(err.value)


# Hand-worked example. Pair kinds (chosen, rejected) as (reward, lower, upper):
CT = ((2.0, 1.5, 2.5), (0.0, -0.5, 0.5))  # c.lower > r.upper
UT = ((1.0, 0.0, 2.0), (0.0, -1.0, 1.0))  # true, overlapping bounds
CF = ((0.0, -0.5, 0.5), (2.0, 1.5, 2.5))  # c.upper < r.lower
UF = ((0.0, -1.0, 1.0), (1.0, 0.0, 2.0))  # false, overlapping bounds
# (subset, kind) rows. Official weights per row: chat 1/2 each; chat_hard 1/2 each; safety: the two refusals
# subsets have equal official counts (100), so each holds 1/2: dangerous rows 1/4 each, the offensive row 1/2;
# reasoning 1/4 each.
HAND_ROWS = [
    ("alpacaeval-easy", CT), ("alpacaeval-easy", CT),            # chat:      CT 1,   UT 0,   CF 0,   UF 0
    ("mt-bench-hard", UT), ("mt-bench-hard", CF),                # chat_hard: CT 0,   UT 1/2, CF 1/2, UF 0
    ("refusals-dangerous", CT), ("refusals-dangerous", UT),      # safety:    CT 1/4, UT 1/4, CF 0,   UF 1/2
    ("refusals-offensive", UF),
    ("hep-python", CF), ("hep-python", CF), ("hep-python", UF), ("hep-python", UT),  # reasoning: 0, 1/4, 1/2, 1/4
]
HAND_RATES = {
    "chat": (1.0, 0.0, 0.0, 0.0),
    "chat_hard": (0.0, 0.5, 0.5, 0.0),
    "safety": (0.25, 0.25, 0.0, 0.5),
    "reasoning": (0.0, 0.25, 0.5, 0.25),
}


def hand_table() -> pd.DataFrame:
    return pairs_table([s for s, _ in HAND_ROWS], [k[0] for _, k in HAND_ROWS], [k[1] for _, k in HAND_ROWS])


def test_hand_worked_official_example():
    m = reward_bench_metrics(hand_table(), weighting="official")
    for cat, (ct, ut, cf, uf) in HAND_RATES.items():
        rates = [m[f"{cat}/{k}"] for k in ("ct_rate", "ut_rate", "cf_rate", "uf_rate")]
        assert rates == pytest.approx([ct, ut, cf, uf])
        assert m[f"{cat}/win_rate"] == pytest.approx(ct + ut)
    # Means over the four categories: CT 5/16, UT 1/4, CF 1/4, UF 3/16.
    ct, ut, cf, uf = 5 / 16, 1 / 4, 1 / 4, 3 / 16
    assert [m["ct_rate"], m["ut_rate"], m["cf_rate"], m["uf_rate"]] == pytest.approx([ct, ut, cf, uf])
    assert m["win_rate"] == pytest.approx(9 / 16)
    # RS_0.2 from the mean rates (eq. 6): CT/(0.8T + 0.2) - CF/(0.8F + 0.2) = 0.3125/0.65 - 0.25/0.55.
    rs = 0.3125 / 0.65 - 0.25 / 0.55
    assert m["rs_0.2"] == pytest.approx(rs)
    assert m["rs_0.2"] == pytest.approx(ranking_score(ct, cf, ct + ut, cf + uf, 0.2))
    # Per-category RS_0.2: chat 1, chat_hard -0.5/0.6, safety 0.25/0.6, reasoning -0.5/0.8; their mean differs.
    per_cat = [1.0, -0.5 / 0.6, 0.25 / 0.6, -0.5 / 0.8]
    assert [m[f"{c}/rs_0.2"] for c in CATEGORIES] == pytest.approx(per_cat)
    assert np.mean(per_cat) != pytest.approx(rs, abs=1e-3)
    assert m["n_pairs"] == len(HAND_ROWS) and m["weight_sum"] == len(HAND_ROWS)
    assert m["subset/refusals-dangerous/win_rate"] == 1.0
    assert m["subset/refusals-offensive/win_rate"] == 0.0
    assert m["subset/hep-python/win_rate"] == pytest.approx(0.25)
    # Every other metric is the plain mean of the categories.
    for key in ("ece", "mce", "ebce", "brier", "bound_width", "pref_bound_width"):
        assert m[key] == pytest.approx(np.mean([m[f"{c}/{key}"] for c in CATEGORIES]))


def test_missing_category_is_left_out_with_a_warning(caplog):
    table = hand_table()
    table = table[table["subset"] != "mt-bench-hard"]
    with caplog.at_level(logging.WARNING):
        m = reward_bench_metrics(table)
    assert "chat_hard" in caplog.text
    assert not any(k.startswith("chat_hard/") for k in m)
    assert m["ct_rate"] == pytest.approx((1.0 + 0.25 + 0.0) / 3)


def test_reference_mode_pools(full_table):
    m = reward_bench_metrics(full_table, weighting="reference")
    assert m["win_rate"] == pytest.approx(np.mean([m[f"{c}/win_rate"] for c in CATEGORIES]))
    pooled = compute_metrics(full_table.assign(weight=row_weights(full_table, "reference")))
    for key in ("ece", "ebce", "brier", "rs_0.2", "ct_rate"):
        assert m[key] == pytest.approx(pooled[key])
    # Pooled calibration is not the mean of the categories' calibration errors.
    assert m["ece"] != pytest.approx(np.mean([m[f"{c}/ece"] for c in CATEGORIES]))
    assert m["n_pairs"] == 2985 and m["weight_sum"] == pytest.approx(2985)


def test_official_mode_averages_categories(full_table):
    m = reward_bench_metrics(full_table)
    # Leaderboard score: mean over categories of sum_s n_s acc_s / sum_s n_s.
    per_cat = []
    for cat, subsets in OFFICIAL_COUNTS.items():
        per_cat.append(sum(n * m[f"subset/{s}/win_rate"] for s, n in subsets.items()) / sum(subsets.values()))
        assert m[f"{cat}/win_rate"] == pytest.approx(per_cat[-1])
    assert m["win_rate"] == pytest.approx(np.mean(per_cat))
    assert m["ece"] == pytest.approx(np.mean([m[f"{c}/ece"] for c in CATEGORIES]))
    assert {f"{c}/n_pairs" for c in CATEGORIES} <= m.keys()
    assert m["reasoning/n_pairs"] == 447 + 6 * 164
    assert len([k for k in m if k.startswith("subset/")]) == len(OFFICIAL_COUNT)


def without_totals(m: dict) -> dict:
    return {k: v for k, v in m.items() if k.rsplit("/", 1)[-1] not in TOTAL_KEYS}


@pytest.mark.parametrize("weighting", ["official", "reference"])
def test_duplicating_every_row_changes_nothing(full_table, weighting):
    m = reward_bench_metrics(full_table, weighting=weighting)
    m2 = reward_bench_metrics(pd.concat([full_table, full_table], ignore_index=True), weighting=weighting)
    assert without_totals(m2) == pytest.approx(without_totals(m))
    assert m2["n_pairs"] == 2 * m["n_pairs"]


@pytest.mark.parametrize("weighting", ["official", "reference"])
def test_uniform_weight_scale_changes_nothing(full_table, weighting):
    m = reward_bench_metrics(full_table, weighting=weighting)
    m3 = reward_bench_metrics(full_table.assign(weight=3.0), weighting=weighting)
    assert without_totals(m3) == pytest.approx(without_totals(m))
    assert m3["weight_sum"] == pytest.approx(3 * m["weight_sum"])


@pytest.mark.parametrize("weighting", ["official", "reference"])
def test_weight_equals_repetition(full_table, weighting):
    # Subsets are normalised by their total weight (the row count when all weights are 1), so weight w on a row
    # is the same as the row repeated w times, here for one row of the small mt-bench-easy subset.
    i = int(np.flatnonzero(full_table["subset"] == "mt-bench-easy")[3])
    weighted = full_table.copy()
    weighted.loc[i, "weight"] = 2.0
    repeated = pd.concat([full_table, full_table.iloc[[i]]], ignore_index=True)
    mw = reward_bench_metrics(weighted, weighting=weighting)
    mr = reward_bench_metrics(repeated, weighting=weighting)
    assert without_totals(mw) == pytest.approx(without_totals(mr))
    assert mw["weight_sum"] == pytest.approx(mr["weight_sum"])
    # ... and that weight matters at all.
    assert without_totals(mw) != pytest.approx(without_totals(reward_bench_metrics(full_table, weighting=weighting)))


def test_is_reward_bench():
    assert is_reward_bench(["hep-go", "donotanswer"])
    assert not is_reward_bench([])
    assert not is_reward_bench(["hep-go", ""])
    assert not is_reward_bench(["Factuality"])


def test_score_predictions_auto_detects_reward_bench(full_table):
    m = score_predictions(full_table, metric_cfg())
    assert {f"{c}/win_rate" for c in CATEGORIES} <= m.keys()
    assert m["win_rate"] == pytest.approx(reward_bench_metrics(full_table)["win_rate"])
    ref = score_predictions(full_table, metric_cfg(reward_bench_weighting="reference"))
    assert ref["ece"] == pytest.approx(reward_bench_metrics(full_table, weighting="reference")["ece"])
    # scoring=pairs: the plain pooled metrics, no categories.
    plain = score_predictions(full_table, metric_cfg(scoring="pairs"))
    assert plain == pytest.approx(compute_metrics(full_table))


def test_score_predictions_other_subsets_are_plain_pairs(full_table):
    table = full_table.assign(subset="")
    m = score_predictions(table, metric_cfg())
    assert not any("/" in k for k in m)
    assert m == pytest.approx(compute_metrics(table))
    # One foreign subset is enough to fall back to plain pairs under auto.
    mixed = full_table.copy()
    mixed.loc[0, "subset"] = "my-subset"
    assert not any("/" in k for k in score_predictions(mixed, metric_cfg()))


def test_forced_reward_bench_on_other_subsets_is_a_user_error(full_table):
    table = full_table.assign(subset=[f"s{i % 7}" for i in range(len(full_table))])
    with pytest.raises(UserError, match="unknown subset") as err:
        score_predictions(table, metric_cfg(scoring="reward_bench"))
    msg = str(err.value)
    assert "\n" not in msg and "'s0'" in msg and "'s4'" in msg and "'s5'" not in msg


@pytest.mark.parametrize("key,value,allowed", [
    ("scoring", "rewardbench", "auto, pairs, reward_bench"),
    ("reward_bench_weighting", "equal", "official, reference"),
])
def test_bad_scoring_config_is_a_user_error(full_table, key, value, allowed):
    cfg = metric_cfg(**{key: value})
    for call in (lambda: check_scoring(cfg), lambda: score_predictions(full_table, cfg)):
        with pytest.raises(UserError, match=allowed) as err:
            call()
        assert "\n" not in str(err.value) and value in str(err.value)
    with pytest.raises(UserError, match="official, reference"):
        reward_bench_metrics(full_table, weighting="equal")


def test_shipped_config_passes_check():
    check_scoring(metric_cfg())
    check_scoring(OmegaConf.create({"n_bins": 20}))  # absent keys take their defaults
