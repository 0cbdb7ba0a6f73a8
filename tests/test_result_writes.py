"""Every write of ``evaluate.py`` and ``train.py`` lands inside the run folder, and ``evaluate.py``'s results land as
one unit.

One small real run is trained once; every case copies it and puts a link (or a non-folder) where results go:
``predictions/`` linked to a folder elsewhere, ``figures/`` linked to another run's figures, ``figures/<dataset>``,
a predictions file and ``metrics.json`` linked to files elsewhere, ``.metrics.json.lock`` a link or a folder, and for
a relaunched ``train.py`` ``model/`` and ``train.log`` as links. Each is refused in one ``error:`` line with exit
status 2, the link's target is left as it was (names, bytes, mtimes), and so is the run folder. A run folder that is
itself reached through a link evaluates normally, and a failure at the last step (the lock, the merge) changes no
file of the run.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
from test_cli import NO_FIGURES, run

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.inside_folder import check_writes_inside
from rewarduq_exp.core.training_checkpoint import CHECKPOINT_DIR
from rewarduq_exp.runs import run_folder
from rewarduq_exp.runs.run_folder import RunFolder

TRAIN = ["method=ens_mlp", "progress=false", "dataset.n_train=200", "dataset.n_eval=50", "dataset.n_ood=50",
         "method.num_epochs=1", "method.num_heads=4"]
DATASET = "synthetic_ood"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_cache):
    """(working directory, run folder): one small ENS-MLP run on the synthetic world. Its diagrams are stand-ins
    (drawing them takes seconds, and here only their bytes matter)."""
    cwd = tmp_path_factory.mktemp("result_writes")
    folder = cwd / "outputs" / "runs" / "ens_mlp"
    run("train.py", [*TRAIN, *NO_FIGURES, f"hydra.run.dir={folder}"], cwd, shared_cache)
    for name in ("synthetic_eval", DATASET):
        (folder / "figures" / name).mkdir(parents=True)
        (folder / "figures" / name / "calibration_pred.png").write_bytes(f"a diagram of {name}".encode())
    assert (folder / "predictions" / f"{DATASET}.parquet").is_file()
    return cwd, folder


def snapshot(folder: Path) -> dict:
    """Every entry below ``folder`` (links not followed): a link by its target, a file by its bytes and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            key = str(path.relative_to(folder))
            if path.is_symlink():
                out[key] = ("link", os.readlink(path))
            elif path.is_dir():
                out[key] = ("folder",)
            else:
                out[key] = ("file", path.read_bytes(), path.stat().st_mtime_ns)
    return out


def outside_folder(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "keep.txt").write_text("someone else's file")
    (outside / "sub" / "keep.bin").write_bytes(b"\0\1\2")
    return outside


# ------------------------------------------------------------------------- the links, and what they would change
def predictions_linked(run_dir, outside, other):
    shutil.rmtree(run_dir / "predictions")
    (run_dir / "predictions").symlink_to(outside)
    return run_dir / "predictions"


def figures_linked_to_another_run(run_dir, outside, other):
    shutil.rmtree(run_dir / "figures")
    (run_dir / "figures").symlink_to(other / "figures")
    return run_dir / "figures"


def dataset_figures_linked(run_dir, outside, other):
    shutil.rmtree(run_dir / "figures" / DATASET)
    (run_dir / "figures" / DATASET).symlink_to(outside / "sub")
    return run_dir / "figures" / DATASET


def predictions_file_linked(run_dir, outside, other):
    (run_dir / "predictions" / f"{DATASET}.parquet").unlink()
    (run_dir / "predictions" / f"{DATASET}.parquet").symlink_to(outside / "keep.txt")
    return run_dir / "predictions" / f"{DATASET}.parquet"


def metrics_linked(run_dir, outside, other):
    (run_dir / "metrics.json").unlink()
    (run_dir / "metrics.json").symlink_to(other / "metrics.json")
    return run_dir / "metrics.json"


def lock_linked(run_dir, outside, other):
    (run_dir / ".metrics.json.lock").unlink(missing_ok=True)
    (run_dir / ".metrics.json.lock").symlink_to(outside / "keep.txt")  # FileLock would open (truncate) it
    return run_dir / ".metrics.json.lock"


def lock_linked_nowhere(run_dir, outside, other):
    (run_dir / ".metrics.json.lock").unlink(missing_ok=True)
    (run_dir / ".metrics.json.lock").symlink_to(outside / "new.lock")  # FileLock would create it there
    return run_dir / ".metrics.json.lock"


def lock_is_a_folder(run_dir, outside, other):
    (run_dir / ".metrics.json.lock").unlink(missing_ok=True)
    (run_dir / ".metrics.json.lock").mkdir()
    return run_dir / ".metrics.json.lock"


def predictions_is_a_file(run_dir, outside, other):
    shutil.rmtree(run_dir / "predictions")
    (run_dir / "predictions").write_text("not a folder")
    return run_dir / "predictions"


EVALUATE_CASES = {
    "predictions_linked": (predictions_linked, "is a symbolic link"),
    "figures_linked_to_another_run": (figures_linked_to_another_run, "is a symbolic link"),
    "dataset_figures_linked": (dataset_figures_linked, "is a symbolic link"),
    "predictions_file_linked": (predictions_file_linked, "is a symbolic link"),
    "metrics_linked": (metrics_linked, "is a symbolic link"),
    "lock_linked": (lock_linked, "is a symbolic link"),
    "lock_linked_nowhere": (lock_linked_nowhere, "is a symbolic link"),
    "lock_is_a_folder": (lock_is_a_folder, "is not a regular file"),
    "predictions_is_a_file": (predictions_is_a_file, "is not a folder"),
}


