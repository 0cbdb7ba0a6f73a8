"""Shared fixtures: the tiny offline backbone (built once per session in a temp cache) and a quiet, offline env."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import child_processes
import pytest
from omegaconf import OmegaConf

# One CPU thread per test process (and per process it starts): pytest-xdist already runs one worker per core, and
# torch's default of one thread per core in every worker oversubscribes the cores, which made the tiny backbone's
# forward passes 10-20x slower (OpenMP threads spin waiting for a core).
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
import torch  # noqa: E402 (after the variables above, which it reads at import)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Tests never touch the network and never print progress bars.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# The datasets library's cache (read once, at import): a folder of this test process, never the user's.
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="rewarduq-tests-hf-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)

ROOT = Path(__file__).resolve().parents[1]

# Nothing forks the test process: on a GPU node it may have initialised CUDA (in-process runs with device=auto), and a
# forked child could not use CUDA. Children come from tests/child_processes.py, whose fork server starts with the
# session (in each xdist worker; the controller runs no test).
child_processes.install_fork_guard()


def pytest_sessionstart(session):
    if not session.config.pluginmanager.hasplugin("dsession"):  # "dsession": pytest-xdist's controller
        child_processes.start_server()


def _fail_on_fork(phase: str):
    start = len(child_processes.FORKS)
    yield
    if len(child_processes.FORKS) > start:
        where = child_processes.FORKS[start]
        del child_processes.FORKS[start:]
        pytest.fail(f"the test process was forked during {phase} (forked at:\n{where}): on a GPU node it may have "
                    f"initialised CUDA, which a forked child cannot use; {child_processes.USE_INSTEAD}",
                    pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _fail_on_fork("setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _fail_on_fork("the test"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _fail_on_fork("teardown"))


# `make test` and `make test-e2e` run pytest-xdist with --dist loadfile --no-loadscope-reorder: whole files go to the
# two workers in collection order. The longest files go first (seconds on 2 cores, measured with --durations on
# 2026-11-28; both tiers in one list, each run keeps its own), so that the short files fill in at the end and the two
# workers finish together; in alphabetical order one worker idled for the last ~35 s of the run.
LONGEST_FIRST = [
    # make test-e2e
    "test_borp_run.py",                     # ~105
    "test_plan_memory.py",                  # ~55
    "test_rl.py",                           # ~45 (make test: ~25)
    "test_new_method_in_its_own_files.py",  # ~40
    "test_run_ownership.py",                # ~37
    "test_cli_datasets.py",                 # ~36
    "test_plain_install.py",                # ~35
    "test_sweep_multitask.py",              # ~33
    "test_cli_finetune.py",                 # ~30
    "test_downstream.py",                   # ~30 (its units stay in make test)
    "test_label_ranking_run.py",            # ~30
    "test_cli_resume.py",                   # ~29
    "test_acceptance.py",                   # ~26
    "test_interrupts.py",                   # ~26
    "test_distributed.py",                  # ~25
    "test_sweep.py",                        # ~21
    "test_vader_ratings.py",                # ~17
    # make test (test_cli.py: both)
    "test_cli.py",                          # ~28 + ~42
    "test_bench_scripts.py",                # ~28
    "test_config_composition.py",           # ~23
    "test_mcd_dpo.py",                      # ~15
    "test_result_writes.py",                # ~12
    "test_ens_lora.py",                     # ~12
    "test_plan.py",                         # ~9
    "test_api_real_use.py",                 # ~8
    "test_la_lora.py",                      # ~8
    "test_offline_node.py",                 # ~7
]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests stay together


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny_model_cfg():
    return OmegaConf.load(ROOT / "conf" / "model" / "tiny-qwen3.yaml")


@pytest.fixture(scope="session")
def tiny_backbone(cache_dir, tiny_model_cfg):
    from rewarduq_exp.models.backbone import Backbone

    return Backbone(tiny_model_cfg, cache_dir=cache_dir, device="cpu")


@pytest.fixture(scope="session")
def tokenizer(tiny_backbone):
    return tiny_backbone.tokenizer


def cache_with_tiny_model(cache: Path, tiny_backbone) -> Path:
    """``cache`` (created) as a run's ``paths.cache_dir`` that holds the session's tiny model (linked, not rebuilt)
    and no features."""
    (cache / "models").mkdir(parents=True, exist_ok=True)
    built = Path(tiny_backbone.source)
    (cache / "models" / built.name).symlink_to(built)
    return cache


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory, tiny_backbone):
    """A cache per test module for the command-line tests: the tiny model is built once per session (linked in) and
    features are shared by the module's runs, as in a real sweep."""
    return cache_with_tiny_model(tmp_path_factory.mktemp("cli_cache"), tiny_backbone)
