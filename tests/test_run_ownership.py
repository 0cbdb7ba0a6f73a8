"""One run, one folder, and results nothing else overwrites: run folders created exclusively (runs started in the same
second), folders held by another run left alone, killed runs seen as interrupted and rerun, sweeps that skip a config
completed anywhere under the output root, damaged runs left out of selection, and evaluate.py that changes nothing
when it fails."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT
from entry_points import run_concurrently, run_entry_point
from fake_runs import make_run
from omegaconf import OmegaConf

from rewarduq_exp.runs import run_owner
from rewarduq_exp.runs.run_folder import RunFolder, RunFolderBusy
from rewarduq_exp.runs.run_identity import config_hash
from rewarduq_exp.runs.run_records import find_runs

pytestmark = pytest.mark.e2e  # end to end: make test-e2e (.ci/run), not make test

SMALL = ["progress=false", "dataset.n_train=200", "dataset.n_eval=60", "dataset.n_ood=60", "metric.diagrams=false"]


def common(cwd: Path, cache: Path) -> list[str]:
    return [f"paths.output_root={cwd / 'outputs'}", f"paths.cache_dir={cache}", *SMALL]


def snapshot(folder: Path) -> dict:
    """Every file below ``folder`` with its bytes (what "no file of the run changed" compares)."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode, proc.stderr)
    return lines[0]


# The concurrency test's 8 runs: 4 configs, each started twice, all at the same moment.
CONFIGS = [["method=bay_lin", "seed=0"], ["method=bay_lin", "seed=1"],
           ["method=ens_mlp", "method.num_heads=2", "seed=0"], ["method=ens_mlp", "method.num_heads=2", "seed=1"]]


@pytest.fixture(scope="module")
def concurrent(tmp_path_factory, shared_cache):
    cwd = tmp_path_factory.mktemp("concurrent")
    arg_lists = [[*common(cwd, shared_cache), *config] for config in CONFIGS for _ in range(2)]
    procs = run_concurrently(ROOT / "train.py", arg_lists, cwd)
    return cwd, arg_lists, procs


def test_runs_started_at_once_get_distinct_consistent_folders(concurrent):
    cwd, arg_lists, procs = concurrent
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    printed = [next(line.split(": ", 1)[1] for line in p.stdout.splitlines() if line.startswith("run folder: "))
               for p in procs]
    folders = sorted((cwd / "outputs" / "runs").iterdir())
    assert len(folders) == 8 and sorted(map(Path, printed)) == folders  # 8 runs, 8 folders, each printed once
    metrics_by_config = {}
    for args, folder in zip(arg_lists, map(Path, printed)):
        config = OmegaConf.load(folder / ".hydra" / "config.yaml")
        status = json.loads((folder / "status.json").read_text())
        method = json.loads((folder / "model" / "method.json").read_text())
        overrides = OmegaConf.to_container(OmegaConf.load(folder / ".hydra" / "overrides.yaml"))
        # config, overrides, status, model and metrics all belong to the same run
        assert overrides == [a for a in args]
        assert status["state"] == "completed" and status["config_hash"] == config_hash(config)
        assert re.search(rf"-{status['config_hash'][:8]}(-\d+)?$", folder.name), folder.name
        assert f"method={method['method']}" in args and method["hyperparameters"]["seed"] == config.seed
        assert f"seed={config.seed}" in args
        assert status["pid"] != os.getpid() and status["host"] == socket.gethostname()
        assert "torch" in status["versions"] and "transformers" in status["versions"]
        metrics = json.loads((folder / "metrics.json").read_text())
        metrics_by_config.setdefault(status["config_hash"], []).append(metrics)
        assert "trained " in (folder / "train.log").read_text()
    # the two runs of each config are separate folders with the same numbers (same seed, same config)
    assert len(metrics_by_config) == 4 and all(len(m) == 2 and m[0] == m[1] for m in metrics_by_config.values())


