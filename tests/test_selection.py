"""The selection rule (RewardUQ section 5.1) and the run-folder reader, on fake run folders (tests/fake_runs.py)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from fake_runs import block, make_run
from omegaconf import OmegaConf

from rewarduq_exp.analysis.selection import Criteria, select
from rewarduq_exp.analysis.selection_report import passing_line, write_selection
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.runs.run_records import find_runs

RECAL = Criteria(filter_on="recalibrated", rank_on="recalibrated")  # what --recalibrated means


def uf(rs=0.3, ece=0.02, ebce=0.005, **more) -> dict:
    return {"ultrafeedback_test": block(rs=rs, ece=ece, ebce=ebce, **more)}


def one_group(root, criteria=None):
    (selection,) = select(find_runs([root]), criteria or Criteria())
    return selection


def write_reports(selections, tmp_path, sources=("sweep",)):
    out = tmp_path / "selection"
    tuned = write_selection(selections, out, out, list(sources))
    return out, tuned


# ---------------------------------------------------------------------------------------------------- reader
def test_reader_fields_states_and_nesting(tmp_path):
    root = tmp_path / "sweep"
    make_run(root / "a" / "deeper", "ok", hp={"learning_rate": 1e-4}, seed=3, metrics=uf(rs=0.25))
    make_run(root, "failed", state="failed", error="ValueError: bad thing\nmore detail")
    make_run(root, "never", state="missing")
    make_run(root, "alive", state="running")
    make_run(root, "killed", state="interrupted")
    # Completed per status.json, but metrics.json never got written: missing as well.
    no_metrics = make_run(root, "no_metrics")
    (no_metrics / "metrics.json").unlink()
    # An evaluate.py output folder has a Hydra config without a method: not a training run.
    (root / "evaluate" / ".hydra").mkdir(parents=True)
    (root / "evaluate" / ".hydra" / "config.yaml").write_text("run: somewhere\nmetric: {n_bins: 20}\n")

    runs = {r.path.name: r for r in find_runs([root])}
    assert set(runs) == {"ok", "failed", "never", "alive", "killed", "no_metrics"}
    ok = runs["ok"]
    assert (ok.state, ok.method, ok.model, ok.dataset, ok.seed) == ("completed", "ens_mlp", "qwen3-0.6b",
                                                                     "ultrafeedback", 3)
    # Scalars only, and none of _target_/seed/device/show_progress (the `${...}` ones) or the adam_betas list.
    assert ok.hyperparameters == {"num_heads": 20, "learning_rate": 1e-4, "reg_lambda": 0.1, "center_gamma": 0.01,
                                  "beta": 2.0}
    assert "method.learning_rate=0.0001" in ok.overrides
    assert ok.metrics["ultrafeedback_test"]["rs_0.2"] == 0.25
    assert runs["failed"].state == "failed" and runs["failed"].error == "ValueError: bad thing"
    assert runs["never"].state == "missing" and "status.json missing" in runs["never"].error
    assert runs["no_metrics"].state == "missing" and "metrics.json" in runs["no_metrics"].error
    assert runs["alive"].state == "running" and runs["alive"].metrics == {}
    assert runs["killed"].state == "interrupted" and "is gone" in runs["killed"].error
    # A run folder given directly works too.
    assert [r.path.name for r in find_runs([ok.path])] == ["ok"]


def test_reader_resolves_references_and_lists_a_broken_one_as_corrupt(tmp_path):
    # `${seed}` is the top-level seed; a reference whose target is not in the file makes the run corrupt, named.
    run = make_run(tmp_path / "a", "interp", hp={"num_heads": "${seed}"}, seed=7)
    (record,) = find_runs([run])
    assert record.seed == 7 and record.hyperparameters["num_heads"] == 7
    broken = make_run(tmp_path / "b", "broken", hp={"beta": "${removed.key}"}, seed=7)
    (record,) = find_runs([broken])
    assert record.state == "corrupt" and "method.beta refers to ${removed.key}, which is not a setting" in record.error


def test_reader_rejects_empty_and_missing_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no run folders"):
        find_runs([tmp_path / "empty"])
    with pytest.raises(UserError, match="not a folder"):
        find_runs([tmp_path / "nope"])


# ---------------------------------------------------------------------------------------------------- the rule
def test_picks_best_rs_among_passing_while_better_rs_fails_ece(tmp_path):
    make_run(tmp_path, "a", hp={"learning_rate": 1e-3}, metrics=uf(rs=0.50, ece=0.06))  # best RS, fails ECE
    make_run(tmp_path, "b", hp={"learning_rate": 1e-4}, metrics=uf(rs=0.40, ece=0.03))
    make_run(tmp_path, "c", hp={"learning_rate": 1e-5}, metrics=uf(rs=0.30, ece=0.01))
    make_run(tmp_path, "d", hp={"learning_rate": 1e-2}, metrics=uf(rs=0.45, ebce=0.02))  # fails EBCE
    s = one_group(tmp_path)
    assert s.winner.hyperparameters["learning_rate"] == 1e-4
    assert [c.hyperparameters["learning_rate"] for c in s.passing] == [1e-4, 1e-5]
    assert [c.rank for c in s.passing] == [1, 2]
    failing = {c.hyperparameters["learning_rate"]: c for c in s.failing}
    assert not failing[1e-3].passes("ece") and failing[1e-3].passes("ebce")
    assert failing[1e-3].excess("ece") == pytest.approx(0.01)
    assert not failing[1e-2].passes("ebce") and failing[1e-2].rank is None


def test_thresholds_are_inclusive_and_configurable(tmp_path):
    make_run(tmp_path, "edge", hp={"learning_rate": 1e-3}, metrics=uf(rs=0.2, ece=0.05, ebce=0.01))
    make_run(tmp_path, "over", hp={"learning_rate": 1e-4}, metrics=uf(rs=0.9, ece=0.0500001, ebce=0.01))
    s = one_group(tmp_path)
    assert s.winner.hyperparameters["learning_rate"] == 1e-3  # exactly at both thresholds passes
    assert len(s.passing) == 1
    # Looser thresholds let the better one in; another rank metric changes the order.
    assert one_group(tmp_path, Criteria(ece=0.06)).winner.hyperparameters["learning_rate"] == 1e-4
    assert one_group(tmp_path, Criteria(ece=0.06, rank="rs_1.0")).winner.score == pytest.approx(0.8)
    with pytest.raises(UserError, match="--ece"):
        Criteria(ece=-1)


def test_seeds_are_averaged(tmp_path):
    # "lucky": one great seed, mean 0.2667; "steady": mean 0.30. The mean decides.
    for seed, rs in enumerate([0.6, 0.1, 0.1]):
        make_run(tmp_path, f"lucky_s{seed}", hp={"reg_lambda": 0.0}, seed=seed, metrics=uf(rs=rs))
    for seed, rs in enumerate([0.29, 0.30, 0.31]):
        make_run(tmp_path, f"steady_s{seed}", hp={"reg_lambda": 1.0}, seed=seed, metrics=uf(rs=rs))
    s = one_group(tmp_path)
    assert len(s.configurations) == 2
    w = s.winner
    assert w.hyperparameters["reg_lambda"] == 1.0 and w.n_seeds == 3 and w.seeds == [0, 1, 2]
    assert w.score == pytest.approx(0.30) and w.std["rs_0.2"] == pytest.approx(0.01)
    lucky = s.passing[1]
    assert lucky.score == pytest.approx(0.8 / 3) and lucky.rank == 2


def test_thresholds_apply_to_the_mean_over_seeds(tmp_path):
    # One seed over the ECE threshold, the mean under it: passes. Single seed: std undefined (NaN).
    make_run(tmp_path, "s0", hp={"learning_rate": 1e-3}, seed=0, metrics=uf(ece=0.07))
    make_run(tmp_path, "s1", hp={"learning_rate": 1e-3}, seed=1, metrics=uf(ece=0.02))
    make_run(tmp_path, "single", hp={"learning_rate": 1e-4}, seed=0, metrics=uf(ece=0.01, rs=0.1))
    s = one_group(tmp_path)
    assert s.winner.mean["ece"] == pytest.approx(0.045) and s.winner.n_seeds == 2
    assert math.isnan(s.passing[1].std["rs_0.2"])


def test_several_parts_are_merged_and_duplicates_counted_once(tmp_path):
    for seed in (0, 1):
        for lr, rs in ((1e-3, 0.3), (1e-4, 0.2)):
            make_run(tmp_path / f"part{seed + 1}", f"lr={lr},seed={seed}", hp={"learning_rate": lr}, seed=seed,
                     metrics=uf(rs=rs + 0.01 * seed))
    # The same seed finished again in a third folder (a relaunch elsewhere): used once.
    make_run(tmp_path / "part3", "again", hp={"learning_rate": 1e-3}, seed=1, metrics=uf(rs=0.31))
    records = find_runs([tmp_path / "part1", tmp_path / "part2", tmp_path / "part3"])
    (s,) = select(records)
    assert [c.n_seeds for c in s.configurations] == [2, 2]
    assert s.winner.hyperparameters["learning_rate"] == 1e-3 and s.winner.score == pytest.approx(0.305)
    assert len(s.duplicates) == 1
    out, _ = write_reports([s], tmp_path, ["part1", "part2", "part3"])
    csv = (out / "selection.csv").read_text().splitlines()
    assert len(csv) == 1 + 2  # header + one row per configuration


def test_dataset_and_rank_metric_are_checked(tmp_path):
    make_run(tmp_path, "a", metrics={"reward_bench_filtered": block(), "synthetic_eval": block()})
    with pytest.raises(UserError, match="datasets found: reward_bench_filtered, synthetic_eval"):
        select(find_runs([tmp_path]))
    with pytest.raises(UserError, match="metric 'rs_9' .* metrics found: .*rs_0.2"):
        select(find_runs([tmp_path]), Criteria(dataset="synthetic_eval", rank="rs_9"))


# ---------------------------------------------------------------------------------------------------- reports
def test_tuned_yaml_holds_exactly_the_searched_keys(tmp_path):
    # learning_rate and reg_lambda vary (the grid); center_gamma and the rest are the same everywhere.
    grid = [(1e-3, 0.0, 0.20), (1e-3, 0.1, 0.25), (1e-5, 0.0, 0.30), (1e-5, 0.1, 0.10)]
    for lr, lam, rs in grid:
        make_run(tmp_path / "sweep", f"{lr}-{lam}", hp={"learning_rate": lr, "reg_lambda": lam, "center_gamma": 0.0},
                 metrics=uf(rs=rs))
    selections = select(find_runs([tmp_path / "sweep"]))
    out, tuned = write_reports(selections, tmp_path)
    path = out / "ens_mlp" / "qwen3-0.6b.yaml"
    assert tuned == {("ens_mlp", "qwen3-0.6b", "ultrafeedback"): path}
    text = path.read_text()
    lines = text.splitlines()
    assert lines[0] == "# @package _global_"
    assert lines[1] == ("# Selected by scripts/select_runs.py from sweep: ultrafeedback_test, ECE <= 0.05, "
                        "EBCE <= 0.01, best rs_0.2 = 0.3000 (1 seed); filtered on raw metrics, as the paper does; "
                        "ranked by raw rs_0.2.")
    assert lines[2:] == ["method:", "  learning_rate: 1.0e-05", "  reg_lambda: 0.0"]
    loaded = OmegaConf.to_container(OmegaConf.load(path))
    assert loaded == {"method": {"learning_rate": 1e-5, "reg_lambda": 0.0}}
    assert isinstance(loaded["method"]["learning_rate"], float)


def test_one_tuned_file_per_method_and_backbone(tmp_path):
    for method, model in (("ens_mlp", "qwen3-0.6b"), ("ens_mlp", "qwen3-4b"), ("bay_lin", "qwen3-0.6b")):
        for lr, rs in ((1e-3, 0.2), (1e-2, 0.3)):
            make_run(tmp_path, f"{method}-{model}-{lr}", method=method, model=model, hp={"learning_rate": lr},
                     metrics=uf(rs=rs))
    selections = select(find_runs([tmp_path]))
    out, tuned = write_reports(selections, tmp_path)
    assert sorted(p.relative_to(out).as_posix() for p in tuned.values()) == [
        "bay_lin/qwen3-0.6b.yaml", "ens_mlp/qwen3-0.6b.yaml", "ens_mlp/qwen3-4b.yaml"]
    for p in tuned.values():
        assert OmegaConf.load(p).method == {"learning_rate": 1e-2}


def test_markdown_lists_failed_and_missing_runs(tmp_path):
    make_run(tmp_path, "good", hp={"learning_rate": 1e-3}, metrics=uf(rs=0.4))
    make_run(tmp_path, "bad_ece", hp={"learning_rate": 1e-2}, metrics=uf(rs=0.5, ece=0.08))
    make_run(tmp_path, "crashed", hp={"learning_rate": 1e-4}, state="failed",
             error="RuntimeError: CUDA out of memory\nsecond line")
    make_run(tmp_path, "never_ran", hp={"learning_rate": 1e-5}, state="missing")
    out, _ = write_reports(select(find_runs([tmp_path])), tmp_path)
    md = (out / "selection.md").read_text()
    assert "**Winner:** learning_rate=1e-3" in md
    assert "### Passing both thresholds (1)" in md and "### Failing a threshold (1" in md
    assert "| 0.01 | 1 | 0.5000 | 0.0800 | +0.0300 |" in md  # how far it misses ECE
    assert "### Failed runs (1)" in md and "RuntimeError: CUDA out of memory" in md and "second line" not in md
    assert "### Missing runs" in md and str(tmp_path / "never_ran") in md
    assert "Runs: 4 (2 completed, 1 failed, 1 missing)" in md


def test_runs_with_invalid_settings_are_listed_apart_and_add_no_columns(tmp_path):
    """A run that failed validating its settings (a typo'd key, a value out of range) is not a grid point: it is
    listed as invalid (not as missing or as a crash), and its keys do not become columns of the tables."""
    make_run(tmp_path, "a", hp={"learning_rate": 1e-3}, metrics=uf(rs=0.4))
    make_run(tmp_path, "b", hp={"learning_rate": 1e-2}, metrics=uf(rs=0.3))
    make_run(tmp_path, "typo", hp={"learning_rate": 1e-3, "num_head": 3}, state="invalid",
             error="UserError: method.num_head is not a setting of EnsMLP; allowed: num_heads, ...")
    selection = one_group(tmp_path)
    assert selection.searched == ["learning_rate"]
    assert [r.path.name for r in selection.by_state("invalid")] == ["typo"] and not selection.by_state("failed")
    out, _ = write_reports([selection], tmp_path)
    md = (out / "selection.md").read_text()
    assert "### Invalid settings (failed validation; nothing ran) (1)" in md and "num_head is not a setting" in md
    assert "Runs: 3 (2 completed, 1 invalid)" in md and "num_head |" not in md
    assert "num_head" not in (out / "selection.csv").read_text().splitlines()[0].split(",")


def test_no_configuration_passes(tmp_path):
    make_run(tmp_path, "near", hp={"learning_rate": 1e-3}, metrics=uf(rs=0.2, ece=0.06, ebce=0.01))
    make_run(tmp_path, "far", hp={"learning_rate": 1e-2}, metrics=uf(rs=0.9, ece=0.10, ebce=0.03))
    s = one_group(tmp_path)
    assert s.winner is None
    assert [c.hyperparameters["learning_rate"] for c in s.closest()] == [1e-3, 1e-2]  # by total excess
    assert s.closest()[1].miss == pytest.approx(0.05 + 0.02)
    best, passed = s.best_effort()
    assert best.hyperparameters["learning_rate"] == 1e-2 and not passed  # figures fall back to the best RS
    out, tuned = write_reports([s], tmp_path)
    assert tuned == {} and not (out / "ens_mlp").exists()
    md = (out / "selection.md").read_text()
    assert "**No configuration passes** ECE <= 0.05 and EBCE <= 0.01" in md
    assert "Closest 2 by total excess" in md
    assert "| 1e-3 | 1 | 0.2000 | 0.0600 | +0.0100 | 0.0100 | +0.0000 | 0.0100 |" in md


# ---------------------------------------------------------------------------------------------------- recalibrated
def test_the_rule_can_read_recalibrated_metrics(tmp_path):
    """Default: the paper's rule on the raw metrics. --recalibrated: the same thresholds and ranking on recal/<metric>;
    here the run that misses the raw thresholds passes after recalibration and wins on its recalibrated RS."""
    root = tmp_path / "sweep"
    recal = {"recal/rs_0.2": 0.45, "recal/ece": 0.01, "recal/ebce": 0.004, "recal/win_rate": 0.7,
             "recal/ct_rate": 0.5, "recal/cf_rate": 0.02}
    make_run(root, "calibrated_raw", hp={"learning_rate": 1e-4}, metrics=uf(rs=0.3, **{**recal, "recal/rs_0.2": 0.2}))
    make_run(root, "miscalibrated_raw", hp={"learning_rate": 1e-3}, metrics=uf(rs=0.5, ece=0.2, ebce=0.03, **recal))
    make_run(root, "old_run", hp={"learning_rate": 1e-2}, metrics=uf(rs=0.9))   # no recal/ metrics at all
    raw = one_group(root)
    assert raw.winner.hyperparameters["learning_rate"] == 1e-2
    after = one_group(root, RECAL)
    assert after.winner.hyperparameters["learning_rate"] == 1e-3
    assert after.winner.mean["ece"] == 0.01 and after.winner.mean["rs_0.2"] == 0.45
    assert [c.hyperparameters["learning_rate"] for c in after.passing] == [1e-3, 1e-4]
    assert "filtered on recalibrated metrics (recal/ece, recal/ebce" in RECAL.describe()
    assert "filtered on raw metrics, as the paper does; ranked by raw rs_0.2" in Criteria().describe()
    only_old = tmp_path / "old"
    make_run(only_old, "old_run", metrics=uf())
    with pytest.raises(UserError, match="no run has recalibrated metrics .*--rank-on raw"):
        select(find_runs([only_old]), RECAL)
    # ranking raw but filtering on recalibrated metrics none of the runs has: named as well
    with pytest.raises(UserError, match=r"no run has recalibrated metrics \(recal/ece, recal/ebce\).*--filter-on raw"):
        select(find_runs([only_old]), Criteria(filter_on="recalibrated"))


# ---------------------------------------------------------------------------------------------------- what filtered
# Four configurations: on raw metrics one passes both thresholds (A, two seeds), B misses ECE, C misses EBCE, D both;
# after recalibration all four pass, so filtering on recalibrated metrics leaves the ranking alone to pick.
FINDING = {  # lr: (raw rs, ece, ebce), (recal rs, ece, ebce)
    1e-5: ((0.30, 0.02, 0.005), (0.31, 0.03, 0.004)),   # A
    1e-4: ((0.50, 0.08, 0.005), (0.40, 0.02, 0.003)),   # B: best recalibrated RS
    1e-3: ((0.60, 0.04, 0.020), (0.35, 0.04, 0.008)),   # C
    1e-2: ((0.70, 0.10, 0.030), (0.33, 0.01, 0.002)),   # D: best raw RS
}


def finding_sweep(root):
    for lr, ((rs, ece, ebce), (rrs, rece, rebce)) in FINDING.items():
        recal = {"recal/rs_0.2": rrs, "recal/ece": rece, "recal/ebce": rebce, "recal/win_rate": 0.7,
                 "recal/ct_rate": 0.4, "recal/cf_rate": 0.05}
        for seed in (0, 1) if lr == 1e-5 else (0,):
            make_run(root, f"lr={lr},seed={seed}", hp={"learning_rate": lr}, seed=seed,
                     metrics=uf(rs=rs, ece=ece, ebce=ebce, **recal))
    return root


def test_passing_counts_on_raw_and_recalibrated_metrics_whichever_filters(tmp_path):
    root = finding_sweep(tmp_path / "sweep")
    for criteria in (Criteria(), RECAL):
        s = one_group(root, criteria)
        # (configurations, runs in them): A holds two seeds
        assert s.passing_counts("raw") == {"ece": (2, 3), "ebce": (2, 3), "both": (1, 2)}
        assert s.passing_counts("recalibrated") == {"ece": (4, 5), "ebce": (4, 5), "both": (4, 5)}
    assert not one_group(root).filters_nothing and one_group(root, RECAL).filters_nothing
    (b,) = (c for c in one_group(root).configurations if c.hyperparameters["learning_rate"] == 1e-4)
    assert b.passes("ece", "recalibrated") and not b.passes("ece", "raw") and not b.passes("ece")
    with pytest.raises(UserError, match="on 'both' is invalid: allowed: raw, recalibrated"):
        b.passes("ece", "both")


@pytest.mark.parametrize("filter_on, rank_on, lr, score", [
    ("raw", "raw", 1e-5, 0.30),                    # the paper: only A passes
    ("raw", "recalibrated", 1e-5, 0.31),           # still only A passes the raw filter
    ("recalibrated", "recalibrated", 1e-4, 0.40),  # --recalibrated: all pass, best recal/rs_0.2
    ("recalibrated", "raw", 1e-2, 0.70),           # all pass, best raw rs_0.2
])
def test_the_winner_under_each_filter_and_rank(tmp_path, filter_on, rank_on, lr, score):
    s = one_group(finding_sweep(tmp_path / "sweep"), Criteria(filter_on=filter_on, rank_on=rank_on))
    assert s.winner.hyperparameters["learning_rate"] == lr and s.winner.score == pytest.approx(score)
    assert len(s.passing) == (1 if filter_on == "raw" else 4)
    # the rule's ECE is the one it filtered on; its RS the one it ranked on
    assert s.winner.mean["ece"] == FINDING[lr][filter_on == "recalibrated"][1]


@pytest.mark.parametrize("option, value", [("filter_on", "recal"), ("rank_on", "paper"), ("filter_on", True)])
def test_a_bad_source_is_one_line_naming_the_allowed_ones(option, value):
    with pytest.raises(UserError) as err:
        Criteria(**{option: value})
    name = "--" + option.replace("_", "-")
    assert str(err.value) == f"{name} {value!r} is invalid: allowed: raw, recalibrated"


def test_the_reports_count_passes_on_both_and_say_what_filtered(tmp_path):
    root = finding_sweep(tmp_path / "sweep")
    out, _ = write_reports(select(find_runs([root])), tmp_path)
    md = (out / "selection.md").read_text()
    assert "then rank by mean `rs_0.2` (higher is better); filtered on raw metrics, as the paper does" in md
    assert "| configurations passing (of 4) | raw | recalibrated |" in md
    assert "| ECE <= 0.05 | 2 of 4 (3 of 5 runs) | 4 of 4 (5 of 5 runs) |" in md
    assert "| both | 1 of 4 (2 of 5 runs) | 4 of 4 (5 of 5 runs) |" in md
    assert "filter nothing" not in md
    frame = pd.read_csv(out / "selection.csv").set_index("learning_rate")
    assert {"filter_on", "rank_on", "ece_raw_mean", "ece_recal_mean", "pass_ece_raw", "pass_ece_recal",
            "pass_ebce_raw", "pass_ebce_recal", "passes_raw", "passes_recal"} <= set(frame.columns)
    assert frame.pass_ece_raw.to_dict() == {1e-5: True, 1e-4: False, 1e-3: True, 1e-2: False}
    assert frame.pass_ebce_raw.to_dict() == {1e-5: True, 1e-4: True, 1e-3: False, 1e-2: False}
    assert frame.passes_recal.all() and frame.pass_ece_recal.all() and frame.passes_raw.sum() == 1
    assert (frame.passes == frame.passes_raw).all() and set(frame.filter_on) == {"raw"}
    assert frame.ebce_recal_mean[1e-2] == pytest.approx(0.002) and frame.ebce_raw_mean[1e-2] == pytest.approx(0.03)

    out, _ = write_reports(select(find_runs([root]), RECAL), tmp_path / "recal")
    md = (out / "selection.md").read_text()
    assert "filtered on recalibrated metrics (recal/ece, recal/ebce; the paper filters on the raw ones)" in md
    assert "**Every configuration passes the recalibrated thresholds: they filter nothing here" in md
    assert "| rank | learning_rate | seeds | win_rate | ct_rate | cf_rate | recal/rs_0.2 | recal/ece |" not in md
    assert "| rank | learning_rate | seeds | recal/win_rate | recal/ct_rate | recal/cf_rate | recal/rs_0.2 | " \
           "recal/ece | recal/ebce |" in md
    frame = pd.read_csv(out / "selection.csv").set_index("learning_rate")
    assert (frame.passes == frame.passes_recal).all() and frame.passes.all()
    assert frame.pass_ece_raw.sum() == 2   # still counted on raw metrics while filtering on recalibrated ones


def test_runs_without_recalibrated_metrics_are_counted_on_raw_only(tmp_path):
    make_run(tmp_path, "old", hp={"learning_rate": 1e-3}, metrics=uf(rs=0.4))
    make_run(tmp_path, "older", hp={"learning_rate": 1e-2}, metrics=uf(rs=0.3, ece=0.09))
    s = one_group(tmp_path)
    assert s.without("recalibrated") == 2 and s.passing_counts("recalibrated")["both"] == (0, 0)
    line = passing_line(s)
    assert line == ("configurations passing ECE <= 0.05: raw 1 of 2; EBCE <= 0.01: raw 2 of 2; both: raw 1 of 2; "
                    "filtered on raw metrics, as the paper does; the runs have no recalibrated metrics")
