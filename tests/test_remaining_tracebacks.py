"""The last tracebacks a tester found (issue 42, item 6), each run as a user runs it: one ``error:`` line naming the
file or value, a non-zero exit, and nothing written where nothing should be.

* a JSON row nested 10^5 levels deep (pyarrow's reader crashed with SIGSEGV on it, and locating the error recursed);
* a named pipe, a folder or a device as ``dataset.path`` (a pipe read as "the file is empty", and must never be
  opened: that blocks until a writer comes);
* a run or sweep folder that cannot be made: a name over NAME_MAX (255 bytes), ``/proc/x``, given on the command line,
  resolved by Hydra or made by ``unique_run_dir``;
* ``method.beta <= 0`` (u = (upper - reward) / beta was NaN).
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import threading
import time

import numpy as np
import pytest
from conftest import ROOT
from entry_points import run_entry_point

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.local import MAX_ROW_DEPTH, LocalPreferenceFile, first_too_deep

LONG = "a" * 300   # one path component over NAME_MAX
ROW = {"prompt": "Question?", "chosen": "A fine answer.", "rejected": "No."}


def one_error_line(proc, code: int = 2) -> str:
    """The single ``error:`` line of a refused command (no traceback, nothing else on stderr)."""
    assert proc.returncode == code, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


def nested_row(depth: int, key: str = "meta") -> str:
    """A JSON line whose ``key`` holds ``depth - 1`` nested lists, so the row is ``depth`` levels deep."""
    return json.dumps(ROW)[:-1] + f', "{key}": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


# ---------------------------------------------------------------------------------------------- nesting depth
def test_a_row_nested_10_5_deep_through_train_py(tmp_path, shared_cache):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + nested_row(100_000, key="rejected") + "\n")
    folder = tmp_path / "outputs" / "runs" / "deep"
    proc = run_entry_point(ROOT / "train.py", ["dataset=local", f"dataset.path={path}", "dataset.eval_fraction=0",
                                               f"dataset.eval_path={path}", "progress=false",
                                               f"paths.cache_dir={shared_cache}", f"hydra.run.dir={folder}"], tmp_path)
    line = one_error_line(proc)
    assert line == (f"error: dataset.path={path} line 2: nested deeper than 63 levels, more than the JSON reader "
                    "takes; a row holds texts or lists of {role, content} messages (3 levels)")
    assert not folder.exists()   # refused before anything was trained: no run folder left behind


@pytest.mark.parametrize("depth, refused", [(MAX_ROW_DEPTH, False), (MAX_ROW_DEPTH + 1, True), (1000, True),
                                            (100_000, True)])
@pytest.mark.parametrize("layout", ["jsonl", "jsonl.gz", "json array"])
def test_nesting_bound_is_the_readers_own(tmp_path, depth, refused, layout):
    """63 levels load (pyarrow's limit), 64 and more are one line naming the line, in JSON lines (checked before
    pyarrow reads: it crashes on 10^5) and in a JSON array (checked after its reader failed), compressed or not."""
    deep = nested_row(depth)
    if layout == "json array":
        path, line = tmp_path / "pairs.json", 3
        path.write_text("[\n" + json.dumps(ROW) + ",\n" + deep + "\n]\n")
    else:
        path, line = tmp_path / f"pairs.{layout}", 2
        text = (json.dumps(ROW) + "\n" + deep + "\n").encode()
        path.write_bytes(gzip.compress(text) if layout.endswith(".gz") else text)
    loader = LocalPreferenceFile(str(path), eval_fraction=0)
    if not refused:
        assert len(loader.load("train")) == 2
        return
    with pytest.raises(UserError, match=rf"^dataset\.path=.*pairs\.\S+ line {line}: nested deeper than 63 levels"):
        loader.load("train")


def test_the_depth_scan_skips_strings_and_counts_lines():
    bracketed = json.dumps({**ROW, "chosen": "[" * 500 + '\\" {{{'})       # brackets and an escaped quote in text
    assert first_too_deep([bracketed, bracketed], 3, rows_are_lines=True) is None
    assert first_too_deep([bracketed, "[" * 4 + "]" * 4], 3, rows_are_lines=True) == 2
    document = json.dumps([ROW, {**ROW, "meta": [[[[]]]]}], indent=2).splitlines()   # pretty-printed: 6 levels
    assert first_too_deep(document, 6, rows_are_lines=False) is None
    assert document[first_too_deep(document, 5, rows_are_lines=False) - 1].strip() == "[]"


# ---------------------------------------------------------------------------------------------- not a file
def watch_for_a_reader(fifo, stop: threading.Event, opened: list) -> None:
    """Open ``fifo`` for writing whenever a reader waits on it (and close it at once, so that reader gets EOF and the
    test does not hang): a reader opening the pipe is the bug."""
    while not stop.is_set():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            opened.append(True)
        except OSError as err:
            if err.errno != errno.ENXIO:   # ENXIO: no reader
                raise
        time.sleep(0.05)


def test_a_named_pipe_is_not_read(tmp_path, shared_cache):
    """Refused when the run builds its loader (before any model is loaded), never opened."""
    fifo = tmp_path / "pairs.jsonl"
    os.mkfifo(fifo)
    stop, opened = threading.Event(), []
    watcher = threading.Thread(target=watch_for_a_reader, args=(fifo, stop, opened), daemon=True)
    watcher.start()
    folder = tmp_path / "outputs" / "runs" / "fifo"
    try:
        proc = run_entry_point(ROOT / "train.py", ["dataset=local", f"dataset.path={fifo}", "progress=false",
                                                   f"paths.cache_dir={shared_cache}", f"hydra.run.dir={folder}"],
                               tmp_path)
    finally:
        stop.set()
        watcher.join()
    assert one_error_line(proc) == f"error: dataset.path={fifo}: not a regular file (a named pipe); give a data file"
    assert not opened
    assert not (folder / "metrics.json").exists()


@pytest.mark.parametrize("path, kind", [("folder.jsonl", "a folder"), ("/dev/null", "a device")])
def test_a_folder_or_a_device_is_not_a_data_file(tmp_path, path, kind):
    if not path.startswith("/"):
        path = tmp_path / path
        path.mkdir()
    with pytest.raises(UserError, match=rf"^dataset\.eval_path={path}: not a regular file \({kind}\)"):
        LocalPreferenceFile(str(tmp_path / "unused.jsonl"), eval_path=str(path))   # refused when built: a stat


# ---------------------------------------------------------------------------------------------- run folders
def files_under(root) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


CLI_FOLDERS = [
    ("train.py", [f"hydra.run.dir={{tmp}}/{LONG}"], "hydra.run.dir={tmp}/aaaaaaaaaaaaaaaaaaaaaaaa...(300 characters) "
     "cannot be used: the name aaaaaaaaaaaaaaaaaaaaaaaa...(300 characters) is 300 bytes long, more than the 255 a "
     "file name may have"),
    ("train.py", [f"hydra.run.dir={{tmp}}/new/{LONG}/run"], "the name aaaaaaaaaaaaaaaaaaaaaaaa...(300 characters) "
     "is 300 bytes long"),
    ("train.py", ["hydra.run.dir=/proc/x"], "hydra.run.dir=/proc/x cannot be used: /proc/x cannot be created (No such "
     "file or directory)"),
    ("train.py", [f"paths.output_root={{tmp}}/{LONG}"], "paths.output_root={tmp}/aaaaaaaaaaaaaaaaaaaaaaaa...(300 "
     "characters) cannot be used: the name"),
    ("train.py", ["-m", "seed=1,2", f"hydra.sweep.dir={{tmp}}/{LONG}"], "hydra.sweep.dir={tmp}/aaaaaaaaaaaaaaaaaaaa"
     "aaaa...(300 characters) cannot be used: the name"),
    ("train.py", ["-m", "seed=1,2", "hydra.sweep.dir=/proc/x"], "hydra.sweep.dir=/proc/x cannot be used: /proc/x "
     "cannot be created"),
    ("evaluate.py", ["run=r", "hydra.run.dir=/proc/x"], "hydra.run.dir=/proc/x cannot be used"),
    ("downstream.py", ["run=r", f"hydra.run.dir={{tmp}}/{LONG}"], "hydra.run.dir={tmp}/aaaaaaaaaaaaaaaaaaaaaaaa"
     "...(300 characters) cannot be used"),
]


@pytest.mark.parametrize("script, args, message", CLI_FOLDERS, ids=[f"{s} {' '.join(a)[:60]}" for s, a, _ in
                                                                    CLI_FOLDERS])
def test_a_folder_given_on_the_command_line_is_refused_before_hydra(tmp_path, script, args, message):
    proc = run_entry_point(ROOT / script, [a.replace("{tmp}", str(tmp_path)) for a in args], tmp_path)
    assert message.replace("{tmp}", str(tmp_path)) in one_error_line(proc)
    assert files_under(tmp_path) == []


RESOLVED_FOLDERS = [
    # hydra.run.dir interpolated: Hydra resolves it, the callback checks it before Hydra makes it
    (["hydra.run.dir={tmp}/outputs/${sweep_name}", f"sweep_name={LONG}"],
     "error: cannot write the run folder {tmp}/outputs/aaaaaaaaaaaaaaaaaaaaaaaa...(300 characters) (hydra.run.dir): "
     "the name aaaaaaaaaaaaaaaaaaaaaaaa...(300 characters) is 300 bytes long, more than the 255 a file name may have"),
    (["hydra.run.dir=/proc/${sweep_name}", "sweep_name=x"],
     "error: cannot write the run folder /proc/x (hydra.run.dir): /proc/x cannot be created (No such file or "
     "directory)"),
    # the multirun folder: ${paths.output_root}/multirun/${sweep_name}
    (["-m", "seed=1,2", f"sweep_name={LONG}"],
     "error: cannot write the run folder {tmp}/outputs/multirun/aaaaaaaaaaaaaaaaaaaaaaaa...(300 characters) "
     "(hydra.sweep.dir): the name"),
]


@pytest.mark.parametrize("args, message", RESOLVED_FOLDERS, ids=[" ".join(a)[:50] for a, _ in RESOLVED_FOLDERS])
def test_a_folder_hydra_resolves_is_refused_before_it_is_made(tmp_path, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = run_entry_point(ROOT / "train.py", [*args, f"paths.output_root={tmp_path / 'outputs'}"], tmp_path)
    line = one_error_line(proc)
    assert line.startswith(message.replace("{tmp}", str(tmp_path))), line
    assert files_under(tmp_path) == []


def test_a_single_runs_folder_under_an_interpolated_output_root(tmp_path):
    """``unique_run_dir`` makes a single run's folder itself, under ``paths.output_root`` as resolved."""
    proc = run_entry_point(ROOT / "train.py", ["paths.output_root=${sweep_name}", f"sweep_name={LONG}"], tmp_path)
    line = one_error_line(proc)
    assert line.startswith("error: cannot create the run folder aaaaaaaaaaaaaaaaaaaaaaaa...(300 characters)/runs/")
    assert "is 300 bytes long, more than the 255 a file name may have" in line
    assert files_under(tmp_path) == []


