"""Data that trains or scores nothing (issue 42, item 2): refused in one line where any result would be meaningless
(every completion empty, chosen equal to rejected everywhere, fewer than 2 training pairs left), one warning line with
counts where it is merely weak (some identical pairs: dropped from training, kept in evaluation; some empty replies:
kept; fewer pairs than a batch or than the calibration bins). ``dataset=local`` with every completion ``""`` used to
train and report a win rate of 0.0000 without a word."""

from __future__ import annotations

import json
import logging

import pandas as pd
import pytest
from conftest import ROOT
from entry_points import run_entry_point

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import make_pointwise_frame, make_preference_frame
from rewarduq_exp.data.degenerate import check_split


def _pairs(chosen: list[str], rejected: list[str]) -> pd.DataFrame:
    n = len(chosen)
    as_messages = lambda texts: [[{"role": "assistant", "content": t}] for t in texts]  # noqa: E731
    return make_preference_frame([f"p{i}" for i in range(n)], [[{"role": "user", "content": f"Q{i}?"}]
                                                                   for i in range(n)],
                                 as_messages(chosen), as_messages(rejected))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "rewarduq_exp"]


# ------------------------------------------------------------------------------------------------ the checks
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_every_completion_empty_is_refused(training):
    with pytest.raises(UserError, match=r"^dataset 'local_train': every completion is empty \(chosen and rejected "
                                        r"of all 3 pairs\)"):
        check_split(_pairs(["", " ", ""], ["", "", "\n"]), "local_train", training=training)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_chosen_equal_to_rejected_everywhere_is_refused(training):
    with pytest.raises(UserError, match=r"^dataset 'd': chosen is identical to rejected in every pair \(all 2\), so "
                                        r"there is no preference"):
        check_split(_pairs(["a", "b"], ["a", "b"]), "d", training=training)


def test_identical_pairs_are_dropped_from_training_and_kept_in_evaluation(caplog):
    chosen, rejected = ["a", "b", "c", "d", "e"], ["a", "x", "c", "y", "z"]
    with caplog.at_level(logging.WARNING, logger="rewarduq_exp"):
        kept, dropped = check_split(_pairs(chosen, rejected), "d_train", training=True)
    assert dropped == 2 and kept["chosen"].map(lambda m: m[0]["content"]).tolist() == ["b", "d", "e"]
    assert _warnings(caplog) == ["dataset 'd_train': 2 of 5 pairs have chosen identical to rejected (no preference); "
                                 "dropped from training, 3 left"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rewarduq_exp"):
        kept, dropped = check_split(_pairs(chosen, rejected), "d_eval", training=False)
    assert dropped == 0 and len(kept) == 5
    assert _warnings(caplog) == ["dataset 'd_eval': 2 of 5 pairs have chosen identical to rejected (no preference); "
                                 "kept, as the dataset's own scoring counts them (they can never be won)"]


def test_pairs_with_one_empty_reply_are_kept_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="rewarduq_exp"):
        kept, dropped = check_split(_pairs(["a", "b", "c"], ["", "x", "y"]), "d", training=True)
    assert dropped == 0 and len(kept) == 3
    assert _warnings(caplog) == ["dataset 'd': 1 of 3 pairs have an empty rejected reply; kept (an empty reply "
                                 "against a real one is a weak but valid preference)"]


def test_too_few_pairs_to_train_is_refused():
    with pytest.raises(UserError, match=r"^dataset 'd' has 1 pair to train on: at least 2 are needed to train a "
                                        r"method; give it more data$"):
        check_split(_pairs(["a"], ["b"]), "d", training=True)
    with pytest.raises(UserError, match=r"^dataset 'd' has 1 pair to train on after dropping 2 with chosen identical "
                                        r"to rejected: at least 2"):
        check_split(_pairs(["a", "b", "c"], ["a", "b", "x"]), "d", training=True)
    check_split(_pairs(["a"], ["b"]), "d", training=False)   # one eval pair is scored (with a warning about bins)


def test_fewer_pairs_than_a_batch_or_the_bins_is_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="rewarduq_exp"):
        check_split(_pairs(["a", "b", "c"], ["x", "y", "z"]), "d_train", training=True, batch_size=64)
        check_split(_pairs(["a", "b", "c"], ["x", "y", "z"]), "d_eval", n_bins=20)
        check_split(_pairs(["a", "b", "c"], ["x", "y", "z"]), "d_eval", n_bins=3)   # as many as bins: no warning
    assert _warnings(caplog) == [
        "dataset 'd_train' has 3 pairs to train on, fewer than one batch (method.batch_size=64): every step sees all "
        "of them",
        "dataset 'd_eval' has 3 pairs, fewer than the metric.n_bins=20 calibration bins: at least 17 bins are empty "
        "and ECE/MCE rest on a few pairs each"]


