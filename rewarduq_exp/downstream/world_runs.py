"""The trained runs a downstream task studies, and the synthetic world they were trained in.

Downstream tasks need the true reward, so they accept runs trained on the synthetic world (``dataset=synthetic``):
the world is rebuilt from the run's own dataset config, so candidates and labels come from the distribution the
model was trained on. ``run=`` may name run folders or sweep folders; every completed run below them is used, and
runs that did not complete are listed and skipped (a failed point of a sweep does not stop the study). A run's
config is read as any run folder is (``read_run_config``): it builds only this package's methods and loaders.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.registry import build_loader, check_untrusted_dataset
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.runner.trained_run import read_run_config
from rewarduq_exp.runs.run_records import RunRecord, find_runs

SYNTHETIC_WORLD = f"{SyntheticWorld.__module__}.{SyntheticWorld.__qualname__}"

log = logging.getLogger("rewarduq_exp")


@dataclass
class WorldRun:
    record: RunRecord
    config: DictConfig  # the run's resolved config
    label: str          # short and unique within the study: the method, plus the folder name when it repeats

    @property
    def path(self) -> Path:
        return self.record.path


def run_paths(run) -> list[str]:
    if run is None or (isinstance(run, str) and not run.strip()):
        raise UserError("run= is missing; give a run folder or a sweep folder trained on dataset=synthetic "
                        "(e.g. run=outputs/multirun/<sweep>)")
    return [str(r) for r in run] if isinstance(run, (list, tuple, ListConfig)) else [str(run)]


def world_of(config: DictConfig, config_path: Path | str = ".hydra/config.yaml") -> SyntheticWorld:
    """The synthetic world of a run's config (``config_path``: the file it came from, named in errors). The
    dataset node is a run folder's, so it may build only this package's loaders, and here only the world itself:
    the class is compared by its full path, never by how its name ends."""
    check_untrusted_dataset(config.get("dataset"), str(config_path))
    target = config.dataset.get("_target_")
    world = build_loader(config.dataset) if target == SYNTHETIC_WORLD else None
    if not isinstance(world, SyntheticWorld):
        raise UserError(f"downstream tasks need runs trained on dataset=synthetic (they read its true reward); this "
                        f"run was trained on dataset '{config.dataset.get('name')}'")
    return world


def completed_world_runs(run) -> list[WorldRun]:
    """The completed runs below ``run`` (a path or list of paths), each with its config; one line for none."""
    records = find_runs(run_paths(run))
    done = [r for r in records if r.state == "completed"]
    for r in records:
        if r.state != "completed":
            log.warning("skipping %s: %s%s", r.path, r.state, f" ({r.error})" if r.error else "")
    if not done:
        raise UserError(f"no completed runs under {', '.join(run_paths(run))}; train them first")
    out = []
    methods = [r.method for r in done]
    for r in done:
        _, config = read_run_config(r.path)  # checked: only this package's methods and loaders
        world_of(config, r.path / ".hydra" / "config.yaml")  # refuse a run from another dataset before any work
        label = r.method if methods.count(r.method) == 1 else f"{r.method}/{r.path.name}"
        out.append(WorldRun(r, config, label))
    return out
