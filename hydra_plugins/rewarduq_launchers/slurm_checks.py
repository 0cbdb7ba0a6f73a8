"""What ``hydra/launcher=slurm`` checks before it submits, and how it follows the jobs on any cluster.

:func:`check_submission` asks the cluster (``sinfo``) whether the jobs can run at all: a partition that does not
exist, more memory, CPUs, GPUs or nodes than the partition's nodes have. sbatch refuses such jobs too, but only once
the launcher has resolved every job's config, in a multi-line report that submitit wraps in its own, and the sweep then
records every job as failed. Here it is one line naming the setting, what the cluster has and what to change, and
nothing is submitted.

:class:`SqueueFallback` replaces submitit's job watcher while the launcher waits for its jobs. Submitit asks
``sacct`` for the jobs' states; on a cluster without job accounting (slurmdbd) every such call fails, submitit logs a
warning per poll, and a job that ended without writing its result (cancelled, killed at its memory limit) is never
seen as finished, so the launcher would wait forever. This watcher asks ``squeue`` instead there, once it knows that
accounting is off.
"""

# (no "from __future__ import annotations", and submitit imported only where a launch needs it: Hydra imports every
# module of hydra_plugins at each start, outside sys.modules, where dataclasses cannot read string annotations)

import contextlib
import functools
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from rewarduq_exp.core.errors import UserError, first_line

log = logging.getLogger(__name__)

QUERY_TIMEOUT_S = 30  # a controller that does not answer a query in this time is reported, not waited for
NO_SBATCH = ("hydra/launcher=slurm needs Slurm's sbatch on the PATH (not found); run on a cluster login node, or start "
             "a local one with scripts/local_slurm.sh start")


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    memory_mb: int
    gpus: int


