"""scripts/select_runs.py, table1.py and figures.py end to end on fake run folders, plus Table 1 and figure units."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from entry_points import run_entry_point
from fake_runs import block, make_run
from omegaconf import OmegaConf
from test_selection import finding_sweep

from rewarduq_exp.analysis.paper_figures import figure3, shown_configurations
from rewarduq_exp.analysis.selection import select
from rewarduq_exp.analysis.table1 import model_order, table1_frame, table1_latex, table1_markdown
from rewarduq_exp.runs.run_records import find_runs

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """Two methods x two backbones x two learning rates x two seeds, in two parts; BAY-LIN on 4B never passes."""
    root = tmp_path_factory.mktemp("multirun")
    for method in ("ens_mlp", "bay_lin"):
        for model in ("qwen3-4b", "qwen3-0.6b"):
            for lr, gain in ((1e-3, 0.1), (1e-2, 0.0)):
                for seed in (0, 1):
                    ece = 0.08 if (method, model) == ("bay_lin", "qwen3-4b") else 0.03
                    rs = 0.2 + gain + 0.01 * seed
                    metrics = {"ultrafeedback_test": block(rs=rs, ece=ece),
                               "reward_bench_filtered": block(rs=rs - 0.05, ece=ece + 0.01)}
                    make_run(root / f"part{seed}", f"{method}-{model}-{lr}-{seed}", method=method, model=model,
                             hp={"learning_rate": lr}, seed=seed, metrics=metrics, with_predictions=True)
    make_run(root / "part0", "crashed", hp={"learning_rate": 1e-4}, state="failed")
    return root


def run_script(name: str, *args) -> subprocess.CompletedProcess:
    """``python scripts/<name> <args>`` (in this process, see tests/entry_points.py)."""
    return run_entry_point(ROOT / "scripts" / name, list(args), ROOT)


def test_select_script(sweep, tmp_path):
    out = tmp_path / "sel"
    proc = run_script("select_runs.py", sweep / "part0", sweep / "part1", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert (out / "selection.csv").is_file() and (out / "selection.md").is_file()
    # The winner comes first in each group's table, and the group without a passing configuration says so.
    assert "ens_mlp / qwen3-0.6b (trained on ultrafeedback): winner learning_rate=1e-3" in proc.stdout
    assert "bay_lin / qwen3-4b (trained on ultrafeedback): NO configuration passes" in proc.stdout
    assert "not used: 1 failed" in proc.stdout
    tuned = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.yaml"))
    assert tuned == ["bay_lin/qwen3-0.6b.yaml", "ens_mlp/qwen3-0.6b.yaml", "ens_mlp/qwen3-4b.yaml"]
    assert OmegaConf.load(out / "ens_mlp" / "qwen3-4b.yaml").method == {"learning_rate": 1e-3}


def test_select_script_bad_dataset_is_one_line(sweep, tmp_path):
    proc = run_script("select_runs.py", sweep, "--dataset", "nope", "--out", tmp_path / "sel")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "'nope'" in lines[0] and "reward_bench_filtered, ultrafeedback_test" in lines[0]
    assert not (tmp_path / "sel").exists()


def test_select_script_says_what_filtered_and_takes_the_sources(tmp_path):
    """Raw thresholds pass 1 of 4 configurations, recalibrated ones all 4: the report counts both whichever filters,
    and each choice of --filter-on / --rank-on picks its own winner (tests/test_selection.py, FINDING)."""
    root = finding_sweep(tmp_path / "sweep")
    paper = run_script("select_runs.py", root, "--out", tmp_path / "paper")
    assert paper.returncode == 0, paper.stderr
    assert paper.stdout.startswith("rule: ultrafeedback_test, ECE <= 0.05, EBCE <= 0.01, best rs_0.2; filtered on "
                                   "raw metrics, as the paper does; ranked by raw rs_0.2\n")
    assert "winner learning_rate=1e-5 -> rs_0.2 = 0.3000 (2 seeds); 1 of 4 configurations pass" in paper.stdout
    assert ("configurations passing ECE <= 0.05: raw 2 of 4 (3 of 5 runs), recalibrated 4 of 4 (5 of 5 runs); "
            "EBCE <= 0.01: raw 2 of 4 (3 of 5 runs), recalibrated 4 of 4 (5 of 5 runs); both: raw 1 of 4 "
            "(2 of 5 runs), recalibrated 4 of 4 (5 of 5 runs); filtered on raw metrics, as the paper does\n"
            ) in paper.stdout
    assert "filter nothing" not in paper.stdout

    recal_filter = run_script("select_runs.py", root, "--filter-on", "recalibrated", "--out", tmp_path / "f")
    assert recal_filter.returncode == 0, recal_filter.stderr
    assert "winner learning_rate=0.01 -> rs_0.2 = 0.7000 (1 seed); 4 of 4 configurations pass" in recal_filter.stdout
    assert ("every configuration passes the recalibrated thresholds: they filter nothing here, the pick is the best "
            "rs_0.2 alone") in recal_filter.stdout
    assert OmegaConf.load(tmp_path / "f" / "ens_mlp" / "qwen3-0.6b.yaml").method == {"learning_rate": 1e-2}

    # --recalibrated is the shorthand for both: the same report as the two options given
    both = run_script("select_runs.py", root, "--filter-on", "recalibrated", "--rank-on", "recalibrated",
                      "--out", tmp_path / "both")
    short = run_script("select_runs.py", root, "--recalibrated", "--out", tmp_path / "short")
    assert both.returncode == 0 == short.returncode, both.stderr + short.stderr
    assert "winner learning_rate=1e-4 -> recal/rs_0.2 = 0.4000" in short.stdout
    assert (tmp_path / "both" / "selection.csv").read_text() == (tmp_path / "short" / "selection.csv").read_text()
    assert "ranked by recalibrated rs_0.2 (recal/rs_0.2; the paper ranks by the raw one)" in (
        tmp_path / "short" / "selection.md").read_text()

    table = run_script("table1.py", root, "--filter-on", "recalibrated", "--out", tmp_path / "t1")
    assert table.returncode == 0, table.stderr
    assert "filtered on recalibrated metrics (recal/ece, recal/ebce" in (tmp_path / "t1" / "table1.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--filter-on", "recal"], "argument --filter-on: invalid choice: 'recal'"),
    (["--rank-on", "paper"], "argument --rank-on: invalid choice: 'paper'"),
    (["--recalibrated", "--rank-on", "raw"],
     "error: --recalibrated (both recalibrated) contradicts --rank-on raw: give --filter-on and --rank-on instead"),
])
def test_select_script_bad_source_names_the_allowed_ones(tmp_path, args, message):
    root = finding_sweep(tmp_path / "sweep")
    proc = run_script("select_runs.py", root, *args, "--out", tmp_path / "sel")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert message in last and ("recalibrated" in last and "raw" in last)
    assert not (tmp_path / "sel").exists()


def test_table1_script(sweep, tmp_path):
    proc = run_script("table1.py", sweep, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "table1.md").read_text()
    tex = (tmp_path / "table1.tex").read_text()
    assert "| backbone | ENS-MLP η | ENS-MLP RS_0.2 | ENS-MLP ECE | ENS-MLP EBCE | BAY-LIN η |" in md
    assert "| qwen3-4b | 1e-3 | 0.3050 | 0.0300 | 0.0050 | — | — | — | — |" in md
    assert md.index("| qwen3-0.6b |") < md.index("| qwen3-4b |")  # backbones by size
    assert r"\multicolumn{4}{c}{ENS-MLP}" in tex and r"$\eta$" in tex and "---" in tex
    assert md in proc.stdout


def test_figures_script(sweep, tmp_path):
    proc = run_script("figures.py", sweep, "--out", tmp_path, "--models", "qwen3-4b")
    assert proc.returncode == 0, proc.stderr
    assert "plotting reward_bench_filtered" in proc.stdout
    assert "bay_lin / qwen3-4b (ultrafeedback): best rs_0.2, none passes" in proc.stdout
    for stem in ("figure2_rs", "figure3_calibration", "figure4_ranking_score", "figure5_metrics"):
        png = (tmp_path / f"{stem}.png").read_bytes()
        assert png[:8] == PNG_MAGIC and len(png) > 10_000
        assert (tmp_path / f"{stem}.pdf").stat().st_size > 1_000
    bad = run_script("figures.py", sweep, "--out", tmp_path, "--models", "gpt-5")
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown model(s) gpt-5")


def test_table1_frame_and_latex(sweep):
    selections = select(find_runs([sweep]))
    frame = table1_frame(selections)
    assert list(frame.index) == ["qwen3-0.6b", "qwen3-4b"]
    assert frame.loc["qwen3-4b", ("BAY-LIN", "η")] == "—"
    assert frame.loc["qwen3-0.6b", ("BAY-LIN", "RS_0.2")] == "0.3050"
    assert "none of 2 configurations passes" in table1_markdown(selections)
    assert table1_latex(selections).count(r"\\") == 2 + 2  # two header rows, two backbones
    assert sorted(["qwen3-14b", "skywork-qwen3-0.6b", "qwen3-1.7b", "qwen3-0.6b"], key=model_order) == [
        "qwen3-0.6b", "qwen3-1.7b", "qwen3-14b", "skywork-qwen3-0.6b"]


def test_figure3_skipped_without_predictions(tmp_path):
    make_run(tmp_path, "run", metrics={"ultrafeedback_test": block()})
    shown = shown_configurations(select(find_runs([tmp_path])))
    assert figure3(shown, "ultrafeedback_test", tmp_path / "figs") is None
    assert not (tmp_path / "figs").exists()


def rewardbench_predictions(seed: int = 0, n: int = 600):
    """A RewardBench-shaped predictions table: subsets of all four categories, math-prm and hep-* included."""
    import numpy as np
    import pandas as pd

    from rewarduq_exp.metrics.reward_bench import CATEGORY_OF

    rng = np.random.default_rng(seed)
    subsets = rng.choice(sorted(CATEGORY_OF), size=n)
    shift = np.where(np.char.startswith(subsets.astype(str), "hep"), 2.0, 0.3)  # categories differ in accuracy
    cr, rr = rng.normal(size=n) + shift, rng.normal(size=n)
    uc, ur = rng.gamma(2.0, 0.3, n), rng.gamma(2.0, 0.3, n)
    return pd.DataFrame({"id": [f"p{i}" for i in range(n)], "subset": subsets, "weight": 1.0,
                         "chosen_reward": cr, "chosen_lower": cr - uc, "chosen_upper": cr + uc,
                         "rejected_reward": rr, "rejected_lower": rr - ur, "rejected_upper": rr + ur})


@pytest.mark.parametrize("weighting", ["official", "reference"])
def test_figure3_uses_the_reward_bench_weighting_of_the_metrics(tmp_path, weighting):
    """Figure 3 prints the ECE/EBCE of metrics.json and draws curves with the same RewardBench row weights."""
    import yaml

    from rewarduq_exp.analysis.paper_figures import figure3_panel
    from rewarduq_exp.metrics.calibration import calibration_curves
    from rewarduq_exp.metrics.reward_bench import reward_bench_metrics
    from rewarduq_exp.runs.run_records import read_run

    table = rewardbench_predictions()
    metrics = reward_bench_metrics(table, weighting=weighting)
    folder = make_run(tmp_path, "rb", metrics={"reward_bench_filtered": metrics})
    config = yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())
    config["metric"] = {"n_bins": 20, "scoring": "auto", "reward_bench_weighting": weighting}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    record = read_run(folder)
    panel = figure3_panel(record, table, "reward_bench_filtered")
    assert (panel.ece, panel.ebce) == (metrics["ece"], metrics["ebce"])
    assert panel.note == f"RewardBench weighting ({weighting})"
    raw = calibration_curves(table)["pred"].ece()  # the row mix, as Figure 3 drew it before
    assert abs(raw - metrics["ece"]) > 1e-3
    if weighting == "reference":  # pooled over all rows with the reference weights: exactly the metric
        assert panel.curves["pred"].ece() == pytest.approx(metrics["ece"])
    # A run scored before these metrics existed: recomputed the same way.
    (folder / "metrics.json").write_text('{"reward_bench_filtered": {}}')
    again = figure3_panel(read_run(folder), table, "reward_bench_filtered")
    assert again.ece == pytest.approx(metrics["ece"]) and again.ebce == pytest.approx(metrics["ebce"])


def test_ranking_score_weights_and_figure4(tmp_path):
    """Eq. 20: RS_alpha = f_alpha(w) CT/w - f_alpha(1-w) CF/(1-w), and the caption's numbers of Figure 4."""
    import numpy as np

    from rewarduq_exp.analysis.paper_figures import figure4
    from rewarduq_exp.metrics.preference import ranking_score, ranking_score_weight

    f = ranking_score_weight
    # Caption: alpha 0.2, win rate 0.6 -> 0.8: true-confidence weight 0.88 -> 0.95 (x1.08), false 0.77 -> 0.56 (x0.73;
    # the caption's factors are ratios of its rounded weights: 0.56 / 0.77 = 0.727, unrounded 0.722)
    true_w, false_w = (round(f(0.6, 0.2), 2), round(f(0.8, 0.2), 2)), (round(f(0.4, 0.2), 2), round(f(0.2, 0.2), 2))
    assert true_w == (0.88, 0.95) and round(true_w[1] / true_w[0], 2) == 1.08
    assert false_w == (0.77, 0.56) and round(false_w[1] / false_w[0], 2) == 0.73
    x = np.linspace(0, 1, 11)
    assert f(x, 0.0) == pytest.approx(np.ones(11)) and f(x, 1.0) == pytest.approx(x)
    rng = np.random.default_rng(0)
    for _ in range(50):
        ct, ut, cf = rng.dirichlet([1, 1, 1, 1])[:3]
        t, fr, a = ct + ut, 1 - ct - ut, rng.uniform()
        assert ranking_score(ct, cf, t, fr, a) == pytest.approx(f(t, a) * ct / t - f(fr, a) * cf / fr)
    paths = figure4(tmp_path)
    assert [p.suffix for p in paths] == [".png", ".pdf"] and paths[0].read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("weighting", ["official", "reference"])
