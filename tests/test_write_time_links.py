"""Every write of a run is checked when it happens, not only before the work (issue 42, item 4).

A link put at ``<run>/predictions``, ``<run>/figures`` or ``<run>/model`` while ``train.py`` is under way (after the
run checked its folder, before it writes there) is refused at the write: one ``error:`` line naming the link, exit
status 2, ``status.json`` failed with that line, and the link's target left as it was (names, bytes, mtimes: no
result, no temporary file). The link is made at a fixed point of the run (in-process commands, a wrapped function of
the run), never after a sleep. The same holds for ``evaluate.py`` (a link made while it scores), and for the writers
themselves (core/atomic_write.py) with a link made between the temporary file's creation and the rename.
"""

import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from test_cli import NO_FIGURES, run
from test_result_writes import outside_folder, snapshot

from rewarduq_exp.core.atomic_write import atomic_dir, atomic_path, write_atomic
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.inside_folder import check_writes_inside, make_folders, replace_inside
from rewarduq_exp.runner import evaluation, train_run

TRAIN = ["method=ens_mlp", "progress=false", "dataset.n_train=120", "dataset.n_eval=40", "dataset.n_ood=40",
         "method.num_epochs=1", "method.num_heads=2", "eval_datasets=[synthetic_eval]"]
DATASET = "synthetic_eval"
LINK_MESSAGE = "results are written only inside their folder, never through a link"


def link(path: Path, target: Path) -> None:
    """``path`` replaced by a link to ``target`` (what was there moved aside, inside its folder)."""
    if path.exists() or path.is_symlink():
        path.rename(path.with_name(f"{path.name}.moved"))
    path.symlink_to(target)


def one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode,
                                                                                           proc.stderr[-3000:])
    return lines[0].removeprefix("error: ")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_cache):
    """(working directory, a completed run folder): the run the evaluate case copies; it also fills the module's
    feature cache, so that the runs of the train cases compute nothing twice."""
    cwd = tmp_path_factory.mktemp("write_time_links")
    folder = cwd / "outputs" / "runs" / "done"
    run("train.py", [*TRAIN, *NO_FIGURES, f"hydra.run.dir={folder}"], cwd, shared_cache)
    return cwd, folder


# Where the link goes, and after which step of the run it is made: after training (add_earlier_training runs right
# after fit, before the model is saved), or right before an eval set is scored (after the save).
TRAIN_CASES = {
    "model": ("model", train_run, "add_earlier_training", []),
    "predictions": ("predictions", evaluation, "score_method", NO_FIGURES),
    "figures": ("figures", evaluation, "score_method", []),
}


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_a_link_made_during_train_is_refused_at_the_write(case, trained, shared_cache, tmp_path, monkeypatch):
    cwd, _ = trained
    name, module, function, flags = TRAIN_CASES[case]
    run_dir = tmp_path / "run"
    outside = outside_folder(tmp_path)
    before = snapshot(outside)
    original = getattr(module, function)
    made = []

    def then_link(*args, **kwargs):
        if not made:  # the run has checked its folder long before: from here on only the writes can notice
            assert (run_dir / "status.json").is_file()
            link(run_dir / name, outside)
            made.append(run_dir / name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, function, then_link)
    proc = run("train.py", [*TRAIN, *flags, f"hydra.run.dir={run_dir}"], cwd, shared_cache, check=False)

    assert made, "the run never reached the step that makes the link"
    line = one_error_line(proc)
    assert line.startswith(f"{run_dir / name} is a symbolic link (to {outside}); {LINK_MESSAGE}"), line
    assert snapshot(outside) == before  # nothing landed there: no result, no temporary file
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["error"] == f"UserError: {line}"
    assert "traceback" not in status