def check_submission(params: Mapping, timeout_s: float = QUERY_TIMEOUT_S) -> None:
    """Raise :class:`UserError` (one line) when the launcher's parameters (``hydra.launcher.*``, as the launcher holds
    them) ask for what the cluster does not have; nothing is submitted here."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserError(NO_SBATCH)
    # The sinfo of the same installation as the sbatch that will submit. There is none beside a stand-in sbatch (a
    # site's wrapper, a test's recorder): then there is nobody to ask, and sbatch alone judges the job.
    sinfo = Path(sbatch).parent / "sinfo"
    if not sinfo.is_file():
        log.debug("no sinfo beside %s: the submission is not checked against the cluster", sbatch)
        return
    partitions, default = _partitions(sinfo, timeout_s)
    partition = params.get("partition")
    if partition is None:
        if default is None:
            return  # no default partition: sbatch says so itself
        partition, key = default, f"the default partition ({default})"
    else:
        # sbatch takes a list, "a,b": the job runs in whichever has room first
        partition, key = str(partition), f"partition {partition}"
        unknown = [name for name in partition.split(",") if name not in partitions]
        if unknown:
            raise UserError(f"hydra.launcher.partition={partition}: {', '.join(unknown)} is not a partition of this "
                            f"cluster; allowed: {', '.join(partitions) or '(none)'}")
    nodes = _nodes(sinfo, partition, timeout_s)
    if not nodes:
        raise UserError(f"{key} has no nodes; set hydra.launcher.partition to one of: {', '.join(partitions)}")
    _check_resources(params, key, nodes)


def _check_resources(params: Mapping, key: str, nodes: list[Node]) -> None:
    count = int(params.get("nodes") or 1)
    if count > len(nodes):
        raise UserError(f"hydra.launcher.nodes={count} but {key} has {len(nodes)} node{'s' * (len(nodes) != 1)}; "
                        f"set hydra.launcher.nodes={len(nodes)} or fewer")
    mem_gb = params.get("mem_gb")
    largest = max(nodes, key=lambda n: n.memory_mb)
    # submitit asks for mem_gb as "<n>GB", which Slurm counts in units of 1024 MB
    if mem_gb is not None and float(mem_gb) * 1024 > largest.memory_mb:
        raise UserError(f"hydra.launcher.mem_gb={mem_gb} is more memory than any node of {key} has (the largest, "
                        f"{largest.name}, has {largest.memory_mb} MB = {largest.memory_mb // 1024} GB); set "
                        f"hydra.launcher.mem_gb={largest.memory_mb // 1024} or less")
    cpus_per_task, tasks = int(params.get("cpus_per_task") or 1), int(params.get("tasks_per_node") or 1)
    most_cpus = max(n.cpus for n in nodes)
    if cpus_per_task * tasks > most_cpus:
        asked = f"hydra.launcher.cpus_per_task={cpus_per_task}" + (f" x tasks_per_node={tasks}" if tasks > 1 else "")
        raise UserError(f"{asked} needs {cpus_per_task * tasks} CPUs on a node, but the nodes of {key} have at most "
                        f"{most_cpus}; lower hydra.launcher.cpus_per_task")
    gpus = int(params.get("gpus_per_node") or 0)
    most_gpus = max(n.gpus for n in nodes)
    if gpus > most_gpus:
        if most_gpus == 0:
            raise UserError(f"hydra.launcher.gpus_per_node={gpus} but {key} has no GPUs; set "
                            "hydra.launcher.gpus_per_node=0 for CPU jobs")
        raise UserError(f"hydra.launcher.gpus_per_node={gpus} but the nodes of {key} have at most {most_gpus} GPUs; "
                        f"set hydra.launcher.gpus_per_node={most_gpus} or fewer")


def _sinfo(sinfo: Path, args: list[str], timeout_s: float) -> list[str]:
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():  # (Slurm's commands wait a minute for it to appear)
        raise UserError(f"SLURM_CONF={conf} is not a file; set it to the cluster's slurm.conf, or unset it")
    command = [str(sinfo), "--noheader", *args]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(f"Slurm's controller did not answer sinfo in {timeout_s:g} s, so the job cannot be checked "
                        "or submitted; check the cluster (sinfo) and launch again") from None
    if proc.returncode != 0:
        # The fatal line says why (sinfo logs the attempts before it, e.g. a DNS lookup of the controller)
        fatal = next((line for line in proc.stderr.splitlines() if "fatal:" in line), proc.stderr)
        why = first_line(fatal) or f"exit status {proc.returncode}"
        raise UserError(f"cannot ask Slurm about its partitions: sinfo failed ({why}); check that the cluster is up "
                        "(sinfo; a local one: scripts/local_slurm.sh start, then export SLURM_CONF)")
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()]


def _partitions(sinfo: Path, timeout_s: float) -> tuple[list[str], str | None]:
    """The cluster's partitions in sinfo's order, and the default one (sinfo marks it with ``*``)."""
    names: list[str] = []
    default = None
    # --all: hidden partitions too, which sbatch accepts by name
    for line in _sinfo(sinfo, ["--all", "--format=%P"], timeout_s):
        name = line.rstrip("*")
        if line.endswith("*"):
            default = name
        if name not in names:
            names.append(name)
    return names, default


def _nodes(sinfo: Path, partition: str, timeout_s: float) -> list[Node]:
    nodes = {}
    for line in _sinfo(sinfo, ["--Node", f"--partition={partition}", "--format=%N|%c|%m|%G"], timeout_s):
        name, cpus, memory, gres = (line.split("|", 3) + ["", "", ""])[:4]
        nodes[name] = Node(name, _number(cpus), _number(memory), _gpu_count(gres))
    return list(nodes.values())


def _number(text: str) -> int:
    match = re.match(r"\d+", text.strip())
    return int(match.group()) if match else 0


def _gpu_count(gres: str) -> int:
    """The GPUs in a node's ``%G`` field, e.g. ``gpu:a100:4(S:0-1),gpu:v100:2`` -> 6; ``(null)`` -> 0."""
    total = 0
    for entry in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = entry.strip().split(":")
        if parts[0] == "gpu":
            total += int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return total


# -- following the jobs ------------------------------------------------------------------------------------------

# The state of a job that left the queue without a result file, on a cluster that keeps no record of how it ended.
# submitit counts any state it does not know as finished, and then reports that the job produced no output.
ENDED_UNRECORDED = "ENDED (left the queue; no accounting to say how)"
_ACCOUNTING_OFF = "accounting storage is disabled"


