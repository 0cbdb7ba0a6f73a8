"""Submitit launchers (local and Slurm) that never submit a run whose folder already holds it, completed.

Hydra has no resume: launched again, a sweep would submit every job, and each would only find out on the cluster
that it has nothing to do. These launchers resolve each job's config first, compute its identity (the same
``config_hash`` a run writes into ``status.json``) and submit only the jobs whose folder does not say
``completed`` with that hash: failed, missing and changed runs, and the new points of an extended grid. The skipped
jobs are reported to Hydra as completed, and a summary of the whole sweep is logged at the end.

Plugins must live under the ``hydra_plugins`` namespace for Hydra to instantiate them (hydra/core/plugins.py).
"""

# (no "from __future__ import annotations": Hydra execs plugin modules outside sys.modules, and dataclasses
# with string annotations need the module there)

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
from omegaconf import open_dict

log = logging.getLogger(__name__)


class SkipCompleted:
    """Mixin over a submitit launcher: filter the batch, launch the rest, summarise."""

    def _job_config(self, overrides, job_num: int):
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = job_num
        HydraConfig.instance().set_config(cfg)  # lets ${hydra:...} in the sweep subdir resolve
        return cfg

    def launch(self, job_overrides, initial_job_idx: int):
        from rewarduq_exp.run_folder import config_hash

        results: dict[int, JobReturn] = {}
        todo: list[int] = []
        folders: dict[int, Path] = {}
        for i, overrides in enumerate(job_overrides):
            cfg = self._job_config(overrides, initial_job_idx + i)
            folder = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
            folders[i] = folder
            task_cfg = cfg.copy()
            with open_dict(task_cfg):
                del task_cfg["hydra"]
            if _completed_with(folder, config_hash(task_cfg)):
                log.info("skip #%d (completed, same config): %s", initial_job_idx + i, folder.name)
                results[i] = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=None)
            else:
                todo.append(i)
        # Launch contiguous stretches so each job keeps its hydra.job.num.
        stretches: list[list[int]] = []
        for i in todo:
            if stretches and i == stretches[-1][-1] + 1:
                stretches[-1].append(i)
            else:
                stretches.append([i])
        for stretch in stretches:
            launched = super().launch([job_overrides[i] for i in stretch], initial_job_idx + stretch[0])
            results.update(zip(stretch, launched))
        _log_summary(folders, skipped=len(job_overrides) - len(todo))
        return [results[i] for i in range(len(job_overrides))]


def _completed_with(folder: Path, chash: str) -> bool:
    try:
        status = json.loads((folder / "status.json").read_text())
    except (OSError, ValueError):
        return False
    return status.get("state") == "completed" and status.get("config_hash") == chash


def _log_summary(folders: dict[int, Path], skipped: int) -> None:
    states = {}
    for folder in folders.values():
        try:
            state = json.loads((folder / "status.json").read_text()).get("state", "missing")
        except (OSError, ValueError):
            state = "missing"
        states[state] = states.get(state, 0) + 1
    counts = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
    log.info("sweep: %d jobs (%s); %d skipped without submitting. Failed runs keep their error in status.json; "
             "scripts/select.py lists them.", len(folders), counts, skipped)


class SkipCompletedLocalLauncher(SkipCompleted, LocalLauncher):
    pass


class SkipCompletedSlurmLauncher(SkipCompleted, SlurmLauncher):
    pass


@dataclass
class SkipCompletedLocalConf(LocalQueueConf):
    _target_: str = "hydra_plugins.rewarduq_launchers.skip_completed.SkipCompletedLocalLauncher"


@dataclass
class SkipCompletedSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.rewarduq_launchers.skip_completed.SkipCompletedSlurmLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="rewarduq_local_base", node=SkipCompletedLocalConf,
                             provider="rewarduq_exp")
ConfigStore.instance().store(group="hydra/launcher", name="rewarduq_slurm_base", node=SkipCompletedSlurmConf,
                             provider="rewarduq_exp")