def test_a_folder_holding_another_run_is_refused_and_left_as_it_was(concurrent, shared_cache, tmp_path):
    cwd, _, procs = concurrent
    done = Path(next(line.split(": ", 1)[1] for line in procs[0].stdout.splitlines() if line.startswith("run folder")))
    before = snapshot(done)
    # another config into a folder that holds a completed run
    proc = run_entry_point(ROOT / "train.py", [*common(tmp_path, shared_cache), "method=ens_mlp",
                                               f"hydra.run.dir={done}"], tmp_path)
    assert "holds a completed run of another config" in one_error_line(proc)
    assert snapshot(done) == before

    # a folder in use by a live process (here a sleeping child of this test)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / "busy"
        busy.mkdir()
        (busy / "status.json").write_text(json.dumps({
            "state": "running", "config_hash": "x", "host": socket.gethostname(), "pid": sleeper.pid,
            "started_at": run_owner.now_iso(), "heartbeat_at": run_owner.now_iso()}))
        before = snapshot(busy)
        proc = run_entry_point(ROOT / "train.py", [*common(tmp_path, shared_cache), f"hydra.run.dir={busy}"], tmp_path)
        line = one_error_line(proc)
        assert "in use by another run" in line and f"pid {sleeper.pid}" in line
        assert snapshot(busy) == before
    finally:
        sleeper.kill()
        sleeper.wait()
    # once its process is gone the run is interrupted, and the same command takes the folder over
    proc = run_entry_point(ROOT / "train.py", [*common(tmp_path, shared_cache), f"hydra.run.dir={busy}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((busy / "status.json").read_text())["state"] == "completed"


def test_a_killed_run_is_interrupted_and_a_relaunch_reruns_it(tmp_path, shared_cache):
    folder = tmp_path / "outputs" / "killed"
    args = [*common(tmp_path, shared_cache), "method=ens_mlp", "dataset.n_train=4000", "method.num_epochs=20",
            f"hydra.run.dir={folder}"]
    child = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "REWARDUQ_HEARTBEAT_S": "0.5"})
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            status = json.loads((folder / "status.json").read_text()) if (folder / "status.json").exists() else {}
            if status.get("state") == "running" and (folder / ".hydra" / "config.yaml").exists():
                break
            time.sleep(0.2)
        assert status.get("state") == "running" and status["pid"] == child.pid, status
        assert status["heartbeat_every_s"] == 0.5 and status["host"] == socket.gethostname()
        assert find_runs([folder])[0].state == "running"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert json.loads((folder / "status.json").read_text())["state"] == "running"  # nothing could record the kill
    record = find_runs([folder])[0]
    assert record.state == "interrupted" and f"pid {child.pid}" in record.error
    report = run_entry_point(ROOT / "scripts" / "select_runs.py", [str(folder.parent), "--dataset", "synthetic_eval",
                                                                   "--out", str(tmp_path / "sel")], tmp_path)
    assert report.returncode == 0 and "1 interrupted" in report.stdout and str(folder) in report.stdout
    # the same command again takes the folder over and completes
    proc = run_entry_point(ROOT / "train.py", [*args[:-3], f"hydra.run.dir={folder}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert find_runs([folder])[0].state == "completed"


def test_heartbeat_refreshes_while_running_and_stops_at_the_end(tmp_path, monkeypatch):
    monkeypatch.setenv("REWARDUQ_HEARTBEAT_S", "0.2")
    folder = RunFolder(tmp_path / "run")
    folder.start("abc")
    first = folder.status()
    assert first["state"] == "running" and first["pid"] == os.getpid() and first["heartbeat_every_s"] == 0.2
    time.sleep(1.5)
    assert folder.status()["heartbeat_at"] > first["heartbeat_at"]  # ISO stamps of one zone compare as text
    folder.finish()
    time.sleep(0.6)
    assert folder.status()["state"] == "completed" and "heartbeat_at" not in folder.status()
    # a second process may not claim it for another config; the same config may be relaunched
    with pytest.raises(RunFolderBusy, match="completed run of another config"):
        RunFolder(tmp_path / "run").start("other")


def test_liveness_from_another_host_is_judged_by_heartbeat_age():
    def beat(seconds_ago):
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() - seconds_ago))
        return {"state": "running", "host": "some-other-node", "pid": 1, "heartbeat_at": stamp,
                "heartbeat_every_s": 60}

    assert run_owner.owner_alive(beat(30)) and run_owner.effective_state(beat(30)) == "running"
    assert not run_owner.owner_alive(beat(400)) and run_owner.effective_state(beat(400)) == "interrupted"
    # a requeued Slurm job owns what its earlier incarnation left
    status = {**beat(30), "slurm_job": "77_3"}
    os.environ.update(SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="3")
    try:
        assert not run_owner.owner_alive(status)
    finally:
        del os.environ["SLURM_ARRAY_JOB_ID"], os.environ["SLURM_ARRAY_TASK_ID"]


