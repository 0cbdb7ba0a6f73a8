"""What a run IS and when it is DONE, in one place (dora-style identity).

* A run's identity is a hash of its resolved config (``config_hash``), minus the keys that do not change its numbers
  (``NON_IDENTITY_KEYS``: where outputs go, progress bars, logging, re-run switches). A multirun job folder is named
  ``<readable overrides>-<hash>``; its readable part leaves out the same keys (``override_dirname_excluded``, which
  ``conf/train.yaml`` reads through the ``${run_identity:override_dirname_excluded}`` resolver), so relaunching a sweep
  with another logger or output root finds the same folders.
* A run is completed when its ``status.json`` says ``completed`` and its ``metrics.json`` exists (``is_completed``);
  with a hash, only if the status carries that same hash. The launchers (skip before submitting), ``train.py`` (skip
  inside the job) and the run-folder readers (selection, tables) all ask this function.
* The method keys that are not hyperparameters (``NOT_HYPERPARAMETERS``: where and how a run executes, and the seed,
  which is grouped on separately) are never shown as hyperparameter columns.

Free of torch: the launchers and the selection scripts import it.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.hashing import stable_hash
from rewarduq_exp.core.saved_files import read_json_object

# Top-level config keys that do not change a run's numbers: left out of its identity.
NON_IDENTITY_KEYS = ("force", "progress", "progress_log_minutes", "plan", "logger", "paths", "sweep_name", "checkpoint")
# The same inside the method node.
NON_IDENTITY_METHOD_KEYS = ("show_progress",)
# Method keys that are settings of the execution or the seed, not hyperparameters of the model.
NOT_HYPERPARAMETERS = ("_target_", "seed", "device", "show_progress")
COMPLETED = "completed"
VALIDATION = "validation"  # status.json "stage" of a run that failed before any data or model was touched
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.json"




def config_hash(cfg: DictConfig) -> str:
    """The identity of a run: the resolved config without the non-identity keys (and without ``hydra``)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    for key in NON_IDENTITY_KEYS:
        container.pop(key, None)
    method = container.get("method")
    if isinstance(method, dict):
        for key in NON_IDENTITY_METHOD_KEYS:
            method.pop(key, None)
    return stable_hash(container, n=12)


def override_dirname_excluded(paths_keys=("output_root", "cache_dir", "datasets_dir")) -> list[str]:
    """Command-line keys left out of a multirun folder's readable name (Hydra's override_dirname.exclude_keys)."""
    keys = []
    for key in NON_IDENTITY_KEYS:
        keys += [f"paths.{p}" for p in paths_keys] if key == "paths" else [key]
    return keys + [f"method.{k}" for k in NON_IDENTITY_METHOD_KEYS]


def read_status(folder: str | os.PathLike) -> dict:
    """``status.json`` of a run folder as a dict; ``{}`` when it is missing, unreadable or beyond the bounds of a
    run folder's JSON files (a huge or deeply nested one costs nothing and raises nothing)."""
    try:
        return read_json_object(Path(folder) / STATUS_FILE)
    except UserError:
        return {}


def is_completed(folder: str | os.PathLike, chash: str | None = None, status: dict | None = None) -> bool:
    """True when the run in ``folder`` completed (with config hash ``chash``, when given) and has its metrics."""
    status = read_status(folder) if status is None else status
    return (status.get("state") == COMPLETED and (chash is None or status.get("config_hash") == chash)
            and (Path(folder) / METRICS_FILE).is_file())
