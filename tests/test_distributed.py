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

pytestmark = pytest.mark.e2e  # end to end: make test-e2e (.ci/run), not make test

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# probe.batch_size: several extraction batches per split (the token budget would take each split in one), so a rank
# that extracts half the texts runs fewer of them
SMALL = ["dataset.n_train=96", "dataset.n_eval=32", "dataset.n_ood=16", "progress=false", "device=cpu",
         "metric.diagrams=false", "probe.batch_size=16"]
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


def _cpu_rank_on_a_gpu_node(rank: int, port: int, results) -> None:
    """Rank ``rank`` of 2 of a ``device=cpu`` run on a node with one GPU, as torch and accelerate see such a node:
    CUDA available, one device, and torch built for CUDA (``torch._C._get_accelerator``, which barriers read). Any
    CUDA tensor fails here (a CPU build of torch): what would create a CUDA context on the GPU node."""
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch._C._get_accelerator = lambda *args: torch.device("cuda")

    def bind(device):
        raise AssertionError(f"a rank whose device is cpu was bound to {device}")

    torch.cuda.set_device = bind
    from accelerate import Accelerator, PartialState

    from rewarduq_exp.core import distributed

    distributed.setup("cpu")
    state = PartialState()
    state.wait_for_everyone()             # accelerate's own barrier
    with state.main_process_first():      # TRL's dataset preparation
        pass
    Accelerator(cpu=True).wait_for_everyone()   # the trainer's (MCD-DPO waits on it before deleting shared files)
    distributed.barrier()
    results.put((rank, state.backend, state.device.type, distributed.max_across(rank)))


def test_cpu_ranks_on_a_gpu_node_never_touch_cuda():
    """accelerate's barrier would put its tensor on cuda:<local rank> even for gloo: a CPU run's rank 1 on a one-GPU
    node failed ("invalid device ordinal"; "CUDA error: initialization error" when forked after CUDA was used)."""
    import socket

    import child_processes

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = child_processes.queue()
    child_processes.start_ranks(_cpu_rank_on_a_gpu_node, args=(port, results), nprocs=2)
    assert sorted(results.get(timeout=60) for _ in range(2)) == [(0, "gloo", "cpu", 1), (1, "gloo", "cpu", 1)]


def _gpu_rank(local_rank: int, results) -> None:
    """accelerate's choice for rank ``local_rank`` of 2 of a ``device=cuda`` run on a node with 2 GPUs, the GPUs and
    torch.distributed's process group stood in for (recorded, not created)."""
    import torch
    import torch.distributed as dist
    from accelerate import PartialState

    from rewarduq_exp.core import distributed

    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    calls = []
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 2
    torch.cuda.set_device = lambda device: calls.append(("set_device", str(device)))
    dist.init_process_group = lambda backend=None, **kwargs: calls.append(("init_process_group", backend))
    dist.get_world_size = lambda *args, **kwargs: 2
    dist.get_rank = lambda *args, **kwargs: local_rank
    distributed.setup("cuda")
    state = PartialState()
    results.put((local_rank, calls, state.backend, str(state.device), "wait_for_everyone" in state.__dict__))


def test_gpu_ranks_get_nccl_and_one_gpu_each():
    """torchrun / accelerate launch with device=cuda (or auto on a GPU node): nccl, and rank r bound to cuda:r
    (LOCAL_RANK), so that ``cuda`` in the methods is the rank's own GPU; accelerate's barrier is kept (it names the
    GPU)."""
    import child_processes

    results = child_processes.queue()
    child_processes.start_ranks(_gpu_rank, args=(results,), nprocs=2)
    for r, calls, backend, device, barrier_replaced in sorted(results.get(timeout=60) for _ in range(2)):
        assert calls == [("init_process_group", "nccl"), ("set_device", f"cuda:{r}")]
        assert backend == "nccl" and device == f"cuda:{r}" and not barrier_replaced
