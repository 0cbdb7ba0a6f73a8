"""Launchers (in-process, submitit local and Slurm) that never submit a run whose folder already holds it, completed.

Hydra has no resume: launched again, a sweep would submit every job, and each would only find out on the cluster that
it has nothing to do. These launchers resolve each job's config first, compute its identity (the same ``config_hash``
a run writes into ``status.json``) and submit only the jobs whose folder does not say ``completed`` with that hash:
failed, missing and changed runs, and the new points of an extended grid. The skipped jobs are reported to Hydra as
completed. A point is also skipped when an intact completed run of the same config exists anywhere below the output
root (another sweep folder, a single run: the summary says where), and left alone while another live process runs it
(a second launch of the same sweep: see ``rewarduq_exp.runs.run_owner``); an interrupted one (its process is gone) is
submitted again. Every job's outcome (completed, skipped, failed) is recorded in ``rewarduq_exp.runs.sweep_outcome``;
``train.py`` prints the summary at the end and exits non-zero when a job failed. ``rewarduq_basic`` (the default of
``conf/train.yaml``) is Hydra's in-process BasicLauncher with the same skipping and summary.

A job with several tasks (``hydra.launcher.tasks_per_node=N``, with ``gpus_per_node=N``) is one multi-GPU run: its N
processes each run the job, and the job function exports the torch.distributed environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ...) first, so that they form one process group, exactly as under torchrun. Only
rank 0 writes the run folder (``rewarduq_exp.core.distributed``), Hydra's ``.hydra/`` copy of the config and
``train.log``.

Plugins must live under the ``hydra_plugins`` namespace for Hydra to instantiate them (hydra/core/plugins.py).
"""

# (no "from __future__ import annotations": Hydra execs plugin modules outside sys.modules, and dataclasses
# with string annotations need the module there)

import contextlib
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hydra._internal.core_plugins.basic_launcher import BasicLauncher, BasicLauncherConf
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
from omegaconf import open_dict

from rewarduq_exp.runner.cli import register_resolvers

# conf/train.yaml's resolvers must exist wherever a job's config is composed: this module is imported by every sweep
# job process (the launcher is unpickled there), before the job's config is loaded.
register_resolvers()

log = logging.getLogger(__name__)


class SkipCompleted:
    """Mixin over a submitit launcher: filter the batch, launch the rest, summarise."""

    def _job_config(self, overrides, job_num: int):
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = job_num
        HydraConfig.instance().set_config(cfg)  # lets ${hydra:...} in the sweep subdir resolve
        return cfg

    def __call__(self, sweep_overrides, job_dir_key, job_num, job_id, singleton_state):
        """The job function, run by each task of a submitit job. A one-task job runs exactly as in the base launcher;
        a job of several tasks is one torch.distributed run (the base job function, plus the env export; only rank 0
        writes the run folder, ``.hydra/`` and ``train.log`` included: see ``train_run.train``)."""
        if not _export_torch_distributed_env():
            return super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        import submitit

        Singleton.set_state(singleton_state)
        setup_globals()
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(sweep_overrides))
        with open_dict(cfg.hydra):
            cfg.hydra.job.id = submitit.JobEnvironment().job_id
            cfg.hydra.job.num = job_num
        return run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=cfg,
                       job_dir_key=job_dir_key, job_subdir_key="hydra.sweep.subdir")

    def launch(self, job_overrides, initial_job_idx: int):
        from rewarduq_exp.runs import run_owner
        from rewarduq_exp.runs.completed_runs import completed_by_hash
        from rewarduq_exp.runs.run_identity import config_hash, is_completed, read_status

        # Every job started from here carries this launch's id in its status.json (inherited through the
        # environment), so that a job that died is told from a live run of another launch (run_owner).
        launch = os.environ[run_owner.LAUNCH_ENV] = uuid.uuid4().hex[:12]
        results: dict[int, JobReturn] = {}
        todo: list[int] = []
        folders: dict[int, Path] = {}
        skipped: dict[int, Path] = {}  # job -> the completed run it is skipped for (its own folder or another)
        indexes: dict[Path, dict] = {}  # output root -> {config hash: completed run}, walked once per launch
        for i, overrides in enumerate(job_overrides):
            cfg = self._job_config(overrides, initial_job_idx + i)
            folder = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
            folders[i] = folder
            task_cfg = cfg.copy()
            with open_dict(task_cfg):
                del task_cfg["hydra"]
            chash, status = config_hash(task_cfg), read_status(folder)
            root = Path(str(task_cfg.paths.output_root))
            if root not in indexes and not task_cfg.force:
                indexes[root] = completed_by_hash(root, skip=(str(task_cfg.paths.cache_dir),))
            found = None if task_cfg.force else indexes[root].get(chash)
            if not task_cfg.force and is_completed(folder, chash, status=status):
                log.info("skip #%d (completed, same config): %s", initial_job_idx + i, folder.name)
                skipped[i] = folder
            elif run_owner.effective_state(status) == run_owner.RUNNING:
                # Another live process (a second launch of the same sweep) runs this point: never write there.
                log.warning("skip #%d: %s is in use by another run (%s)", initial_job_idx + i, folder,
                            run_owner.describe_owner(status))
            elif found is not None:
                log.info("skip #%d (completed with the same config in %s): %s", initial_job_idx + i, found,
                         folder.name)
                skipped[i] = found
            else:
                todo.append(i)
                continue
            results[i] = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=None)
        # Launch contiguous stretches so each job keeps its hydra.job.num.
        stretches: list[list[int]] = []
        for i in todo:
            if stretches and i == stretches[-1][-1] + 1:
                stretches[-1].append(i)
            else:
                stretches.append([i])
        no_result: dict[int, str] = {}  # job -> why it ended without a result, and where its log is
        for stretch in stretches:
            with _every_job_awaited():
                launched = super().launch([job_overrides[i] for i in stretch], initial_job_idx + stretch[0])
            for i, job_return in zip(stretch, launched):
                if isinstance(job_return, _NoResult):
                    no_result[i] = job_return.describe()
                elif job_return.status == JobStatus.FAILED:  # raised out of the job (e.g. submitit refusing a
                    #                                           requeue past max_num_timeout)
                    err = job_return._return_value
                    no_result[i] = f"failed: {type(err).__name__}: {err}"
                else:
                    results[i] = job_return
                    continue
                log.error("job #%d %s", initial_job_idx + i, no_result[i])
                # Reported to Hydra as done (its sweeper would re-raise a failure and skip our summary); what became
                # of the run is read from its folder below, and a failure makes train.py exit 1.
                results[i] = JobReturn(overrides=list(job_overrides[i]), status=JobStatus.COMPLETED,
                                       _return_value=None)
        from rewarduq_exp.runs import sweep_outcome

        for i, folder in folders.items():  # (a job left to a live run elsewhere is recorded from that run's status)
            sweep_outcome.record(folder, skipped=i in skipped, where=skipped.get(i), launch=launch,
                                 no_result=no_result.get(i))
        return [results[i] for i in range(len(job_overrides))]


