"""Results files are strict JSON: NaN and +/-inf are written as null (and logged by key), readers of our metrics
take null as a missing value (NaN) again; a BoRP baseline that answers one value throughout reports no agreement
metrics of an undefined quantity, and says so."""

import json
import logging
import math

import numpy as np
import pytest
from fake_runs import block, make_run

from rewarduq_exp.core import strict_json
from rewarduq_exp.core.strict_json import dumps_json, nulls_to_nan, strict_loads, to_json_ready, write_json
from rewarduq_exp.runs.run_folder import RunFolder


def test_strict_loads_refuses_what_python_json_writes_for_nan():
    assert strict_loads('{"a": null, "b": 1.5}') == {"a": None, "b": 1.5}
    for text in (json.dumps({"a": float("nan")}), json.dumps([float("inf")]), json.dumps(-math.inf)):
        with pytest.raises(ValueError, match="not strict JSON"):
            strict_loads(text)


def test_writer_turns_every_non_finite_number_into_null_and_logs_the_keys(tmp_path, caplog):
    obj = {"eval": {"pearson": float("nan"), "alpha": np.float32("nan"), "rmse": np.float32(0.5),
                    "n": np.int64(7), "ok": True, "none": None},
           "history": [{"loss": np.inf}, {"loss": 1.0}, (np.float64(-np.inf), 2)],
           "array": np.array([1.0, np.nan]), "path": tmp_path}
    with caplog.at_level(logging.INFO, logger=strict_json.__name__):
        replaced = write_json(tmp_path / "metrics.json", obj)
    assert replaced == ["eval/pearson", "eval/alpha", "history[0]/loss", "history[2][0]", "array[1]"]
    text = (tmp_path / "metrics.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    back = strict_loads(text)
    assert back["eval"] == {"pearson": None, "alpha": None, "rmse": 0.5, "n": 7, "ok": True, "none": None}
    assert back["history"] == [{"loss": None}, {"loss": 1.0}, [None, 2]]
    assert back["array"] == [1.0, None] and back["path"] == str(tmp_path)
    (line,) = [r.getMessage() for r in caplog.records if r.name == strict_json.__name__]
    assert "metrics.json: wrote null for 5 undefined value(s)" in line and "eval/pearson" in line
    assert "\n" not in line
    # status.json is rewritten at every heartbeat: the same keys of the same file are logged once
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=strict_json.__name__):
        write_json(tmp_path / "metrics.json", obj)
    assert not caplog.records
    # nothing to replace: nothing logged, the same text as before
    caplog.clear()
    assert dumps_json({"a": 1.0}) == json.dumps({"a": 1.0}, indent=1) and not caplog.records


def test_a_non_finite_number_that_slips_past_the_conversion_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(strict_json, "to_json_ready", lambda obj: (obj, []))  # a converter that misses one
    with pytest.raises(ValueError, match="JSON compliant"):
        write_json(tmp_path / "x.json", {"a": float("nan")})
    assert not (tmp_path / "x.json").exists()


def test_nulls_to_nan():
    assert to_json_ready(float("nan"))[0] is None and to_json_ready(float("nan"))[1] == ["(the value)"]
    back = nulls_to_nan({"a": None, "b": [None, 1], "c": {"d": None, "e": "x"}})
    assert math.isnan(back["a"]) and math.isnan(back["b"][0]) and back["b"][1] == 1
    assert math.isnan(back["c"]["d"]) and back["c"]["e"] == "x"


