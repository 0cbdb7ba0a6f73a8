"""scripts/uq_methods_table.py: the methods side by side over worlds, from run folders (made up here: a config and
a metrics.json each, as train.py writes them)."""

import json
import sys

import numpy as np
import pytest
from conftest import ROOT
from scipy.stats import t as t_dist

sys.path.insert(0, str(ROOT / "scripts"))
import uq_methods_table  # noqa: E402

TARGETS = {"ens_mlp": "rewarduq_exp.methods.ens_mlp.EnsMLP", "knn": "rewarduq_exp.methods.knn.KnnHead"}


def _run(folder, method, world, seed, win_rate):
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(
        f"seed: {seed}\nmethod:\n  _target_: {TARGETS[method]}\ndataset:\n  seed: {world}\n  filler_bias: 1\n")
    (folder / "metrics.json").write_text(json.dumps({"synthetic_eval": {"win_rate": win_rate, "ece": None}}))


def test_levels_and_paired_differences_are_t_intervals_over_the_worlds_seed_means(tmp_path):
    rng = np.random.default_rng(0)
    values = {}
    for method in TARGETS:
        for world in range(3):
            for seed in range(2):
                values[method, world, seed] = float(rng.uniform(0.5, 0.9))
                _run(tmp_path / f"{method}-{world}-{seed}", method, world, seed, values[method, world, seed])
    table = uq_methods_table.over_worlds(
        uq_methods_table.world_means(uq_methods_table.read_runs([tmp_path], ("win_rate", "ece"))), "ens_mlp")
    row = table[(table.method == "knn") & (table.metric == "win_rate")].iloc[0]
    per_world = {m: np.array([np.mean([values[m, w, s] for s in range(2)]) for w in range(3)]) for m in TARGETS}
    diff = per_world["knn"] - per_world["ens_mlp"]
    half = t_dist.ppf(0.975, 2) * diff.std(ddof=1) / np.sqrt(3)
    assert row.vs_baseline == pytest.approx(diff.mean())
    assert (row.vs_lo, row.vs_hi) == pytest.approx((diff.mean() - half, diff.mean() + half))
    assert row.level == pytest.approx(per_world["knn"].mean()) and row.worlds == 3 and row.seeds == 2
    assert row.strength == 1
    # a metric the runs left undefined (null in metrics.json) is no number, not a zero
    assert np.isnan(table[(table.method == "knn") & (table.metric == "ece")].iloc[0].level)
    text = uq_methods_table.markdown(table, "ens_mlp", ("win_rate", "ece"))
    assert "| knn − ens_mlp |" in text and "filler_bias=1" in text


def test_no_runs_is_a_one_line_exit(tmp_path):
    with pytest.raises(SystemExit, match="no finished runs"):
        uq_methods_table.read_runs([tmp_path], ("win_rate",))