class _NoResult:
    """What a submitit job that ended without a result (cancelled, killed, out of memory, a node lost, not requeued
    past ``max_num_timeout``) gives back in place of its result."""

    def __init__(self, job, err: Exception):
        self.job, self.err = job, err

    def describe(self) -> str:
        # submitit's message: "Job <id> (task: 0) with path <result file> has not produced any output (state:
        # CANCELLED)", then the job's whole error stream, which the log file already holds.
        reason = " ".join(str(self.err).split("Error stream produced:")[0].split())
        reason = reason.split(" with path ")[0] + (" " + reason.split(".pkl", 1)[1].strip() if ".pkl" in reason
                                                    else "")
        return (f"(Slurm/submitit job {self.job.job_id}) ended without a result: {type(self.err).__name__}: "
                f"{reason[:300]}; its log: {self.job.paths.stderr}")


@contextlib.contextmanager
def _every_job_awaited():
    """Inside the block, waiting for a submitit job's result never raises: a job that ended without one gives a
    :class:`_NoResult`. The base launcher waits for its jobs one after another (``[j.results()[0] for j in jobs]``),
    so a job cancelled early would otherwise end the wait for all the others of the array, which go on running, and
    leave their outcome unknown. Swapped on submitit's Job class for the duration of the launch only."""
    from submitit.core.core import Job

    original = Job.results

    def results(self):
        try:
            return original(self)
        except Exception as err:  # noqa: BLE001 (UncompletedJobError, FailedJobError, a lost node, ...)
            return [_NoResult(self, err)]

    Job.results = results
    try:
        yield
    finally:
        Job.results = original


def _export_torch_distributed_env() -> bool:
    """In a job of several tasks, export torch.distributed's ``env://`` variables for this task; False (and nothing
    exported) for a one-task job, which runs as before."""
    import submitit

    job_env = submitit.JobEnvironment()
    if job_env.num_tasks <= 1:
        return False
    # set_cuda_visible_devices=False: every task keeps seeing all the job's GPUs and accelerate picks
    # cuda:LOCAL_RANK itself. With True each task would see only its own GPU, as cuda:0, and accelerate's
    # torch.cuda.set_device(LOCAL_RANK) would fail on every rank but 0.
    # overwrite=True: the tasks inherit the launcher's environment, and stale RANK/WORLD_SIZE/MASTER_* values there
    # (a sweep started from inside another distributed job) must not win over this job's own layout.
    dist_env = submitit.helpers.TorchDistributedEnvironment()
    if job_env.cluster == "local":
        # The local executor runs all tasks on this machine; its "hostname" (socket.gethostname()) need not resolve
        # to an address the tasks can reach (containers, laptops without a hosts entry), the loopback always does.
        dist_env.master_addr = "127.0.0.1"
    dist_env.export(set_cuda_visible_devices=False, overwrite=True)
    # (Hydra has not configured logging yet in the job; submitit's logger writes to the task's log file.)
    submitit.core.logger.get_logger().info("task %d of %d of one torch.distributed job (master %s:%s)",
                                           dist_env.rank, dist_env.world_size, dist_env.master_addr,
                                           dist_env.master_port)
    return True


