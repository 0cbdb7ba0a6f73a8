"""K-wise (RewardBench 2 style) scoring: best-of-K accuracy, expansion into pairs, dispatch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from rewarduq_exp.errors import UserError
from rewarduq_exp.evaluation import diagrams, score_predictions
from rewarduq_exp.metrics import compute_metrics
from rewarduq_exp.metrics.kwise import is_kwise, kwise_metrics, kwise_to_pairs

METRIC_CFG = Path(__file__).resolve().parents[1] / "conf" / "metric" / "rewarduq.yaml"


def kwise_table(rewards, best, weights, subsets, width=0.5) -> pd.DataFrame:
    return pd.DataFrame({
        "id": [f"q{i}" for i in range(len(rewards))],
        "subset": subsets,
        "weight": np.asarray(weights, float),
        "rewards": [np.asarray(r, float) for r in rewards],
        "lowers": [np.asarray(r, float) - width for r in rewards],
        "uppers": [np.asarray(r, float) + width for r in rewards],
        "best": best,
    })


# q0 (K=3, subset a, w=1): best 3.0 beats 1.0 and 2.0                -> correct
# q1 (K=4, subset a, w=1): best 2.0 ties with completion 1 (2.0)     -> not correct (strict)
# q2 (K=3, subset b, w=3): best 5.0 beats 1.0 and 0.0                -> correct
# Weighted accuracy (1 + 0 + 3) / 5 = 0.8; per subset a 1/2, b 1; subset mean 3/4.
THREE = dict(rewards=[[1.0, 3.0, 2.0], [2.0, 2.0, 0.0, 1.0], [5.0, 1.0, 0.0]], best=[1, 0, 0],
             weights=[1.0, 1.0, 3.0], subsets=["a", "a", "b"])


def expected_pairs() -> pd.DataFrame:
    """The expansion of THREE written out by hand: best vs each other completion, weight / (K-1)."""
    rows = [  # id, subset, weight, chosen reward, rejected reward
        ("q0/0", "a", 0.5, 3.0, 1.0), ("q0/2", "a", 0.5, 3.0, 2.0),
        ("q1/1", "a", 1 / 3, 2.0, 2.0), ("q1/2", "a", 1 / 3, 2.0, 0.0), ("q1/3", "a", 1 / 3, 2.0, 1.0),
        ("q2/1", "b", 1.5, 5.0, 1.0), ("q2/2", "b", 1.5, 5.0, 0.0),
    ]
    ids, subsets, w, c, r = (list(x) for x in zip(*rows))
    c, r = np.array(c), np.array(r)
    return pd.DataFrame({
        "id": ids, "subset": subsets, "weight": w,
        "chosen_reward": c, "chosen_lower": c - 0.5, "chosen_upper": c + 0.5,
        "rejected_reward": r, "rejected_lower": r - 0.5, "rejected_upper": r + 0.5,
    })


def test_best_of_k_accuracy_by_hand():
    m = kwise_metrics(kwise_table(**THREE))
    assert m["best_of_k_accuracy"] == pytest.approx(0.8)
    assert m["subset/a/best_of_k_accuracy"] == pytest.approx(0.5)
    assert m["subset/b/best_of_k_accuracy"] == pytest.approx(1.0)
    assert m["best_of_k_accuracy_subset_mean"] == pytest.approx(0.75)
    assert m["n_prompts"] == 3 and m["n_pairs"] == 7 and m["weight_sum"] == 5.0


def test_expansion_matches_hand_built_pairs():
    pairs = kwise_to_pairs(kwise_table(**THREE))
    pd.testing.assert_frame_equal(pairs, expected_pairs())
    # Each prompt keeps its weight.
    per_prompt = pairs.groupby(pairs["id"].str.split("/").str[0])["weight"].sum()
    assert per_prompt.to_dict() == pytest.approx({"q0": 1.0, "q1": 1.0, "q2": 3.0})


def test_pairwise_metrics_equal_compute_metrics_of_expansion():
    m = kwise_metrics(kwise_table(**THREE), n_bins=10, alphas=(0.2,))
    expected = compute_metrics(expected_pairs(), n_bins=10, alphas=(0.2,))
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key
    # 4 of the 7 pairs are won, with weights 0.5+0.5, 1/3+1/3, 1.5+1.5 of 5.
    assert m["win_rate"] == pytest.approx((1.0 + 2 / 3 + 3.0) / 5)


def test_uniform_k_and_row_order_of_mixed_k():
    rng = np.random.default_rng(3)
    rewards = rng.normal(size=(50, 4))
    table = kwise_table(list(rewards), rng.integers(0, 4, 50), np.ones(50), ["x"] * 50)
    pairs = kwise_to_pairs(table)
    assert len(pairs) == 150
    assert pairs["weight"].to_numpy() == pytest.approx(np.full(150, 1 / 3))
    # Mixed K keeps prompt order: ids come out grouped by prompt in the input order.
    mixed = kwise_table(**THREE)
    assert kwise_to_pairs(mixed)["id"].str.split("/").str[0].tolist() == ["q0"] * 2 + ["q1"] * 3 + ["q2"] * 2


def test_parquet_round_trip(tmp_path):
    table = kwise_table(**THREE)
    table.to_parquet(tmp_path / "k.parquet")
    back = pd.read_parquet(tmp_path / "k.parquet")
    assert kwise_metrics(back) == pytest.approx(kwise_metrics(table))


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.assign(best=[3, 0, 0]), "best must be"),
    (lambda t: t.assign(lowers=[np.zeros(2), *t["lowers"][1:]]), "same length"),
    (lambda t: t.assign(rewards=[np.array([1.0]), *t["rewards"][1:]], lowers=[np.array([0.5]), *t["lowers"][1:]],
                        uppers=[np.array([1.5]), *t["uppers"][1:]]), "at least 2"),
    (lambda t: t.drop(columns="best"), "missing column"),
    (lambda t: t.assign(uppers=[np.array([1.0, 3.0, 0.0]), *t["uppers"][1:]]), "bounds must satisfy"),
])
def test_bad_kwise_tables_are_user_errors(edit, match):
    with pytest.raises(UserError, match=match) as err:
        kwise_metrics(edit(kwise_table(**THREE)))
    assert "\n" not in str(err.value)


def test_score_predictions_dispatches_kwise(tmp_path):
    table = kwise_table(**THREE)
    assert is_kwise(table) and not is_kwise(expected_pairs())
    cfg = OmegaConf.load(METRIC_CFG)
    m = score_predictions(table, cfg)
    assert m == pytest.approx(kwise_metrics(table))
    assert score_predictions(table, OmegaConf.merge(cfg, {"scoring": "pairs"}))["best_of_k_accuracy"] == 0.8
    with pytest.raises(UserError, match="K-wise"):
        score_predictions(table, OmegaConf.merge(cfg, {"scoring": "reward_bench"}))
    figures = diagrams(table, tmp_path / "fig", cfg, title="kwise")
    assert figures and all(Path(f).is_file() for f in figures)