class SqueueFallback:
    """Mixin over submitit's ``SlurmInfoWatcher`` (``sacct``): asks ``squeue`` instead when sacct cannot answer. A job
    that squeue no longer lists and that has not written its result (which submitit checks first) has ended: it is
    reported in the state :data:`ENDED_UNRECORDED`, so that ``job.result()`` raises submitit's error for a job without
    output. Use :func:`squeue_fallback_watcher_class`."""

    def __init__(self, delay_s: int = 60, timeout_s: float = QUERY_TIMEOUT_S) -> None:
        super().__init__(delay_s=delay_s)
        self._timeout_s = timeout_s
        self._use_squeue = False  # set for good once sacct says that accounting is off
        self._warned = False  # one warning for a failing sacct or squeue, not one per poll

    def update(self) -> None:
        """As the base class's update (one call for all the registered jobs), without its warning per failed call."""
        sacct = self._make_command()
        if sacct is None:
            return
        self._num_calls += 1
        info = None if self._use_squeue else self._sacct(sacct)
        if info is None:
            info = self._squeue()
        if info is not None:
            self._info_dict.update(info)
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def _sacct(self, command: list[str]) -> dict | None:
        proc = self._run(command)
        if proc is not None and proc.returncode == 0:
            return self.read_info(proc.stdout)
        why = "no answer" if proc is None else first_line(proc.stderr) or f"exit status {proc.returncode}"
        if proc is not None and _ACCOUNTING_OFF in proc.stderr.lower():
            self._use_squeue = True
            log.info("this Slurm cluster keeps no job accounting (sacct: %s): following the jobs with squeue", why)
        else:
            self._warn(f"sacct failed ({why}); asking squeue for the jobs' states instead")
        return None

    def _squeue(self) -> dict | None:
        """The jobs' states from squeue, as ``read_info`` gives sacct's, with the jobs that squeue no longer lists as
        :data:`ENDED_UNRECORDED`; None when squeue does not answer."""
        pending = self._registered - self._finished
        main_ids = ",".join(sorted({job_id.split("_")[0] for job_id in pending}))
        # -r: one line per array task; -t all: also the jobs that ended a moment ago (listed for MinJobAge seconds)
        proc = self._run(["squeue", "--noheader", "-r", "-t", "all", "--format=%i|%T|%N", f"--jobs={main_ids}"])
        if proc is None:
            self._warn("squeue did not answer; the jobs' states are unknown for now")
            return None
        lines = proc.stdout.splitlines()
        if proc.returncode != 0:
            # squeue refuses a list of ids that it has all forgotten ("Invalid job id specified"): they all ended
            if "invalid job id" not in proc.stderr.lower():
                why = first_line(proc.stderr) or f"exit status {proc.returncode}"
                self._warn(f"squeue failed ({why}); the jobs' states are unknown for now")
                return None
            lines = []
        listed = self.read_info("\n".join(["JobID|State|NodeList", *lines]))
        for job_id in pending - set(listed):
            listed[job_id] = {"JobID": job_id, "State": ENDED_UNRECORDED, "NodeList": ""}
        return listed

    def _run(self, command: list[str]) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=self._timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            return None

    def _warn(self, message: str) -> None:
        (log.debug if self._warned else log.warning)(message)
        self._warned = True


@functools.cache
def squeue_fallback_watcher_class() -> type:
    """submitit's ``SlurmInfoWatcher`` with :class:`SqueueFallback`, made on first use (see the imports)."""
    from submitit.slurm.slurm import SlurmInfoWatcher

    class SqueueFallbackWatcher(SqueueFallback, SlurmInfoWatcher):
        pass

    return SqueueFallbackWatcher


@contextlib.contextmanager
def squeue_fallback_watcher() -> Iterator:
    """Follow the jobs submitted inside the block with a watcher of :func:`squeue_fallback_watcher_class`.

    submitit gives every ``SlurmJob`` one shared watcher, a class attribute, and creates the jobs of an array as
    ``SlurmJob`` itself (not through the executor's job class), so the watcher is swapped on the class, for the
    duration of the block only: the launch submits and waits for its jobs inside it.
    """
    from submitit.slurm.slurm import SlurmJob

    saved = SlurmJob.watcher
    watcher = squeue_fallback_watcher_class()(delay_s=saved._delay_s)
    SlurmJob.watcher = watcher
    try:
        yield watcher
    finally:
        SlurmJob.watcher = saved