def assert_refused(proc, named: Path, reason: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert f"{named} " in lines[0] and reason in lines[0], lines[0]


@pytest.mark.parametrize("case", list(EVALUATE_CASES))
def test_evaluate_never_writes_through_a_link(case, trained, shared_cache, tmp_path):
    cwd, folder = trained
    run_dir, other = tmp_path / "run", tmp_path / "other_run"
    shutil.copytree(folder, run_dir)
    shutil.copytree(folder, other)
    outside = outside_folder(tmp_path)
    damage, reason = EVALUATE_CASES[case]
    named = damage(run_dir, outside, other)
    before = {p: snapshot(p) for p in (run_dir, outside, other)}

    proc = run("evaluate.py", [f"run={run_dir}", "device=cpu", f"dataset={DATASET}"], cwd, shared_cache, check=False)
    assert_refused(proc, named, reason)
    for path, was in before.items():
        assert snapshot(path) == was, path  # the outside target, the other run and the refused run: as they were


@pytest.mark.parametrize("name", ["model", "train.log"])
def test_relaunched_train_never_writes_through_a_link(name, trained, shared_cache, tmp_path):
    """A relaunch into a folder whose run failed claims it; a linked ``model/`` (the save) or ``train.log`` (which is
    appended to) would take its writes elsewhere: refused before anything is written."""
    cwd, folder = trained
    run_dir = tmp_path / "run"
    shutil.copytree(folder, run_dir)
    status = json.loads((run_dir / "status.json").read_text())
    (run_dir / "status.json").write_text(json.dumps({**status, "state": "failed", "error": "RuntimeError: x"}))
    outside = outside_folder(tmp_path)
    target = run_dir / name
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)
        (outside / "train.log").write_text("a log of another program\n")
    target.symlink_to(outside if name == "model" else outside / "train.log")
    before = {p: snapshot(p) for p in (run_dir, outside)}

    proc = run("train.py", [*TRAIN, f"hydra.run.dir={run_dir}"], cwd, shared_cache, check=False)
    assert_refused(proc, target, "is a symbolic link")
    for path, was in before.items():
        assert snapshot(path) == was, path


def test_a_run_folder_reached_through_a_link_is_evaluated(trained, shared_cache, tmp_path):
    """The run folder itself may be a link (outputs/ on another disk): only what is inside it is checked, and the
    results land in it, with no staging folder left."""
    cwd, folder = trained
    real = tmp_path / "disk" / "run"
    shutil.copytree(folder, real)
    (real / "predictions" / f"{DATASET}.parquet").unlink()
    shutil.rmtree(real / "figures" / DATASET)
    metrics = json.loads((real / "metrics.json").read_text())
    (real / "metrics.json").write_text(json.dumps({k: v for k, v in metrics.items() if k != DATASET}))
    link = tmp_path / "outputs_link"
    link.symlink_to(tmp_path / "disk")

    proc = run("evaluate.py", [f"run={link / 'run'}", "device=cpu", f"dataset={DATASET}"], cwd, shared_cache)
    assert proc.returncode == 0
    assert (real / "predictions" / f"{DATASET}.parquet").is_file()
    assert sorted(p.name for p in (real / "figures" / DATASET).iterdir())  # the diagrams, in the real folder
    assert set(json.loads((real / "metrics.json").read_text())) == set(metrics)  # merged back, the others kept
    assert not [p for p in real.iterdir() if p.name.startswith(".evaluate-")]


@pytest.mark.parametrize("where", ["lock", "merge"])
def test_a_failure_at_the_last_step_changes_no_file(where, trained, shared_cache, tmp_path, monkeypatch):
    """The lock and the read-merge of metrics.json come before the first rename: when either fails, the run's
    predictions, figures and metrics are those of before."""
    cwd, folder = trained
    run_dir = tmp_path / "run"
    shutil.copytree(folder, run_dir)
    before = snapshot(run_dir)

    def broken(*args, **kwargs):
        raise OSError(f"the {where} failed")

    if where == "lock":
        monkeypatch.setattr(run_folder, "FileLock", broken)
    else:
        monkeypatch.setattr(RunFolder, "merged_metrics", broken)
    proc = run("evaluate.py", [f"run={run_dir}", "device=cpu", f"dataset={DATASET}"], cwd, shared_cache, check=False)
    assert proc.returncode != 0 and f"the {where} failed" in proc.stderr
    after = snapshot(run_dir)
    # The lock file, once taken, stays (filelock leaves it on Unix, so that every locker locks the same file); it
    # is no result.
    after.pop(".metrics.json.lock", None)
    assert after == before


def test_the_guard_refuses_a_name_that_leaves_the_folder(tmp_path):
    with pytest.raises(UserError, match=r"outside .*use a name without '\.\.'"):
        check_writes_inside(tmp_path, files=("predictions/../../elsewhere.parquet",))
    check_writes_inside(tmp_path, folders=("predictions", "figures/x"), files=("metrics.json",))  # nothing yet: fine


def test_the_run_layout_names_the_checkpoint_folder():
    """run_folder names the checkpoint folder itself (it stays free of torch): the two must agree."""
    assert CHECKPOINT_DIR in run_folder.TREES