def test_rated_responses_all_empty_are_refused():
    frame = make_pointwise_frame(["a", "b"], [[{"role": "user", "content": "Q"}]] * 2,
                                 [[{"role": "assistant", "content": ""}]] * 2, {"s": [1.0, 2.0]}, "s")
    with pytest.raises(UserError, match=r"^dataset 'r': every response is empty \(all 2\)"):
        check_split(frame, "r", training=True)


# ------------------------------------------------------------------------------------------------ as a user runs it
def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(tmp_path, cache, path, *extra):
    folder = tmp_path / "outputs" / "runs" / "r"
    args = ["dataset=local", f"dataset.path={path}", "progress=false", "metric.diagrams=false", *extra,
            f"paths.cache_dir={cache}", f"hydra.run.dir={folder}"]
    return run_entry_point(ROOT / "train.py", args, tmp_path), folder


def _refused(proc, folder, message: str) -> None:
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"error: {message}"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (folder / "metrics.json").exists() and not (folder / "predictions").exists()
    assert not (folder / "model").exists()
    assert not folder.exists()   # data refused before anything was trained: a single run leaves no folder


QUESTIONS = [f"Question number {i}?" for i in range(30)]


def test_train_refuses_a_file_of_empty_completions(tmp_path, shared_cache):
    path = _write(tmp_path / "empty.jsonl", [{"prompt": q, "chosen": "", "rejected": ""} for q in QUESTIONS])
    proc, folder = _train(tmp_path, shared_cache, path)
    # 30 prompts: 3 held out as split eval, 3 of the other 27 as split cal
    _refused(proc, folder, "dataset 'local_train': every completion is empty (chosen and rejected of all 24 pairs)")


def test_train_refuses_chosen_equal_to_rejected(tmp_path, shared_cache):
    path = _write(tmp_path / "same.jsonl", [{"prompt": q, "chosen": f"Answer {i}", "rejected": f"Answer {i}"}
                                            for i, q in enumerate(QUESTIONS)])
    proc, folder = _train(tmp_path, shared_cache, path)
    _refused(proc, folder, "dataset 'local_train': chosen is identical to rejected in every pair (all 24)")


def test_train_refuses_a_single_training_pair(tmp_path, shared_cache):
    """Two pairs of two prompts: one is held out for evaluation, one is left to train on (and none to spare for the
    calibration split: tests/test_calibration_split.py)."""
    path = _write(tmp_path / "two.jsonl", [{"prompt": q, "chosen": "Yes, gladly.", "rejected": "No."}
                                           for q in QUESTIONS[:2]])
    proc, folder = _train(tmp_path, shared_cache, path, "dataset.cal_fraction=0")
    _refused(proc, folder, "dataset 'local_train' has 1 pair to train on: at least 2 are needed")


def test_train_warns_about_weak_data_and_runs(tmp_path, shared_cache):
    """4 identical pairs (dropped from training), 3 with an empty rejected reply (kept), fewer pairs than one batch,
    fewer eval pairs than bins: exit 0, one warning line each, and data_summary.json counts the dropped pairs."""
    rows = [{"prompt": q, "chosen": f"A kind and helpful answer {i}.", "rejected": f"No {i}."}
            for i, q in enumerate(QUESTIONS)]
    for i in (0, 7, 14, 21):
        rows[i]["rejected"] = rows[i]["chosen"]
    for i in (2, 9, 16):
        rows[i]["rejected"] = ""
    path = _write(tmp_path / "mixed.jsonl", rows)
    proc, folder = _train(tmp_path, shared_cache, path, "dataset.eval_fraction=0", f"dataset.eval_path={path}",
                          "dataset.cal_fraction=0", "method.num_heads=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    warnings = [line.split(" - ", 1)[1] for line in proc.stdout.splitlines() if "[WARNING]" in line]
    assert "dataset 'local_train': 4 of 30 pairs have chosen identical to rejected (no preference); dropped from " \
           "training, 26 left" in warnings
    assert "dataset 'local_train': 3 of 30 pairs have an empty rejected reply; kept (an empty reply against a real " \
           "one is a weak but valid preference)" in warnings
    assert "dataset 'local_train' has 26 pairs to train on, fewer than one batch (method.batch_size=64): every step " \
           "sees all of them" in warnings
    assert "dataset 'local_eval': 4 of 30 pairs have chosen identical to rejected (no preference); kept, as the " \
           "dataset's own scoring counts them (they can never be won)" in warnings
    assert all("\n" not in w for w in warnings)
    train_summary, eval_summary = json.loads((folder / "data_summary.json").read_text())
    assert train_summary["identical_dropped"] == 4 and eval_summary["identical_dropped"] == 0
    assert (folder / "metrics.json").is_file()


def test_synthetic_world_of_one_training_pair_is_refused_before_starting(tmp_path):
    proc = run_entry_point(ROOT / "train.py", ["dataset.n_train=1", f"paths.output_root={tmp_path / 'outputs'}"],
                           tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: dataset.n_train=1 is invalid: must be an integer >= 2 (a method cannot "
                                   "learn a preference from a single example)")
    assert not (tmp_path / "outputs").exists()
