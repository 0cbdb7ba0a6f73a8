"""Read run folders into flat records for selection, tables and figures.

A run folder is any folder holding ``.hydra/config.yaml`` with a ``method`` node (``evaluate.py`` output folders also
have a Hydra config but train nothing, so they are not runs). Its state comes from ``status.json``; a folder without a
readable ``status.json``, or a completed one without ``metrics.json``, is ``missing`` (the job never started or was
killed before writing its results). A ``running`` run whose process is gone is ``interrupted`` (``run_owner``); a
completed run with a damaged result file (truncated weights, corrupt metrics or config: see ``completed_runs.damage``)
is ``corrupt``. Neither is counted, and the reports say which and why. A run that failed while its settings were
validated, before any data or model was touched, is ``invalid``: its settings are a mistake (an unknown key, a value
out of range), not a point of the grid, so they never become columns of the selection's tables. Everything here only
reads, so it is safe on sweeps that are still running.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.errors import UserError, first_line
from rewarduq_exp.core.foreign_config import read_foreign_config, read_yaml_data
from rewarduq_exp.core.saved_files import read_json_object
from rewarduq_exp.core.strict_json import nulls_to_nan
from rewarduq_exp.runs.completed_runs import damage
from rewarduq_exp.runs.run_identity import NOT_HYPERPARAMETERS, VALIDATION
from rewarduq_exp.runs.run_owner import describe_owner, effective_state

STATES = ("completed", "failed", "invalid", "running", "interrupted", "corrupt", "missing")


@dataclass
class RunRecord:
    path: Path
    state: str  # one of STATES
    error: str  # first line of the error (failed / missing), else ""
    method: str
    model: str
    dataset: str  # the training dataset's config choice
    seed: int | None
    hyperparameters: dict = field(default_factory=dict)
    overrides: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # {eval dataset: {metric: value}}
    finished_at: str = ""

    def config_key(self) -> tuple:
        """Identity of the configuration, seed left out: runs sharing it are repeats over seeds."""
        return (self.method, self.model, self.dataset, tuple(sorted(self.hyperparameters.items(), key=_item_key)))


def _item_key(item):
    # Values of one key may mix types across runs (1 vs 1.0 vs "a"); sort by name, then a printable form.
    return item[0], repr(item[1])


def find_runs(paths) -> list[RunRecord]:
    """Every run folder at or below each of ``paths`` (a run folder, a sweep folder, or any parent), sorted by path.

    Raises UserError if a path does not exist or no run folder is found at all.
    """
    folders: list[Path] = []
    for p in paths:
        root = Path(p)
        if not root.is_dir():
            raise UserError(f"not a folder: {root}; give run folders or folders that contain them")
        folders.extend(_run_folders(root))
    if not folders:
        shown = ", ".join(str(p) for p in paths)
        raise UserError(f"no run folders (folders with .hydra/config.yaml) found under: {shown}")
    unique = sorted({f.resolve(): f for f in folders}.values(), key=lambda f: str(f))
    records = [r for r in (read_run(f) for f in unique) if r is not None]
    if not records:
        shown = ", ".join(str(p) for p in paths)
        raise UserError(f"no training run folders (a .hydra/config.yaml with a method) found under: {shown}")
    return records


def _run_folders(root: Path):
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        if (here / ".hydra" / "config.yaml").is_file():
            dirnames.clear()  # a run folder holds results, not other runs
            yield here
            continue
        # Hidden folders (.hydra of a sweep, .git, caches) never hold runs; pruning keeps the walk fast.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))


def read_run(folder: str | os.PathLike) -> RunRecord | None:
    """One run folder as a :class:`RunRecord`; unreadable result files make it ``missing`` rather than an error.

    None when the folder's config has no ``method`` (not a training run, e.g. an ``evaluate.py`` output).
    """
    folder = Path(folder)
    try:  # read as data: bounded, no resolver called (a hostile config is one corrupt run, not a write elsewhere)
        cfg = read_foreign_config(folder / ".hydra" / "config.yaml")
    except UserError as err:
        return RunRecord(path=folder, state="corrupt", error=f".hydra/config.yaml unreadable: {first_line(err)}",
                         method="unknown", model="unknown", dataset="unknown", seed=None)
    if not isinstance(cfg, DictConfig) or not isinstance(cfg.get("method"), DictConfig):
        return None
    choices = _choices(folder)
    method_node = cfg.method
    seed = _seed(cfg)

    status, status_problem = _read_json(folder / "status.json")
    state = effective_state(status) if status else None
    error = ""
    if state not in ("completed", "failed", "running", "interrupted"):
        state, error = "missing", status_problem or f"status.json has an unknown state {state!r}"
    elif state == "completed" and (problem := damage(folder)):
        state, error = ("corrupt" if (folder / "metrics.json").is_file() else "missing"), problem
    elif state == "interrupted":
        error = f"its process ({describe_owner(status)}) is gone"
    elif state == "failed":
        error = first_line(status.get("error") or "failed (no error recorded)", limit=None)
        if status.get("stage") == VALIDATION:
            state = "invalid"

    overrides = _load_yaml(folder / ".hydra" / "overrides.yaml")
    overrides = [str(o) for o in overrides] if isinstance(overrides, list) else []

    return RunRecord(
        path=folder,
        state=state,
        error=error,
        method=str(choices.get("method") or _method_name(method_node)),
        model=str(choices.get("model") or _node_name(cfg, "model")),
        dataset=str(choices.get("dataset") or _node_name(cfg, "dataset")),
        seed=seed,
        hyperparameters=hyperparameters(cfg),
        overrides=overrides,
        # a null metric was NaN/inf when computed (strict JSON): NaN again here, a missing value for every reader
        metrics=nulls_to_nan(read_json_object(folder / "metrics.json")) if state == "completed" else {},
        finished_at=str((status or {}).get("finished_at", "")),
    )


def hyperparameters(cfg: DictConfig) -> dict:
    """The method node's scalar settings, minus where/how it runs (``NOT_HYPERPARAMETERS``), in config order; the
    config as :func:`read_run` reads it (references such as ``${seed}`` already resolved, no resolver called)."""
    method = cfg.get("method")
    if not isinstance(method, DictConfig):
        return {}
    raw = OmegaConf.to_container(method, resolve=False)
    return {key: value for key, value in raw.items()
            if key not in NOT_HYPERPARAMETERS and (value is None or isinstance(value, (bool, int, float, str)))}


def _seed(cfg: DictConfig) -> int | None:
    # The top-level seed is the run's; the method's `seed: ${seed}` points at it.
    for node, key in ((cfg, "seed"), (cfg.get("method"), "seed")):
        if isinstance(node, DictConfig) and key in node:
            raw = OmegaConf.to_container(node, resolve=False)[key]
            if isinstance(raw, int) and not isinstance(raw, bool):
                return raw
    return None


def _load_yaml(path: Path):
    """A YAML file of the run's ``.hydra/`` as plain containers; None when it is missing or unreadable (a damaged
    copy of a secondary file must not hide the run)."""
    try:
        return read_yaml_data(path) if path.is_file() else None
    except UserError:
        return None


def _choices(folder: Path) -> dict:
    hydra_cfg = _load_yaml(folder / ".hydra" / "hydra.yaml")
    choices = ((hydra_cfg or {}).get("hydra") or {}).get("runtime", {}).get("choices") if isinstance(
        hydra_cfg, dict) else None
    return choices if isinstance(choices, dict) else {}


def _node_name(cfg: DictConfig, group: str) -> str:
    node = cfg.get(group)
    if isinstance(node, DictConfig):
        name = OmegaConf.to_container(node, resolve=False).get("name")
        if isinstance(name, str):
            return name
    return "unknown"


def _method_name(node) -> str:
    # Without hydra.yaml the class name is the best identity we have (EnsMLP, BayLin).
    target = OmegaConf.to_container(node, resolve=False).get("_target_", "") if isinstance(node, DictConfig) else ""
    return target.rsplit(".", 1)[-1] if target else "unknown"


def _read_json(path: Path) -> tuple[dict | None, str]:
    if not path.is_file():
        return None, f"{path.name} missing (never started or killed)"
    try:
        return read_json_object(path), ""
    except UserError as err:
        return None, str(err)