# -- what the jobs need: the planner's peak memory and time against the launcher profile ---------------------------

# GPU memory in GiB (as nvidia-smi reports the usable memory) of the GPUs a profile can name with hydra.launcher.gpu
# instead of giving hydra.launcher.gpu_mem_gb.
KNOWN_GPUS_GIB = {"h100": 79.6, "h100-80gb": 79.6, "h100-94gb": 93.1, "h200": 139.8, "a100": 79.1, "a100-80gb": 79.1,
                  "a100-40gb": 39.4, "l40s": 44.4, "a6000": 47.5, "v100": 31.7, "v100-16gb": 15.8, "a10": 22.0,
                  "rtx4090": 23.6}
PLAN_LIMIT_KEYS = ("gpu_mem_gb", "gpu")


def gpu_memory_gib(params: Mapping) -> float | None:
    """The GPU memory the profile promises each job's device: ``gpu_mem_gb`` (GiB), else the known size of ``gpu``
    (:data:`KNOWN_GPUS_GIB`); None when the profile says neither (no memory check)."""
    if params.get("gpu_mem_gb") is not None:
        return float(params["gpu_mem_gb"])
    gpu = params.get("gpu")
    if gpu is None:
        return None
    key = str(gpu).lower()
    if key not in KNOWN_GPUS_GIB:
        raise UserError(f"hydra.launcher.gpu={gpu} is not a GPU this launcher knows; allowed: "
                        f"{', '.join(KNOWN_GPUS_GIB)}; or give hydra.launcher.gpu_mem_gb=<GiB> instead")
    return KNOWN_GPUS_GIB[key]


def check_plans(plans: list, params: Mapping) -> None:
    """Raise :class:`UserError` (one line) when a job's planned peak per device exceeds the GPU memory of the profile,
    or its planned time exceeds ``timeout_min`` x (1 + ``max_num_timeout``) (each requeue resumes from the job's
    training checkpoint). ``plans`` are (overrides, :class:`rewarduq_exp.runner.plan.Plan`) of the jobs to submit."""
    from rewarduq_exp.runner.plan import human_bytes, human_seconds

    if not plans:
        return
    gib = gpu_memory_gib(params)
    if gib is not None and int(params.get("gpus_per_node") or 0) > 0:
        overrides, plan = max(plans, key=lambda item: item[1].peak)
        if plan.peak > gib * 2**30:
            other = plan.without_checkpointing
            hint = (f"; with activation checkpointing switched {'off' if plan.checkpointing else 'on'} it plans "
                    f"{human_bytes(other)} (method.gradient_checkpointing)" if other is not None and other < gib * 2**30
                    else "; use a smaller model, batch or max_length, or a larger GPU")
            raise UserError(f"job {' '.join(overrides) or '(defaults)'} plans a peak of {human_bytes(plan.peak)} per "
                            f"device ({plan.method} on {plan.model}, {plan.peak_phase}), more than the "
                            f"{gib:g} GiB of the profile's GPU{hint}; see it with plan=true, or submit anyway with "
                            "plan.force=true")
    timeout_min = params.get("timeout_min")
    if timeout_min is not None:
        runs = 1 + int(params.get("max_num_timeout") or 0)
        devices = max(1, int(params.get("gpus_per_node") or 1) * int(params.get("nodes") or 1))
        budget = float(timeout_min) * 60 * runs
        overrides, plan = max(plans, key=lambda item: item[1].seconds)
        seconds = plan.seconds / devices
        if seconds > budget:
            raise UserError(f"job {' '.join(overrides) or '(defaults)'} plans {human_seconds(seconds)} at "
                            f"{plan.tflops:g} TFLOPS per device x {devices} ({plan.method} on {plan.model}), more than "
                            f"hydra.launcher.timeout_min={timeout_min} x {runs} runs (1 + max_num_timeout requeues) "
                            f"= {human_seconds(budget)}; raise timeout_min or max_num_timeout, set plan.tflops to "
                            "your GPU's throughput, or submit anyway with plan.force=true")