def test_metrics_round_trip_through_the_run_folder_and_the_readers(tmp_path):
    """NaN/inf in -> null in the file -> NaN for every reader (the run folder, run records, selection, tables)."""
    from rewarduq_exp.analysis.selection import Criteria, select
    from rewarduq_exp.analysis.selection_report import write_selection
    from rewarduq_exp.runner.summary import summary_table
    from rewarduq_exp.runs.run_records import find_runs

    folder = RunFolder(tmp_path / "run")
    folder.start("abc")
    folder.write_metrics({"ultrafeedback_test": block(ebce=float("nan"), brier=np.float32("inf"))})
    folder.write_metrics({"other": {"win_rate": float("-inf")}}, merge=True)
    folder.finish()
    text = (tmp_path / "run" / "metrics.json").read_text()
    blocks = strict_loads(text)
    assert blocks["ultrafeedback_test"]["ebce"] is None and blocks["ultrafeedback_test"]["brier"] is None
    assert blocks["other"]["win_rate"] is None
    read = folder.read_metrics()
    assert math.isnan(read["ultrafeedback_test"]["ebce"]) and math.isnan(read["other"]["win_rate"])
    assert "nan" in summary_table(read)  # formats as before, no TypeError on None

    # Selection over fake runs whose metrics.json holds null where a metric was undefined.
    runs = tmp_path / "sweep"
    make_run(runs, "a", hp={"learning_rate": 1e-3}, metrics={"ultrafeedback_test": block(rs=0.4)})
    nan_run = make_run(runs, "b", hp={"learning_rate": 1e-2}, metrics={"ultrafeedback_test": block(rs=0.5)})
    write_json(nan_run / "metrics.json", {"ultrafeedback_test": block(rs=float("nan"), ece=float("nan"))})
    records = find_runs([runs])
    by_name = {r.path.name: r for r in records}
    assert math.isnan(by_name["b"].metrics["ultrafeedback_test"]["rs_0.2"])
    (selection,) = select(records, Criteria())
    assert selection.winner is not None and selection.winner.hyperparameters["learning_rate"] == 1e-3
    write_selection([selection], tmp_path / "sel", tmp_path / "sel", [str(runs)])
    assert "—" in (tmp_path / "sel" / "selection.md").read_text()  # run b's undefined RS_0.2: a dash

    # Label-ranking tables: a null fold std (one fold) and a null mean read as missing, never as None.
    from rewarduq_exp.analysis.ranking_report import metric_table, ranking_frame

    lr = tmp_path / "lr"
    make_run(lr, "r", metrics={"iris": {"n_folds": 1, "rank/kendall_tau": 0.5, "rank/kendall_tau_std": None,
                                        "rank/sub_2/ece": None}})
    frame = ranking_frame(find_runs([lr]))
    _, rows = metric_table(frame, "rank/kendall_tau")
    assert rows == [["iris", "0.500"]]
    _, rows = metric_table(frame, "rank/sub_2/ece")
    assert rows == [["iris", "—"]]


def test_baseline_that_answers_one_value_reports_no_agreement_metrics(caplog):
    from rewarduq_exp.runner.evaluation import UNDEFINED_FOR_CONSTANT, baseline_metrics

    y = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 2.0])
    with caplog.at_level(logging.WARNING):
        const = baseline_metrics("eval", "score_judge", y, np.full(6, 3.0), (1, 5))
    assert const["probe/baseline/score_judge/constant"] is True
    for key in UNDEFINED_FOR_CONSTANT:
        assert f"probe/baseline/score_judge/{key}" not in const
    assert const["probe/baseline/score_judge/rmse"] == pytest.approx(np.sqrt(np.mean((y - 3) ** 2)))
    assert all(math.isfinite(v) for v in const.values())
    (line,) = [r.getMessage() for r in caplog.records if "constant" in r.getMessage()]
    assert "score_judge baseline answered 3 for all 6 texts" in line and line.startswith("eval: ")
    varied = baseline_metrics("eval", "score_judge", y, y[::-1], (1, 5))
    assert varied["probe/baseline/score_judge/constant"] is False
    assert {f"probe/baseline/score_judge/{k}" for k in UNDEFINED_FOR_CONSTANT} <= set(varied)


def test_a_saved_learner_with_an_undefined_fitted_scalar_loads_it_back_as_nan(tmp_path):
    """method.json is strict JSON too: a NaN fitted scalar is written as null and read back as NaN."""
    from rewarduq_exp.methods.base import load_method
    from rewarduq_exp.methods.label_ranking import MallowsLearner

    rng = np.random.default_rng(0)
    x, ranks = rng.normal(size=(12, 2)), np.tile([1, 2, 3], (12, 1))
    learner = MallowsLearner(mc_samples=100).fit(x, ranks)
    learner.mean_distance_ = float("nan")
    learner.save(tmp_path)
    info = strict_loads((tmp_path / "method.json").read_text())
    assert info["fitted"]["mean_distance"] is None
    assert math.isnan(load_method(tmp_path).mean_distance_)
