"""Several processes for one run (torchrun, ``accelerate launch``) on CPU with gloo.

One run folder, written by rank 0 only, and the work split rather than repeated: sharded feature extraction, one head
fit, data-parallel ENS-LoRA training, sharded scoring. Two processes must give what one process gives.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import cache_with_tiny_model
from entry_points import run_entry_point, run_ranks

from rewarduq_exp.core.distributed import launcher_overrides

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SMALL = ["dataset.n_train=96", "dataset.n_eval=32", "dataset.n_ood=16", "progress=false", "device=cpu",
         "metric.diagrams=false"]
EVAL_SETS = ("synthetic_eval", "synthetic_ood")


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "WANDB_MODE": "disabled"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(tmp_path: Path, tiny_backbone, name: str, launcher: list[str], *overrides: str) -> Path:
    """Run train.py under ``launcher`` into its own run folder and cache (so every run extracts its own features;
    the session's tiny model is linked in)."""
    cache_with_tiny_model(tmp_path / "caches" / name, tiny_backbone)
    args = [*SMALL, f"hydra.run.dir=runs/{name}", f"paths.cache_dir=caches/{name}", *overrides]
    if launcher is ONE:  # the one-process reference: in this process (tests/entry_points.py), as `python train.py`
        proc = run_entry_point(ROOT / "train.py", args, tmp_path)
    elif launcher is FORKED_RANKS:
        proc = run_ranks(ROOT / "train.py", args, tmp_path, nprocs=2)
    else:
        proc = subprocess.run([*launcher, str(ROOT / "train.py"), *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=240, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("run folder:") == 1  # the summary is printed by rank 0 only
    return tmp_path / "runs" / name


ONE = [sys.executable]
# What torchrun does (one process per rank, told its rank by environment variables), with the ranks forked from the
# tests' fork server (tests/child_processes.py: everything imported, no CUDA state) instead of started fresh: the fast
# form of TORCHRUN, whose real launches are the slow tests.
FORKED_RANKS = ["forked ranks"]
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2"]
# accelerate's multi-GPU launcher is torch.distributed.run underneath; with device=cpu the processes join over gloo.
ACCELERATE = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]


def _status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


def assert_same_predictions(a: Path, b: Path, tol: float) -> None:
    for name in EVAL_SETS:
        pa, pb = (pd.read_parquet(r / "predictions" / f"{name}.parquet") for r in (a, b))
        assert list(pa["id"]) == list(pb["id"])
        for col in ("chosen_reward", "chosen_lower", "rejected_upper"):
            np.testing.assert_allclose(pb[col], pa[col], atol=tol, err_msg=f"{name}.{col}")
        assert pa["chosen_reward"].std() > 0.01  # a trained model, not a constant


def _assert_one_run_folder(run: Path, world: int = 2) -> dict:
    assert sorted(p.name for p in run.parent.iterdir()) == [run.name]
    status = _status(run)
    assert status["state"] == "completed" and status["world_size"] == world
    assert (run / "metrics.json").exists() and (run / "model").is_dir()
    assert (run / "train.log").read_text().count("trained ") == 1  # rank 0's log only
    return status


class _OneProcessRuns(dict):
    """Reference runs with one process, made when a comparison first asks for one and shared by the others."""

    def __init__(self, root: Path, tiny_backbone):
        super().__init__()
        self.root, self.tiny_backbone = root, tiny_backbone

    def __missing__(self, method: str) -> Path:
        self[method] = _run(self.root, self.tiny_backbone, method, ONE, f"method={method}", *LORA.get(method, ()))
        return self[method]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_backbone):
    return _OneProcessRuns(tmp_path_factory.mktemp("one"), tiny_backbone)


# Tolerance: the same computation, summed in a different order (feature batches padded per shard, gradients summed
# over processes); the differences seen are ~1e-6.
TOL = 1e-4
# ENS-LoRA's default anchor, the L2 norm ||theta - theta_0||, has the gradient direction (theta - theta_0) / norm,
# which amplifies the rounding differences of a different summation order while theta is still near theta_0 (2e-4
# after a few steps); these tests compare the data-parallel mechanics, so they use the smooth mean-squared anchor
# (and 3 members: every member sees the same batches, so more members add time, not coverage).
LORA = {"ens_lora": ("method.anchor=mean_squared", "method.num_members=3")}


# The default run forks the ranks from the fork server; the real torchrun launches (two fresh processes that import
# everything: 20-30 s each on 2 cores) are slow tests. Fresh processes with a launcher's environment are also in the
# default run: submitit's two-task job in tests/test_sweep_multitask.py.
LAUNCHERS = [pytest.param(FORKED_RANKS, id="forked_ranks"),
             pytest.param(TORCHRUN, id="torchrun", marks=pytest.mark.slow)]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_feature_head_two_processes_shard_extraction_and_fit_once(tmp_path, tiny_backbone, one_process, launcher):
    run = _run(tmp_path, tiny_backbone, "bay_lin", launcher, "method=bay_lin")
    status = _assert_one_run_folder(run)
    one = _status(one_process["bay_lin"])
    # rank 0 extracted only its half of the texts: fewer backbone batches than the one-process run
    assert status["features"]["backbone_forward_passes"] < one["features"]["backbone_forward_passes"]
    assert not list((tmp_path / "caches" / "bay_lin" / "features").glob("*.part*"))  # blocks cleaned up
    assert_same_predictions(one_process["bay_lin"], run, TOL)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_ens_lora_data_parallel_equals_one_process(tmp_path, tiny_backbone, one_process, launcher):
    run = _run(tmp_path, tiny_backbone, "ens_lora", launcher, "method=ens_lora", *LORA["ens_lora"])
    status = _assert_one_run_folder(run)
    assert status["fit"]["processes"] == 2
    assert_same_predictions(one_process["ens_lora"], run, TOL)
    h1 = json.loads((one_process["ens_lora"] / "train_history.json").read_text())
    h2 = json.loads((run / "train_history.json").read_text())
    np.testing.assert_allclose([r["loss"] for r in h2], [r["loss"] for r in h1], rtol=1e-4)


@pytest.mark.slow
def test_accelerate_launch_ens_lora_mixed_adapter_batches(tmp_path, tiny_backbone, one_process):
    """``accelerate launch`` (its multi-GPU launcher, here on CPU) with the mixed-adapter training path.

    Slow (30 s of two processes); the default run covers it in parts: the same data-parallel code under torchrun
    (``test_ens_lora_data_parallel_equals_one_process``; accelerate's multi-GPU launcher is torch.distributed.run),
    and mixed-adapter training equal to one pass per member (``tests/test_ens_lora.py``)."""
    run = _run(tmp_path, tiny_backbone, "ens_lora", ACCELERATE, "method=ens_lora", "method.mixed_adapter_training=true",
               "method.mixed_adapter_scoring=true", *LORA["ens_lora"])
    assert _assert_one_run_folder(run)["fit"]["mixed_adapter_training"] is True
    assert_same_predictions(one_process["ens_lora"], run, TOL)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_mcd_dpo_two_processes(tmp_path, tiny_backbone, launcher):
    run = _run(tmp_path, tiny_backbone, "mcd_dpo", launcher, "method=mcd_dpo", "method.num_samples=3")
    _assert_one_run_folder(run)
    # scoring was sharded over the processes and gathered back in data order
    for name, n in zip(EVAL_SETS, (32, 16)):
        pred = pd.read_parquet(run / "predictions" / f"{name}.parquet")
        assert len(pred) == n and pred["id"].is_unique
        assert (pred["chosen_lower"] <= pred["chosen_reward"]).all()
    # the ranks' shared datasets directory is removed after training
    assert not any((tmp_path / "caches" / "mcd_dpo" / "mcd_dpo_datasets").iterdir())


def test_launcher_needs_an_explicit_run_dir(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    extra, error = launcher_overrides(["method=mcd_dpo"])
    assert "hydra.run.dir=" in error
    assert launcher_overrides(["hydra.run.dir=x"]) == ([], None)
    monkeypatch.setenv("RANK", "0")
    assert launcher_overrides(["hydra.run.dir=x"]) == ([], None)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launcher_overrides(["method=mcd_dpo"]) == ([], None)


def test_full_weights_gathers_an_fsdp_sharded_policy(tmp_path, tiny_backbone):
    """MCD-DPO under FSDP re-assembles whole weights for scoring and saving (one process here: the gather path of
    FSDP2's DTensors; two processes need GPUs through accelerate, which runs FSDP on GPUs only)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from rewarduq_exp.methods.mcd_dpo import full_weights

    original = AutoModelForCausalLM.from_pretrained(tiny_backbone.source)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        sharded = AutoModelForCausalLM.from_pretrained(tiny_backbone.source)
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        assert type(sharded.lm_head.weight).__name__ == "DTensor"
        weights = full_weights(sharded)
    finally:
        dist.destroy_process_group()
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in weights.values())
    fresh = AutoModelForCausalLM.from_pretrained(tiny_backbone.source)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(weights)
    for (name, a), b in zip(original.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