class SkipCompletedBasicLauncher(SkipCompleted, BasicLauncher):
    """Hydra's in-process launcher (jobs one after another in this process), skipping completed runs."""


class SkipCompletedLocalLauncher(SkipCompleted, LocalLauncher):
    """submitit's local executor: each job under a controller process of its own, on this machine."""

    def __init__(self, **params) -> None:
        super().__init__(**params)
        # Ctrl-C in a terminal reaches the whole process group: the jobs, which save their training state and leave
        # with one line, and submitit's controllers, which would die on it with a traceback each. The controllers
        # start with SIGINT ignored (a shell's `trap '' INT` is inherited by what it starts); they end when their
        # job ends. The jobs install their own SIGINT handler, so they still stop on it.
        self.params["setup"] = ["trap '' INT", *(self.params.get("setup") or [])]


class SkipCompletedSlurmLauncher(SkipCompleted, SlurmLauncher):
    def __init__(self, **params) -> None:
        super().__init__(**params)
        # The profile's GPU (memory) is ours, for the plan check; submitit would refuse it as a parameter.
        self.plan_limits = {k: self.params.pop(k, None) for k in ("gpu_mem_gb", "gpu")}

    def launch(self, job_overrides, initial_job_idx: int):
        from hydra_plugins.rewarduq_launchers import slurm_checks
        from rewarduq_exp.core.errors import UserError
        from rewarduq_exp.runner.cli import fail

        # Checked before any job's config is resolved, and failed here: a UserError raised out of a launcher would
        # reach Hydra, which prints a traceback and exits 1. fail() is the entry points' one line and exit 2.
        try:
            slurm_checks.check_submission(self.params)
            self._check_plans(job_overrides)
        except UserError as err:
            fail(str(err), err.exit_code)
        with slurm_checks.squeue_fallback_watcher():
            return super().launch(job_overrides, initial_job_idx)


    def _check_plans(self, job_overrides) -> None:
        """The planner's peak memory and time of every job against the profile (``gpu_mem_gb`` / ``gpu``,
        ``timeout_min`` x (1 + ``max_num_timeout``)); ``plan.force=true`` skips it, as does a method without a plan."""
        from hydra_plugins.rewarduq_launchers import slurm_checks
        from rewarduq_exp.methods.registry import method_class
        from rewarduq_exp.runner.plan import make_plan, method_name_of_config

        plans, unplanned = [], set()
        gib = slurm_checks.gpu_memory_gib({**self.params, **self.plan_limits})
        for overrides in job_overrides:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            if cfg.get("plan", {}).get("force", False):
                continue
            name = method_name_of_config(cfg)
            if name is None or not method_class(name).has_memory_model():
                # Said, not silent: a method without a memory model is submitted unchecked.
                unplanned.add(str(name))
                continue
            if gib is not None and cfg.plan.get("device_memory_gib") is None:
                with open_dict(cfg):   # the auto token budgets of the jobs are those of the profile's GPU
                    cfg.plan.device_memory_gib = gib
            plans.append((list(overrides), make_plan(cfg)))
        if unplanned:
            log.warning("no memory check before submitting: method %s has no memory model (plan_memory)",
                        ", ".join(sorted(unplanned)))
        slurm_checks.check_plans(plans, {**self.params, **self.plan_limits})


@dataclass
class SkipCompletedBasicConf(BasicLauncherConf):
    _target_: str = "hydra_plugins.rewarduq_launchers.skip_completed.SkipCompletedBasicLauncher"


@dataclass
class SkipCompletedLocalConf(LocalQueueConf):
    _target_: str = "hydra_plugins.rewarduq_launchers.skip_completed.SkipCompletedLocalLauncher"


@dataclass
class SkipCompletedSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.rewarduq_launchers.skip_completed.SkipCompletedSlurmLauncher"
    # The GPU each job gets, for the planner's check before submitting (rewarduq_exp/runner/plan.py): its memory in
    # GiB, or a name of hydra_plugins/rewarduq_launchers/slurm_checks.KNOWN_GPUS_GIB. Neither: no memory check.
    gpu_mem_gb: Optional[float] = None
    gpu: Optional[str] = None


ConfigStore.instance().store(group="hydra/launcher", name="rewarduq_basic", node=SkipCompletedBasicConf,
                             provider="rewarduq_exp")
ConfigStore.instance().store(group="hydra/launcher", name="rewarduq_local_base", node=SkipCompletedLocalConf,
                             provider="rewarduq_exp")
ConfigStore.instance().store(group="hydra/launcher", name="rewarduq_slurm_base", node=SkipCompletedSlurmConf,
                             provider="rewarduq_exp")
