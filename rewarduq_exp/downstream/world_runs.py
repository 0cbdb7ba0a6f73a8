"""The trained runs a downstream task studies, and the synthetic world they were trained in.

Downstream tasks need the true reward, so they accept runs trained on the synthetic world (``dataset=synthetic``):
the world is rebuilt from the run's own dataset config, so candidates and labels come from the distribution the
model was trained on. ``run=`` may name run folders or sweep folders; every completed run below them is used, and
runs that did not complete are listed and skipped (a failed point of a sweep does not stop the study).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.registry import build_loader
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.runs.run_records import RunRecord, find_runs

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


def world_of(config: DictConfig) -> SyntheticWorld:
    target = str(config.dataset.get("_target_", ""))
    world = build_loader(config.dataset) if target.endswith("SyntheticWorld") else None
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
        config = OmegaConf.load(r.path / ".hydra" / "config.yaml")
        world_of(config)  # refuse a run from another dataset before any work
        label = r.method if methods.count(r.method) == 1 else f"{r.method}/{r.path.name}"
        out.append(WorldRun(r, config, label))
    return out
