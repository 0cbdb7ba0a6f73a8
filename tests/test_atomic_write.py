"""One atomic-write helper for every result file: no half-written files, and permissions that follow the umask
(mkstemp's 0600 made results unreadable to colleagues sharing a run folder on a cluster)."""

import json
import os
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from rewarduq_exp.core.atomic_write import atomic_dir, atomic_path, write_atomic
from rewarduq_exp.models.feature_cache import FeatureCache
from rewarduq_exp.runs.run_folder import RunFolder


@pytest.fixture
def umask_002():
    old = os.umask(0o002)  # group-writable, as shared project folders on clusters often are
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_files_and_folders_follow_the_umask(tmp_path, umask_002):
    write_atomic(tmp_path / "a.json", "{}")
    with atomic_path(tmp_path / "t.pt") as tmp:
        torch.save(torch.zeros(2), tmp)
    with atomic_path(tmp_path / "w.safetensors") as tmp:  # safetensors writes a file of its own, mode 0600
        save_file({"w": torch.zeros(2)}, str(tmp))
    with atomic_dir(tmp_path / "model") as tmp:
        (tmp / "w.txt").write_text("x")
    assert mode(tmp_path / "a.json") == 0o664 and mode(tmp_path / "t.pt") == 0o664
    assert mode(tmp_path / "w.safetensors") == 0o664
    assert mode(tmp_path / "model") == 0o775 and (tmp_path / "model" / "w.txt").read_text() == "x"


def test_run_folder_and_cache_files_follow_the_umask(tmp_path, umask_002):
    folder = RunFolder(tmp_path / "run")
    folder.start("abc")
    folder.write_metrics({"eval": {"win_rate": 0.5}})
    folder.write_predictions("eval", pd.DataFrame({"id": ["0"], "chosen_reward": [1.0]}))
    folder.finish()
    cache = FeatureCache(tmp_path / "cache")
    cache.get_or_compute("k", lambda: torch.ones(3, 2), {"what": "test"})
    files = [tmp_path / "run" / n for n in ("status.json", "metrics.json", "predictions/eval.parquet")]
    files += [tmp_path / "cache" / n for n in ("k.pt", "k.json")]
    assert {f.name: mode(f) for f in files} == {f.name: 0o664 for f in files}


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "metrics.json"
    write_atomic(target, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_concurrent_metric_merges_both_land(tmp_path, monkeypatch):
    """evaluate.py on two datasets of one run, finishing together: each merges its block into metrics.json."""
    folder = RunFolder(tmp_path)
    folder.write_metrics({"train_eval": {"win_rate": 0.6}})
    read = RunFolder.read_metrics

    def slow_read(self):
        data = read(self)
        time.sleep(0.3)  # the window in which an unlocked merge loses the other writer's block
        return data

    monkeypatch.setattr(RunFolder, "read_metrics", slow_read)
    threads = [threading.Thread(target=RunFolder(tmp_path).write_metrics, args=({name: {"win_rate": 0.7}},),
                                kwargs={"merge": True}) for name in ("reward_bench", "hh_rlhf_test")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(json.loads((tmp_path / "metrics.json").read_text())) == {"train_eval", "reward_bench", "hh_rlhf_test"}


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_full_disk_is_one_line_naming_the_target_and_leaves_the_old_one(tmp_path, what):
    """Fourth hardening round, item 4: ENOSPC (or a quota's EDQUOT) while writing was an 18-line traceback."""
    import errno

    from rewarduq_exp.core.errors import UserError

    target = tmp_path / ("metrics.json" if what == "file" else "model")
    if what == "file":
        target.write_text("old")
    else:
        target.mkdir()
        (target / "old").write_text("old")
    with pytest.raises(UserError) as error:
        with (atomic_path(target) if what == "file" else atomic_dir(target, replace=True)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(error.value).startswith(f"no space left to write {target} (No space left on device): free space")
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]   # no temporary left
    assert (target.read_text() if what == "file" else (target / "old").read_text()) == "old"


def test_a_full_disk_said_by_a_writer_of_its_own_kind_is_the_same_line(tmp_path):
    """Training onto a full disk: safetensors wraps the OS error in its own SafetensorError ("I/O error: No space
    left on device (os error 28)"), which was a traceback from the checkpoint's save."""
    from safetensors import SafetensorError

    from rewarduq_exp.core.errors import UserError

    target = tmp_path / "state.safetensors"
    with pytest.raises(UserError, match=r"^no space left to write .*state.safetensors \(No space left on device\)"):
        with atomic_path(target):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SafetensorError, match="header too large"):   # any other error of the writer stays itself
        with atomic_path(target):
            raise SafetensorError("Error while serializing: header too large")


def test_training_onto_a_really_full_disk_is_one_line(tmp_path, shared_cache):
    """A 3 MB tmpfs as the run folder (mounting needs root: skipped where it is not allowed): the checkpoint's save
    fills it; one line, the run recorded as failed, no temporary file left."""
    import subprocess

    from conftest import ROOT
    from entry_points import run_entry_point

    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        run = disk / "run"
        proc = run_entry_point(ROOT / "train.py", ["progress=false", "dataset.n_train=600", "dataset.n_eval=100",
                                                   "dataset.n_ood=100", "metric.diagrams=false",
                                                   f"paths.cache_dir={shared_cache}", f"hydra.run.dir={run}"], tmp_path)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert lines[0].startswith(f"error: no space left to write {run}/")
        assert json.loads((run / "status.json").read_text())["state"] == "failed"
        assert not [p for p in run.rglob("*.tmp")]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