def test_status_json_made_a_link_during_train_is_never_written_through(trained, shared_cache, tmp_path,
                                                                       monkeypatch):
    """The run's last write (its completed status) is refused: the run fails with that one line, which train.log
    keeps (status.json cannot: it is the link), and the file the link points to is left as it was."""
    cwd, _ = trained
    run_dir = tmp_path / "run"
    outside = outside_folder(tmp_path)
    before = snapshot(outside)
    original = train_run.add_earlier_training

    def then_link(*args, **kwargs):
        link(run_dir / "status.json", outside / "keep.txt")
        return original(*args, **kwargs)

    monkeypatch.setattr(train_run, "add_earlier_training", then_link)
    proc = run("train.py", [*TRAIN, *NO_FIGURES, f"hydra.run.dir={run_dir}"], cwd, shared_cache, check=False)
    line = one_error_line(proc)
    assert line.startswith(f"{run_dir / 'status.json'} is a symbolic link (to {outside / 'keep.txt'}); "
                           f"{LINK_MESSAGE}: replace it by a real file"), line
    assert snapshot(outside) == before and os.readlink(run_dir / "status.json") == str(outside / "keep.txt")
    assert line in (run_dir / "train.log").read_text()


def test_a_link_made_while_evaluate_scores_is_refused(trained, shared_cache, tmp_path, monkeypatch):
    """evaluate.py writes into a staging folder of the run and swaps in at the end: a link made at ``figures/``
    while it scores is refused there, and neither the run nor the link's target changes."""
    cwd, folder = trained
    run_dir = tmp_path / "run"
    shutil.copytree(folder, run_dir)
    outside = outside_folder(tmp_path)
    before, run_before = snapshot(outside), snapshot(run_dir)
    original = evaluation.score_method

    def then_link(*args, **kwargs):
        link(run_dir / "figures", outside)
        return original(*args, **kwargs)

    monkeypatch.setattr(evaluation, "score_method", then_link)
    proc = run("evaluate.py", [f"run={run_dir}", "device=cpu", f"dataset={DATASET}"], cwd, shared_cache,
               check=False)
    line = one_error_line(proc)
    assert line.startswith(f"{run_dir / 'figures'} is a symbolic link (to {outside}); {LINK_MESSAGE}"), line
    assert snapshot(outside) == before
    after = snapshot(run_dir)  # as before, but for the link (and what it replaced, moved aside) and the lock file
    after.pop(".metrics.json.lock", None)
    assert after.pop("figures") == ("link", str(outside))
    assert after == {k.replace("figures", "figures.moved", 1) if k.startswith("figures") else k: v
                     for k, v in run_before.items()}


# ------------------------------------------------------------------------------------ the writers, link by link
def guarded_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    check_writes_inside(run_dir, trees=("model", "predictions", "figures"), files=("status.json",))
    return run_dir


def parquet(tmp):
    pd.DataFrame({"id": ["0"], "chosen_reward": [1.0]}).to_parquet(tmp, index=False)


def safetensors(tmp):
    save_file({"w": torch.zeros(2)}, str(tmp))


def text(tmp):
    with open(tmp, "wb") as fh:
        fh.write(b"{}")


WRITERS = {"parquet": parquet, "safetensors": safetensors, "torch.save": lambda tmp: torch.save(torch.zeros(2), tmp),
           "text": text}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_link_made_between_the_temporary_file_and_the_rename(writer, tmp_path):
    """The temporary file is created in the checked folder and the writer opens it through that open folder: the
    link made meanwhile gets nothing, the rename is refused, and the temporary file is removed."""
    run_dir = guarded_run(tmp_path)
    outside = outside_folder(tmp_path)
    before = snapshot(outside)
    (run_dir / "predictions").mkdir()
    with pytest.raises(UserError, match=f"^{run_dir / 'predictions'} is a symbolic link \\(to {outside}\\); "):
        with atomic_path(run_dir / "predictions" / "eval.parquet") as tmp:
            link(run_dir / "predictions", outside)
            WRITERS[writer](tmp)
    assert snapshot(outside) == before
    assert os.listdir(run_dir / "predictions.moved") == []  # the temporary file was removed


@pytest.mark.parametrize("where", ["model", "model/adapters"])
def test_a_whole_folder_write_never_lands_through_a_link(where, tmp_path):
    run_dir = guarded_run(tmp_path)
    outside = outside_folder(tmp_path)
    before = snapshot(outside)
    (run_dir / "model").mkdir()
    with pytest.raises(UserError, match="is a symbolic link"):
        with atomic_dir(run_dir / "model" / "adapters", replace=True) as tmp:
            link(run_dir / where, outside)
            (tmp / "member").mkdir()
            (tmp / "member" / "adapter.bin").write_bytes(b"weights")
    assert snapshot(outside) == before
    assert not any(p.name.endswith(".tmp") for p in run_dir.rglob("*"))


