"""A probe that a baseline of the same run matches or beats says so: one log line per rated eval set, flags in its
metrics, a line under the summary table and a red note in probe.png, which also shows the probe's partial
correlation given length. Scored here through the runner's own ``evaluate_pointwise`` with a stand-in method (no
backbone), on rated texts whose score is a function of their length."""

import logging
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from rewarduq_exp.methods.base import Scores
from rewarduq_exp.metrics import probe
from rewarduq_exp.metrics.probe_rivals import MATCH_MARGIN, rival_flags, rival_line
from rewarduq_exp.runner.evaluation import evaluate_pointwise
from rewarduq_exp.runner.summary import summary_table
from rewarduq_exp.runs.run_folder import RunFolder

# The outside measurement that asked for the line: SmolLM2-135M on summaries rated for informativeness.
BEATEN = {"probe/alpha_interval": 0.667, "probe/pearson": 0.70, "probe/partial_pearson_given_length": 0.23,
          "probe/baseline/length_ridge/alpha_interval": 0.756, "probe/baseline/length_ridge/constant": False,
          "probe/baseline/mean_pool_ridge/alpha_interval": 0.50, "probe/baseline/mean_pool_ridge/constant": False,
          "probe/baseline/score_judge/constant": True}  # a constant judge has no alpha: it neither matches nor beats


def test_a_baseline_that_beats_the_probe_is_named_with_both_alphas_and_the_partial_correlation():
    line = rival_line("news_eval", BEATEN)
    assert line == ("news_eval: a baseline matches or beats the probe: length_ridge beats it (alpha 0.756) vs the "
                    f"probe's alpha 0.667 (interval K-alpha; within {MATCH_MARGIN} counts as a match); the probe's "
                    "partial correlation with the ratings given length is 0.230")
    assert rival_flags(BEATEN) == {
        "probe/baseline/length_ridge/matches_probe": True, "probe/baseline/mean_pool_ridge/matches_probe": False,
        "probe/baseline/score_judge/matches_probe": False, "probe/matched_by_baseline": True,
        "probe/baseline_match_margin": MATCH_MARGIN}


@pytest.mark.parametrize(("gap", "said"), [(MATCH_MARGIN / 2, "matches"), (0.0, "matches"), (-0.001, "beats"),
                                           (MATCH_MARGIN + 0.001, None), (0.3, None)])
def test_the_margin_decides_between_a_match_and_a_probe_ahead(gap, said):
    metrics = {**BEATEN, "probe/baseline/length_ridge/alpha_interval": 0.667 - gap}
    line = rival_line("news_eval", metrics)
    assert (line is None) == (said is None)
    if said:
        assert f"length_ridge {said} it" in line
    assert rival_flags(metrics)["probe/matched_by_baseline"] is (said is not None)


def test_no_line_without_a_probe_alpha_or_without_baselines():
    assert rival_line("x", {**BEATEN, "probe/alpha_interval": float("nan")}) is None
    assert rival_line("x", {"probe/alpha_interval": 0.5}) is None
    assert rival_line("pairs", {"win_rate": 0.7}) is None  # a preference block
    assert rival_flags({"probe/alpha_interval": 0.5})["probe/matched_by_baseline"] is False


def test_the_summary_table_prints_the_line_under_it_only_for_a_beaten_probe():
    ahead = {**BEATEN, "probe/baseline/length_ridge/alpha_interval": 0.1}
    table = summary_table({"news_eval": BEATEN, "news_ood": ahead})
    assert table.splitlines()[-1] == f"warning: {rival_line('news_eval', BEATEN)}"
    assert "news_ood: a baseline" not in table
    assert "matches or beats" not in summary_table({"news_ood": ahead})


