"""K-wise (RewardBench 2) scoring as the official scorer does it: ties at the top, the Ties subset's own score, the
overall score; expansion into pairs; dispatch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics import compute_metrics
from rewarduq_exp.metrics import kwise as kw
from rewarduq_exp.metrics.kwise import check_tie_rule, is_kwise, kwise_metrics, kwise_to_pairs
from rewarduq_exp.metrics.scoring import kwise_ranking_metrics
from rewarduq_exp.runner.evaluation import diagrams, score_predictions

METRIC_CFG = Path(__file__).resolve().parents[1] / "conf" / "metric" / "rewarduq.yaml"


def kwise_table(rewards, best, weights, subsets, width=0.5, ids=None, num_correct=None) -> pd.DataFrame:
    table = pd.DataFrame({
        "id": ids or [f"q{i}" for i in range(len(rewards))],
        "subset": subsets,
        "weight": np.asarray(weights, float),
        "rewards": [np.asarray(r, float) for r in rewards],
        "lowers": [np.asarray(r, float) - width for r in rewards],
        "uppers": [np.asarray(r, float) + width for r in rewards],
        "best": best,
    })
    if num_correct is not None:
        table["num_correct"] = num_correct
    return table


# q0 (K=3, subset a, w=1): best 3.0 beats 1.0 and 2.0                -> 1
# q1 (K=4, subset a, w=1): best 2.0 ties with completion 1 (2.0)     -> official 1/2 (two tied at the top); strict 0
# q2 (K=3, subset b, w=3): best 5.0 beats 1.0 and 0.0                -> 1
# Official: weighted accuracy (1 + 0.5 + 3) / 5 = 0.9; subset a (1 + 0.5)/2 = 0.75, b 1; RB2 score (0.75 + 1)/2.
# Strict: (1 + 0 + 3) / 5 = 0.8; subset a 1/2, b 1; RB2 score 3/4.
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
    m = kwise_metrics(kwise_table(**THREE))  # the official tie rule is the default
    assert m["best_of_k_accuracy"] == pytest.approx(0.9)
    assert m["subset/a/best_of_k_accuracy"] == pytest.approx(0.75) and m["subset/a/score"] == pytest.approx(0.75)
    assert m["subset/b/best_of_k_accuracy"] == pytest.approx(1.0)
    assert m["rb2_score"] == pytest.approx(0.875)
    assert m["n_prompts"] == 3 and m["n_pairs"] == 7 and m["weight_sum"] == 5.0
    strict = kwise_metrics(kwise_table(**THREE), tie_rule="strict")
    assert strict["best_of_k_accuracy"] == pytest.approx(0.8) and strict["rb2_score"] == pytest.approx(0.75)
    assert strict["win_rate"] == m["win_rate"]  # the pairwise metrics do not depend on the tie rule


@pytest.mark.parametrize("rewards, official", [
    ([2.0, 2.0, 1.0, 0.0], 1 / 2),       # correct tied with one other at the top
    ([2.0, 2.0, 2.0, 0.0], 1 / 3),       # three-way tie at the top
    ([2.0, 2.0, 2.0, 2.0], 1 / 4),       # all equal
    ([1.0, 2.0, 2.0, 0.0], 0.0),         # a tie at the top without the correct one
    ([3.0, 2.0, 2.0, 0.0], 1.0),         # a tie below the correct one does not matter
])
def test_official_tie_rule_by_hand(rewards, official):
    table = kwise_table([rewards], [0], [1.0], ["Focus"])
    assert kwise_metrics(table)["best_of_k_accuracy"] == pytest.approx(official)
    assert kwise_metrics(table, tie_rule="strict")["best_of_k_accuracy"] == float(official == 1.0)


# The Ties subset, worked by hand. Correct completions come first (best 0).
#   ref:1  [5, 1, 2, 0], 1 correct:        accurate (5 > 2), margin m_r = 5 - 2 = 3
#   tied:1 [6, 4, 3, 1], 2 correct (6, 4): accurate (4 > 3), margin m_t = 4 - 3 = 1, spread s = 6 - 4 = 2
#   ref:2  [1, 2, 0], 1 correct:           not accurate (1 < 2), margin -1
#   tied:2 [3, 3, 3, 0], 3 correct:        accurate (3 > 0), margin 3, spread 0
# ref accuracy 1/2, tied accuracy 1; prompt 1: m_t > s? 1 > 2 no; min(m_r, m_t) = 1 > 2 no; tanh(1/2 - 1) = tanh(-0.5)
# prompt 2: 3 > 0 yes; min(-1, 3) = -1 > 0 no; tanh(-1/0 - 1) = tanh(-inf) = -1
# score = 0.3 * 1 + 0.3 * 0.5 + 0.2 * 0.5 + 0.2 * 0 + 0.01 * (tanh(-0.5) - 1) / 2
TIES = dict(rewards=[[5, 1, 2, 0], [6, 4, 3, 1], [1, 2, 0], [3, 3, 3, 0]], best=[0, 0, 0, 0], weights=[1.0] * 4,
            subsets=["Ties"] * 4, ids=["ref:1", "tied:1", "ref:2", "tied:2"], num_correct=[1, 2, 1, 3])


def test_ties_subset_score_by_hand():
    m = kwise_metrics(kwise_table(**TIES))
    expected = 0.3 * 1 + 0.3 * 0.5 + 0.2 * 0.5 + 0.2 * 0 + 0.01 * (np.tanh(-0.5) - 1) / 2
    assert m["subset/Ties/ref_accuracy"] == 0.5 and m["subset/Ties/tied_accuracy"] == 1.0
    assert m["subset/Ties/correctness_preferred"] == 0.5 and m["subset/Ties/correctness_preferred_hard"] == 0.0
    assert m["subset/Ties/score"] == pytest.approx(expected, abs=1e-12)
    assert m["rb2_score"] == pytest.approx(expected)  # the only subset
    # The Ties score is included in the overall one: the mean over subsets, Ties with its own score.
    both = pd.concat([kwise_table(**TIES), kwise_table(**THREE, num_correct=[1, 1, 1])], ignore_index=True)
    assert kwise_metrics(both)["rb2_score"] == pytest.approx((expected + 0.75 + 1.0) / 3)
    # Multi-correct prompts expand into every (correct, incorrect) pair, weight / (n_correct * n_incorrect).
    pairs = kwise_to_pairs(kwise_table(**TIES))
    tied = pairs[pairs["id"].str.startswith("tied:1/")]
    assert tied["id"].tolist() == ["tied:1/0>2", "tied:1/0>3", "tied:1/1>2", "tied:1/1>3"]
    assert tied["weight"].tolist() == pytest.approx([0.25] * 4)
    assert tied["chosen_reward"].tolist() == [6, 6, 4, 4] and tied["rejected_reward"].tolist() == [3, 1, 3, 1]
    with pytest.raises(UserError, match="'ref:<n>' and 'tied:<n>'"):
        kwise_metrics(kwise_table(**{**TIES, "ids": ["a", "b", "c", "d"]}))


def test_ties_score_ignores_the_tie_rule_and_needs_ref_tied_pairs(caplog):
    # The Ties formula compares strictly under either tie rule (as the official process_single_model does).
    official, strict = kwise_metrics(kwise_table(**TIES)), kwise_metrics(kwise_table(**TIES), tie_rule="strict")
    assert strict["subset/Ties/score"] == official["subset/Ties/score"]
    # No number with both a ref: and a tied: prompt (e.g. a small sample of RB2): the margin terms average over no
    # prompt, so the Ties score is NaN as the official scorer gives (np.mean of an empty array), and so is rb2_score;
    # the accuracies and every other metric stay defined, and a warning says why.
    only = kwise_table(**{**TIES, "ids": ["ref:1", "tied:3", "ref:2", "tied:4"]})
    with caplog.at_level("WARNING", logger="rewarduq_exp.metrics.kwise"):
        m = kwise_metrics(only)
    assert "no prompt number has both" in caplog.text
    assert m["subset/Ties/ref_accuracy"] == 0.5 and m["subset/Ties/tied_accuracy"] == 1.0
    assert np.isnan(m["subset/Ties/score"]) and np.isnan(m["rb2_score"])
    assert m["best_of_k_accuracy"] == pytest.approx(0.75) and np.isfinite(m["win_rate"])


def test_two_correct_two_incorrect_expand_into_four_pairs_of_weight_w_over_4():
    table = kwise_table([[4.0, 3.0, 1.0, 2.0]], [0], [2.0], ["x"], ids=["p"], num_correct=[2])
    pairs = kwise_to_pairs(table)
    assert pairs["id"].tolist() == ["p/0>2", "p/0>3", "p/1>2", "p/1>3"]
    assert pairs["weight"].tolist() == pytest.approx([0.5] * 4)  # w / (n_correct * n_incorrect) = 2 / 4
    assert pairs["chosen_reward"].tolist() == [4, 4, 3, 3] and pairs["rejected_reward"].tolist() == [1, 2, 1, 2]
    # the prompt's result is the official "accurate" flag: worst correct 3 > best incorrect 2
    assert kwise_metrics(table)["best_of_k_accuracy"] == 1.0
    worse = kwise_table([[4.0, 1.5, 1.0, 2.0]], [0], [2.0], ["x"], ids=["p"], num_correct=[2])  # 1.5 < 2
    assert kwise_metrics(worse)["best_of_k_accuracy"] == 0.0


def test_weights_act_as_repetition_and_old_tables_default_to_one_correct():
    # A prompt of weight 3 counts as that prompt three times, for best_of_k_accuracy and the subset scores.
    weighted = kwise_metrics(kwise_table(**THREE))
    rows = [0, 1, 2, 2, 2]
    repeated = kwise_table([THREE["rewards"][i] for i in rows], [THREE["best"][i] for i in rows], [1.0] * 5,
                           [THREE["subsets"][i] for i in rows])
    m = kwise_metrics(repeated)
    for key in ("best_of_k_accuracy", "subset/a/score", "subset/b/score", "rb2_score", "win_rate", "ece"):
        assert m[key] == pytest.approx(weighted[key]), key
    # A table without num_correct (older predictions files, users' own K-wise files) scores as num_correct = 1.
    table = kwise_table(**THREE)
    assert "num_correct" not in table.columns
    assert kwise_metrics(table) == kwise_metrics(table.assign(num_correct=1))
    assert kwise_to_pairs(table).equals(kwise_to_pairs(table.assign(num_correct=1)))


def test_reward_bench2_fixture_through_the_real_loader(tmp_path, monkeypatch):
    """Loader -> predictions table -> score_predictions on the hub-schema fixture: Ties is kept with its num_correct
    and scored by its own formula inside rb2_score."""
    import datasets
    from hub_fixtures import write_reward_bench2

    from rewarduq_exp.data.registry import build_loader, load_dataset_config
    from rewarduq_exp.methods.base import Scores
    from rewarduq_exp.runner.evaluation import kwise_predictions_frame

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    write_reward_bench2(tmp_path / "hub")
    data = build_loader(load_dataset_config("reward_bench2", seed=0, paths={"datasets_dir": str(tmp_path / "hub")}))
    data = data.load("test")
    ties = data[data.subset == "Ties"].set_index("id")
    assert ties.num_correct.to_dict() == {"ref:0": 1, "tied:0": 3}
    # Every completion gets reward -index: the correct ones (first) always win.
    #   10 single-correct prompts: result 1; ref:0 [0,-1,-2,-3]: accurate, margin 0-(-1) = 1;
    #   tied:0 [0,-1,-2 | -3,-4]: accurate, margin -2-(-3) = 1, spread 0-(-2) = 2;
    #   1 > 2 no, min(1, 1) > 2 no, tanh(1/2 - 1) = tanh(-0.5)
    #   Ties = 0.3 * 1 + 0.3 * 1 + 0.2 * 0 + 0.2 * 0 + 0.01 * tanh(-0.5); the five other subsets score 1.
    reward = np.concatenate([-np.arange(len(c), dtype=float) for c in data.completions])
    predictions = kwise_predictions_frame(data, Scores(reward, np.full_like(reward, 0.1)))
    assert predictions.num_correct.tolist() == data.num_correct.tolist()
    m = score_predictions(predictions, OmegaConf.load(METRIC_CFG))
    ties_score = 0.6 + 0.01 * np.tanh(-0.5)
    assert m["subset/Ties/score"] == pytest.approx(ties_score)
    assert m["rb2_score"] == pytest.approx((5 + ties_score) / 6)
    assert m["best_of_k_accuracy"] == 1.0 and m["n_prompts"] == 12


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
    (lambda t: t.assign(num_correct=[1, 4, 1]), "at least one incorrect"),
    (lambda t: t.assign(num_correct=[2, 1, 1]), "with num_correct > 1 the correct completions must come first "
                                                 "\\(best 0"),  # q0 has best 1
    (lambda t: t.assign(num_correct=[0, 1, 1]), "num_correct must be an integer >= 1 in 1 row"),
    (lambda t: t.assign(num_correct=[1.5, 1, 1]), "num_correct must be an integer >= 1"),
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
    ranking = {k: m.pop(k) for k in list(m) if k.startswith("rank/")}  # appendix D top-1 calibration, added
    assert m == pytest.approx(kwise_metrics(table))
    assert ranking == pytest.approx(kwise_ranking_metrics(table, n_bins=cfg.ranking.n_bins))
    assert set(ranking) == {"rank/top_1/ece", "rank/sub_2/ece", "rank/top_1/chosen_only_ece", "rank/top_1/n_contexts"}
    assert score_predictions(table, OmegaConf.merge(cfg, {"scoring": "pairs"}))["best_of_k_accuracy"] == 0.9
    assert score_predictions(table, OmegaConf.merge(cfg, {"kwise_tie_rule": "strict"}))["best_of_k_accuracy"] == 0.8
    with pytest.raises(UserError, match="metric.kwise_tie_rule='lenient' is invalid: allowed values are official"):
        check_tie_rule("lenient")
    from rewarduq_exp.runner.validation import validate_metric_config  # the run checks it before any heavy work

    with pytest.raises(UserError, match="^metric.kwise_tie_rule='lenient' is invalid: allowed values are "
                                        "official, strict$"):
        validate_metric_config(OmegaConf.merge(cfg, {"kwise_tie_rule": "lenient"}))
    with pytest.raises(UserError, match="K-wise"):
        score_predictions(table, OmegaConf.merge(cfg, {"scoring": "reward_bench"}))
    figures = diagrams(table, tmp_path / "fig", cfg, title="kwise")
    assert figures and all(Path(f).is_file() for f in figures)
    assert "top1_reliability.png" in {Path(f).name for f in figures}


# ---------------------------------------------------------------------------------------------------------------
# Appendix D of the label-ranking paper: a reward model's K scores as a ranking distribution
# ---------------------------------------------------------------------------------------------------------------


REWARDS = np.array([[np.log(4), np.log(2), 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # softmax: (.5,.25,.125,.125), .25 each
BEST = np.array([0, 2])


def test_top1_calibration_by_hand():
    """Pooled (context, position): bin [.1,.2) holds two .125 (labels 0,0); [.2,.3) five .25 (labels 0,0,0,1,0);
    [.5,.6) one .5 (label 1): ECE = 2/8 * .125 + 5/8 * |.2 - .25| + 1/8 * .5 = 0.125."""
    res = kw.top1_calibration(REWARDS, BEST, n_bins=10)
    assert res.ece == pytest.approx(0.125, abs=1e-12)
    assert (res.curve.weight == [0, 2, 5, 0, 0, 1, 0, 0, 0, 0]).all()
    assert res.curve.accuracy[2] == pytest.approx(0.2) and res.curve.confidence[2] == pytest.approx(0.25)
    assert (res.n_contexts, res.n_predictions) == (2, 8)
    # Two bins: [0,.5) holds the seven others (mean q .2143, one label 1); [.5,1] the .5 with label 1.
    two = kw.top1_calibration(REWARDS, BEST, n_bins=2)
    assert two.ece == pytest.approx(7 / 8 * abs(1 / 7 - 1.5 / 7) + 1 / 8 * 0.5, abs=1e-12)


def test_top1_calibration_invariances_and_varying_k():
    shifted = REWARDS + np.array([[3.0], [-7.5]])
    assert kw.top1_calibration(shifted, BEST).ece == pytest.approx(kw.top1_calibration(REWARDS, BEST).ece, abs=1e-12)
    # Rows with different response counts: a list of arrays or NaN padding give the same result.
    rows = [REWARDS[0], REWARDS[1], np.array([1.0, 2.0, 0.5, 0.0, -1.0, 3.0])]
    best = np.array([0, 2, 5])
    padded = np.full((3, 6), np.nan)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    a, b = kw.top1_calibration(rows, best), kw.top1_calibration(padded, best)
    assert a.ece == pytest.approx(b.ece, abs=1e-15) and a.n_predictions == b.n_predictions == 14
    np.testing.assert_allclose(np.nansum(kw.plackett_luce_top1(padded), axis=1), 1.0)


def test_pairwise_calibration_and_chosen_only():
    rewards = np.array([[np.log(3), 0.0, np.log(1.5)]])  # correct first: P(0>1) = 3/4, P(0>2) = 3/4.5
    res = kw.pairwise_calibration(rewards, np.array([0]), n_bins=10)
    # rows (.75, 1), (2/3, 1), (.25, 0), (1/3, 0), one per bin: ECE = (.25 + 1/3 + .25 + 1/3) / 4
    assert res.ece == pytest.approx(7 / 24, abs=1e-12) and res.n_predictions == 4
    # The pairwise PL marginal w_i / (w_i + w_j) equals sigmoid(r_i - r_j) (symmetric rows: invariant to shifts).
    shifted = kw.pairwise_calibration(rewards + 10.0, np.array([0]), n_bins=10)
    assert shifted.ece == pytest.approx(res.ece, abs=1e-12)
    # Chosen-only (the reference's RB2 number) is 1 - mean p_chosen: (.5 + .25) / 2 here.
    assert kw.chosen_only_ece(REWARDS, BEST) == pytest.approx(1 - 0.375, abs=1e-15)
    assert kw.chosen_only_ece(REWARDS) == pytest.approx(1 - (0.5 + 0.25) / 2, abs=1e-15)  # index 0 by default
    p = kw.plackett_luce_top1(REWARDS)
    assert kw.chosen_only_ece(REWARDS, np.array([1, 3])) == pytest.approx(1 - (p[0, 1] + p[1, 3]) / 2)


def test_kwise_bad_input():
    with pytest.raises(UserError, match="best_index"):
        kw.top1_calibration(REWARDS, np.array([0, 4]))
    with pytest.raises(UserError, match="padding"):
        kw.top1_calibration(np.array([[1.0, np.nan, 2.0]]), np.array([0]))
    with pytest.raises(UserError, match="at least 2"):
        kw.top1_calibration([np.array([1.0])], np.array([0]))
