"""A run killed with SIGTERM in the middle of training, launched again with the very same command, resumes in its
folder from its checkpoint and writes the metrics.json an uninterrupted run writes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from entry_points import run_entry_point

pytestmark = pytest.mark.e2e  # end to end: make test-e2e (.ci/run), not make test

ARGS = ["progress=false", "method=ens_mlp", "method.num_heads=3", "dataset.n_train=600", "dataset.n_eval=100",
        "dataset.n_ood=100", "method.num_epochs=5", "method.batch_size=16", "metric.diagrams=false"]


def numbers(metrics: dict) -> dict:
    """metrics.json without wall-clock figures."""
    return {name: {k: v for k, v in block.items() if "second" not in k} for name, block in metrics.items()}


def test_sigterm_then_the_same_command_resumes_and_ends_with_the_same_metrics(tmp_path, shared_cache):
    common = [*ARGS, f"paths.cache_dir={shared_cache}"]
    plain = run_entry_point(ROOT / "train.py", [*common, f"paths.output_root={tmp_path / 'plain'}"], tmp_path)
    assert plain.returncode == 0, plain.stderr
    (expected,) = (tmp_path / "plain" / "runs").glob("*/metrics.json")

    command = [sys.executable, str(ROOT / "train.py"), *common, f"paths.output_root={tmp_path / 'out'}",
               "checkpoint.every_steps=1"]
    child = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not list((tmp_path / "out" / "runs").glob("*/checkpoint/*.safetensors")):
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGTERM)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 128 + signal.SIGTERM, stderr
    (folder,) = (tmp_path / "out" / "runs").iterdir()
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "interrupted" and "launch the same command again to resume" in status["error"], status
    assert "interrupted by SIGTERM at step" in stdout + stderr

    again = run_entry_point(ROOT / "train.py", command[2:], tmp_path)
    assert again.returncode == 0, again.stderr
    assert [p.name for p in (tmp_path / "out" / "runs").iterdir()] == [folder.name]   # the same folder, no new one
    log = (folder / "train.log").read_text()
    assert "ens_mlp training: resumed at step" in log
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "completed" and "resumed" in status
    # the time of both attempts: status.json's seconds and method.json's training time
    assert [a["state"] for a in status["attempts"]] == ["interrupted", "completed"], status["attempts"]
    assert status["seconds"] == round(sum(a["seconds"] for a in status["attempts"]), 2)
    assert status["seconds"] > status["attempts"][-1]["seconds"]
    fit = json.loads((folder / "model" / "method.json").read_text())["fit_summary"]
    assert 0 < fit["seconds_training_earlier_attempts"] < fit["seconds_training"], fit
    assert status["fit"]["seconds_training"] == fit["seconds_training"]
    assert not (folder / "checkpoint").exists()            # a completed run keeps no training state
    assert numbers(json.loads((folder / "metrics.json").read_text())) == numbers(json.loads(expected.read_text()))
    history = json.loads((folder / "train_history.json").read_text())
    assert [h["step"] for h in history] == sorted({h["step"] for h in history})   # one continuous curve