def test_run_diagrams_use_the_reward_bench_row_weights(tmp_path, monkeypatch, weighting):
    """A run's own figures/<dataset>/calibration_*.png weight RewardBench rows as its metrics do and print the
    metrics.json numbers; other tables are drawn as they are."""
    import numpy as np
    from fake_runs import predictions

    import rewarduq_exp.metrics.diagrams as diagrams_module
    from rewarduq_exp.metrics.reward_bench import CATEGORY_OF, reward_bench_row_weights
    from rewarduq_exp.runner.evaluation import diagrams, score_predictions

    calls = []
    monkeypatch.setattr(diagrams_module, "plot_calibration_diagrams",
                        lambda table, out_dir, **kw: calls.append((table, kw)) or [])
    cfg = OmegaConf.create({"n_bins": 20, "alphas": [0.2], "scoring": "auto", "reward_bench_weighting": weighting})
    table = rewardbench_predictions()
    metrics = score_predictions(table, cfg)
    diagrams(table, tmp_path, cfg, "reward_bench_filtered", metrics=metrics)
    drawn, kw = calls[-1]
    assert np.allclose(drawn["weight"], reward_bench_row_weights(table, weighting))
    per_category = drawn.groupby(table["subset"].map(CATEGORY_OF))["weight"].sum()
    assert np.allclose(per_category, 1.0)  # each category counts equally, as in the metrics
    assert kw["reported"] is metrics and kw["title"] == f"reward_bench_filtered: RewardBench weighting ({weighting})"

    plain = predictions()
    diagrams(plain, tmp_path, cfg, "ultrafeedback_test")
    assert calls[-1][0] is plain and calls[-1][1]["title"] == "ultrafeedback_test"


def test_figure3_panel_follows_the_runs_bins(tmp_path):
    """A run scored with metric.n_bins=10: Figure 3 bins its curves and recomputes missing numbers with 10 bins."""
    import yaml

    from rewarduq_exp.analysis.paper_figures import figure3_panel
    from rewarduq_exp.metrics.reward_bench import reward_bench_metrics
    from rewarduq_exp.runs.run_records import read_run

    table = rewardbench_predictions(seed=1)
    folder = make_run(tmp_path, "rb10", metrics={"reward_bench_filtered": {}})
    config = yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())
    config["metric"] = {"n_bins": 10, "scoring": "auto", "reward_bench_weighting": "official"}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    panel = figure3_panel(read_run(folder), table, "reward_bench_filtered")
    expected = reward_bench_metrics(table, n_bins=10)
    assert len(panel.curves["pred"].weight) == 10
    assert panel.ece == pytest.approx(expected["ece"]) and panel.ebce == pytest.approx(expected["ebce"])