def test_a_sweep_skips_a_config_completed_anywhere_under_the_output_root(tmp_path, shared_cache):
    base = [*common(tmp_path, shared_cache), "method=bay_lin"]
    single = run_entry_point(ROOT / "train.py", [*base, "method.reg_lambda=0.01"], tmp_path)
    assert single.returncode == 0, single.stderr
    (done,) = (tmp_path / "outputs" / "runs").iterdir()
    proc = run_entry_point(ROOT / "train.py", ["-m", *base, "method.reg_lambda=0.01,0.1", "sweep_name=grid"],
                           tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert "sweep: 2 jobs: 1 completed, 1 skipped" in proc.stdout
    assert f"completed with the same config in {done}" in proc.stdout
    ran = [p.parent for p in (tmp_path / "outputs" / "multirun" / "grid").glob("*/status.json")]
    assert len(ran) == 1 and "reg_lambda=0.1" in ran[0].name  # the 0.01 point was not trained again

    # a point held by a live run elsewhere (a second launch of the same sweep) is left to it, untouched
    status = json.loads((ran[0] / "status.json").read_text())
    status.update(state="running", pid=os.getppid(), host=socket.gethostname())
    status.pop("pid_started")  # (the owner is now another process)
    (ran[0] / "status.json").write_text(json.dumps(status))
    (ran[0] / "metrics.json").unlink()
    before = snapshot(ran[0])
    again = run_entry_point(ROOT / "train.py", ["-m", *base, "method.reg_lambda=0.01,0.1", "sweep_name=grid"],
                            tmp_path)
    assert "1 skipped" in again.stdout and "1 running elsewhere" in again.stdout, again.stdout[-2000:]
    assert snapshot(ran[0]) == before


def test_selection_leaves_out_damaged_runs_and_says_why(tmp_path):
    root = tmp_path / "sweep"
    make_run(root, "good", seed=0)
    truncated = make_run(root, "truncated", seed=1)
    weights = truncated / "model" / "state.safetensors"
    weights.write_bytes(weights.read_bytes()[:-5])
    corrupt = make_run(root, "corrupt_metrics", seed=2)
    (corrupt / "metrics.json").write_text("{not json")
    runs = {r.path.name: r for r in find_runs([root])}
    assert runs["good"].state == "completed"
    assert runs["truncated"].state == "corrupt" and "state.safetensors is truncated" in runs["truncated"].error
    assert runs["corrupt_metrics"].state == "corrupt" and "metrics.json" in runs["corrupt_metrics"].error
    proc = run_entry_point(ROOT / "scripts" / "select_runs.py", [str(root), "--out", str(tmp_path / "sel")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "2 corrupt" in proc.stdout and "state.safetensors is truncated" in proc.stdout
    assert "(1 seed)" in proc.stdout  # the winner stands on the intact run alone
    assert "Damaged runs" in (tmp_path / "sel" / "selection.md").read_text()


def test_evaluate_changes_nothing_when_it_fails_and_swaps_results_in_when_it_succeeds(concurrent, tmp_path,
                                                                                      shared_cache):
    import shutil

    _, _, procs = concurrent
    source = Path(next(line.split(": ", 1)[1] for line in procs[2].stdout.splitlines() if line.startswith("run f")))
    run = tmp_path / "run"
    shutil.copytree(source, run)
    args = [f"run={run}", f"paths.cache_dir={shared_cache}", f"paths.output_root={tmp_path / 'out'}", "progress=false"]

    # a corrupt metrics.json: refused before anything is scored or written
    good_metrics = (run / "metrics.json").read_bytes()
    (run / "metrics.json").write_text('{"synthetic_eval": {"win_rate": 0.7')
    before = snapshot(run)
    line = one_error_line(run_entry_point(ROOT / "evaluate.py", args, tmp_path))
    assert "metrics.json" in line and "corrupt" in line
    assert snapshot(run) == before
    (run / "metrics.json").write_bytes(good_metrics)

    # the first dataset scores, the second cannot be loaded: nothing of the first is swapped in
    before = snapshot(run)
    empty = tmp_path / "no_datasets"
    empty.mkdir()
    proc = run_entry_point(ROOT / "evaluate.py", [*args, "dataset=[synthetic_eval,reward_bench]",
                                                  f"paths.datasets_dir={empty}"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert snapshot(run) == before and not list(run.glob(".evaluate-*"))

    # success: the new predictions replace the old ones whole, metrics are merged
    proc = run_entry_point(ROOT / "evaluate.py", [*args, "dataset=synthetic_eval", "dataset.n_eval=30"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    import pandas as pd

    assert len(pd.read_parquet(run / "predictions" / "synthetic_eval.parquet")) == 30
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["synthetic_eval"]["n_pairs"] == 30 and "synthetic_ood" in metrics
    assert not list(run.glob(".evaluate-*"))


@pytest.mark.parametrize("args", [["paths.output_root={file}/x"], ["hydra.run.dir={file}/y"],
                                  ["-m", "paths.output_root={file}/z", "method=ens_mlp,bay_lin"]],
                         ids=["output_root", "run_dir", "multirun"])
def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path, args):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = run_entry_point(ROOT / "train.py", [a.format(file=blocker) for a in args] + ["progress=false"], tmp_path)
    line = one_error_line(proc)
    assert str(blocker) in line and ("not a folder" in line or "Not a directory" in line)


def test_a_staging_folder_without_owner_is_removed_once_old_and_a_read_only_run_folder_is_one_line(tmp_path,
                                                                                                   monkeypatch):
    """Fourth hardening round, items 12 and 3: an evaluate.py killed between creating its staging folder and
    recording its owner leaves an ownerless folder, removed by a later evaluation once it is old (a fresh one may be
    a live evaluation's); a run folder on a read-only mount (EROFS) is the one line of an unwritable folder."""
    import errno

    from rewarduq_exp.core.errors import UserError
    from rewarduq_exp.runner import evaluate_run

    old, fresh = tmp_path / ".evaluate-old", tmp_path / ".evaluate-fresh"
    for folder in (old, fresh):
        (folder / "predictions").mkdir(parents=True)
    stamp = time.time() - evaluate_run.OWNERLESS_STAGING_S - 60
    os.utime(old, (stamp, stamp))
    evaluate_run.remove_dead_staging(tmp_path)
    assert not old.exists() and fresh.is_dir()

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(evaluate_run.os, "mkdir", read_only)
    with pytest.raises(UserError, match="is not writable \\(Read-only file system\\): evaluate.py adds its results"):
        with evaluate_run.staged_results(RunFolder(tmp_path)):
            pass