@pytest.mark.parametrize("where", ["predictions", "figures", "figures/eval", "status.json"])
def test_a_link_present_at_the_write_is_refused_before_anything_is_created(where, tmp_path):
    """A link (made after the check before the work) on the way to a write, or at its name: refused before the
    temporary file is created; nothing is created through it (no folder either)."""
    run_dir = guarded_run(tmp_path)
    outside = outside_folder(tmp_path)
    (run_dir / "figures").mkdir()
    link(run_dir / where, outside)
    before = snapshot(outside)
    with pytest.raises(UserError, match=f"^{run_dir / where} is a symbolic link"):
        if where == "status.json":
            write_atomic(run_dir / "status.json", "{}")
        elif where == "predictions":
            write_atomic(run_dir / "predictions" / "eval.parquet", "x")
        else:
            make_folders(run_dir / "figures" / "eval" / "sub")
    assert snapshot(outside) == before


def test_a_folder_replaced_while_it_is_written_is_refused(tmp_path):
    """Not a link but another real folder under the same name: the rename into the old one is refused too."""
    run_dir = guarded_run(tmp_path)
    (run_dir / "predictions").mkdir()
    with pytest.raises(UserError, match=f"^{run_dir / 'predictions'} was replaced while results were written"):
        with atomic_path(run_dir / "predictions" / "eval.parquet") as tmp:
            (run_dir / "predictions").rename(run_dir / "old")
            (run_dir / "predictions").mkdir()
            parquet(tmp)
    assert os.listdir(run_dir / "predictions") == [] and os.listdir(run_dir / "old") == []


def test_a_name_that_leaves_the_folder_is_refused_at_the_write(tmp_path):
    run_dir = guarded_run(tmp_path)
    with pytest.raises(UserError, match=r"leaves .*use a name without '\.\.'"):
        write_atomic(run_dir / "predictions" / ".." / ".." / "elsewhere.json", "{}")
    assert not (tmp_path / "elsewhere.json").exists()


def test_writes_outside_guarded_folders_follow_links(tmp_path):
    """Caches are not run folders: a cache reached through links (a shared disk) is written as before."""
    real = tmp_path / "disk" / "models"
    real.mkdir(parents=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(real)
    write_atomic(tmp_path / "cache" / "models" / "a.json", "{}")
    with atomic_dir(tmp_path / "cache" / "models" / "tiny") as tmp:
        (tmp / "w.txt").write_text("x")
    assert (real / "a.json").read_text() == "{}" and (real / "tiny" / "w.txt").read_text() == "x"


def test_results_still_land_in_a_run_folder_reached_through_a_link(tmp_path):
    """The guarded folder itself may be a link (outputs/ on another disk): only what is below it is checked."""
    real = tmp_path / "disk" / "run"
    real.mkdir(parents=True)
    (tmp_path / "outputs").symlink_to(tmp_path / "disk")
    run_dir = tmp_path / "outputs" / "run"
    check_writes_inside(run_dir, trees=("predictions",))
    with atomic_path(run_dir / "predictions" / "eval.parquet") as tmp:
        parquet(tmp)
    write_atomic(run_dir / "status.json", "{}")
    assert (real / "predictions" / "eval.parquet").is_file() and (real / "status.json").read_text() == "{}"


def test_a_swap_into_the_run_is_checked_at_the_rename(tmp_path):
    """replace_inside: what a writer finished elsewhere in its folder (evaluate.py's staging folder) is renamed in
    through the checked folders, and not through a link made there meanwhile."""
    run_dir = guarded_run(tmp_path)
    outside = outside_folder(tmp_path)
    before = snapshot(outside)
    staged = run_dir / ".staging" / "predictions" / "eval.parquet"
    with atomic_path(staged) as tmp:
        parquet(tmp)
    replace_inside(staged, run_dir / "predictions" / "eval.parquet")
    assert (run_dir / "predictions" / "eval.parquet").is_file() and not staged.exists()
    with atomic_path(staged) as tmp:
        parquet(tmp)
    link(run_dir / "predictions", outside)
    with pytest.raises(UserError, match=f"^{run_dir / 'predictions'} is a symbolic link"):
        replace_inside(staged, run_dir / "predictions" / "eval.parquet")
    assert staged.is_file() and snapshot(outside) == before