# ---------------------------------------------------------------------------------------------- beta
@pytest.mark.parametrize("beta", [0, 0.0, -1.0, float("nan"), float("inf")])
def test_mcd_dpo_refuses_a_beta_that_is_no_interval(beta):
    from rewarduq_exp.methods.mcd_dpo.method import McdDpo

    with pytest.raises(UserError, match=r"^method\.beta=.* is invalid: must be a number > 0$"):
        McdDpo(beta=beta, device="cpu")


def test_mcd_dpo_beta_0_on_the_command_line(tmp_path, shared_cache):
    folder = tmp_path / "outputs" / "runs" / "beta0"
    proc = run_entry_point(ROOT / "train.py", ["method=mcd_dpo", "method.beta=0", "progress=false",
                                               f"paths.cache_dir={shared_cache}", f"hydra.run.dir={folder}"], tmp_path)
    assert one_error_line(proc) == "error: method.beta=0 is invalid: must be a number > 0"
    assert not folder.exists()   # refused before the run used its folder: none is left behind


class _Beta:
    """A scored method whose beta was set to nothing after it was built (the constructors refuse it)."""

    beta = 0.0

    def score(self, prompts, completions):
        from rewarduq_exp.methods.base import Scores

        reward = np.arange(len(prompts), dtype=float)
        return Scores(reward, np.ones_like(reward))

    def score_pairs(self, frame):
        scores = self.score(list(frame.chosen), list(frame.chosen))
        return scores, scores


def test_u_is_never_divided_by_a_beta_of_0():
    """u comes with the scores (``Scores.u``), never recovered from the bounds, so a beta of 0 gives no column of
    NaN; where beta scales u (the ranking score), a beta that is no number > 0 is one line."""
    import pandas as pd

    from rewarduq_exp.api import RewardModel
    from rewarduq_exp.downstream.active_learning import acquisition_scores

    model = RewardModel(_Beta(), "run", None)
    assert model.score(["q"], ["a"]).uncertainty.tolist() == [1.0]
    frame = pd.DataFrame({"chosen": ["a", "b"], "rejected": ["c", "d"]})
    for strategy in ("uncertainty", "ranking_score"):
        with pytest.raises(UserError, match=r"^method\.beta=0\.0 is invalid"):
            acquisition_scores(strategy, _Beta(), frame, np.random.default_rng(0))