class LengthWorld:
    """A stand-in pointwise method: the probe's scores are the ratings plus ``probe_noise``, the length ridge's the
    part of the ratings that length explains (``rated_by_length``) plus ``ridge_noise``."""

    beta = 1.0
    settings = SimpleNamespace(score_range=[1, 5])   # a method's settings dataclass, as far as evaluation reads it

    def __init__(self, data: pd.DataFrame, probe_noise: float, ridge_noise: float, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.prediction = data["score"].to_numpy() + rng.normal(0, probe_noise, len(data))
        self.ridge = data["by_length"].to_numpy() + rng.normal(0, ridge_noise, len(data))

    def score(self, prompts, responses) -> Scores:
        u = np.full(len(responses), 0.2) + np.arange(len(responses)) / (10 * len(responses))
        return Scores(self.prediction, u)

    def response_lengths(self, responses) -> np.ndarray:
        words = np.array([len(r.split()) for r in responses], dtype=float)
        return np.c_[[len(r) for r in responses], words, 1.3 * words]

    def baselines(self, data) -> dict:
        return {"length_ridge": self.ridge}


def rated_by_length(n: int = 120) -> pd.DataFrame:
    """Rated texts whose rating is mostly their length (1 + 4 * (words - 3) / 56) plus a little of something else."""
    rng = np.random.default_rng(1)
    words = rng.integers(3, 60, n)
    by_length = 1 + 4 * (words - 3) / 56
    return pd.DataFrame({"id": [f"r{i}" for i in range(n)], "subset": "", "prompt": ["Summarise."] * n,
                         "response": [" ".join(["word"] * int(w)) for w in words], "by_length": by_length,
                         "score": by_length + rng.normal(0, 0.3, n)})


@pytest.fixture
def figures(monkeypatch):
    drawn = []
    monkeypatch.setattr(probe, "save_figure", lambda fig, path: drawn.append(fig))
    return drawn


def _evaluate(tmp_path, probe_noise, ridge_noise, caplog):
    """The block as the run's metrics.json holds it, and the log lines that name a rival baseline."""
    data = rated_by_length()
    folder = RunFolder(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="rewarduq_exp.runner.evaluation"):
        metrics, _ = evaluate_pointwise(LengthWorld(data, probe_noise, ridge_noise), data, "by_length", folder,
                                        OmegaConf.create({"diagrams": True}))
    folder.write_metrics({"by_length": metrics})
    return folder.read_metrics()["by_length"], [r.getMessage() for r in caplog.records
                                                if "matches or beats" in r.getMessage()]


def test_a_run_whose_length_ridge_wins_logs_it_records_it_and_draws_it(tmp_path, caplog, figures):
    metrics, lines = _evaluate(tmp_path, probe_noise=0.8, ridge_noise=0.05, caplog=caplog)
    assert metrics["probe/baseline/length_ridge/alpha_interval"] > metrics["probe/alpha_interval"]
    assert lines == [rival_line("by_length", metrics)] and "by_length: a baseline matches" in lines[0]
    assert metrics["probe/matched_by_baseline"] is True and metrics["probe/baseline/length_ridge/matches_probe"]
    partial = f"{metrics['probe/partial_pearson_given_length']:.2f}"
    (fig,) = figures
    agreement, error = fig.axes[2], fig.axes[3]
    assert [t.get_text() for t in agreement.get_xticklabels()] == ["K-alpha", "Pearson", "partial r | length"]
    assert partial in [t.get_text() for t in agreement.texts]  # the partial correlation's bar, labelled
    assert f"partial r given length {metrics['probe/partial_pearson_given_length']:.3f}" in fig.axes[0].get_title()
    # the RMSEs sit on an axis of their own, one bar per model
    assert len(error.patches) == 2 and error.get_ylabel() == "RMSE"
    assert agreement.get_ylim()[1] < 2
    assert any("length_ridge beats it" in t.get_text() for t in fig.texts)


def test_a_probe_that_clearly_wins_says_nothing(tmp_path, caplog, figures):
    metrics, lines = _evaluate(tmp_path, probe_noise=0.05, ridge_noise=1.5, caplog=caplog)
    assert metrics["probe/alpha_interval"] > metrics["probe/baseline/length_ridge/alpha_interval"] + MATCH_MARGIN
    assert lines == [] and metrics["probe/matched_by_baseline"] is False
    assert metrics["probe/baseline/length_ridge/matches_probe"] is False
    assert [t.get_text() for t in figures[0].texts] == ["by_length"]  # the title, no red note
