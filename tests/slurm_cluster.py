"""A real Slurm cluster for the tests marked ``slurm`` (``make test-slurm``), and helpers to ask it about jobs.

A test module uses the session fixture ``slurm_cluster`` by importing its function (pytest finds fixtures among a
module's names): ``from slurm_cluster import slurm_cluster_fixture  # noqa: F401``.

The fixture uses the cluster that ``SLURM_CONF`` names when ``sinfo`` answers there; otherwise it starts the local
single-node cluster of ``scripts/local_slurm.sh`` (which installs Slurm with apt-get when it is missing: root only)
and stops it at the end of the session, unless it was already up. Without either, the tests are skipped with the
reason. ``SLURM_CONF`` is exported to the session's environment, so that sbatch, squeue and the submitit launcher, in
this process or in the processes it starts, all see the same cluster.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "local_slurm.sh"
QUERY_TIMEOUT_S = 30
# Installing Slurm and MariaDB on a fresh machine (apt-get) takes minutes; starting an installed cluster, seconds.
START_TIMEOUT_S = 1200


@dataclass(frozen=True)
class Cluster:
    conf: str  # the SLURM_CONF in use
    accounting: bool  # sacct answers (slurmdbd)
    cpus: int  # the CPUs of the largest node of the default partition


def slurm(*args: str, check: bool = True, timeout: float = QUERY_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a Slurm command (``slurm("squeue", "-h")``); its output as text."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def sbatch(*args: str) -> str:
    """Submit with ``sbatch --parsable <args>``; the job id."""
    return slurm("sbatch", "--parsable", *args).stdout.strip().split(";")[0]


def squeue_states(job_id: str) -> list[str]:
    """The states squeue lists for a job (one per array task); [] once the cluster has forgotten the job."""
    proc = slurm("squeue", "--noheader", "-r", "--format=%T", f"--jobs={job_id}", check=False)
    return proc.stdout.split() if proc.returncode == 0 else []


def sacct_states(job_id: str) -> dict[str, str]:
    """``{job or array task id: state}`` from sacct, without the job steps (``.batch``, ``.0``)."""
    out = slurm("sacct", "--noheader", "--parsable2", "-X", "--format=JobID,State", f"--jobs={job_id}").stdout
    return dict(line.split("|", 1) for line in out.splitlines() if line.strip())


def wait_for(predicate, timeout: float, interval: float = 0.5, what: str = "the condition"):
    """Poll ``predicate()`` until it returns something true (returned), or fail after ``timeout`` seconds; a
    predicate that raises FileNotFoundError counts as not yet true."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except FileNotFoundError:
            # A glob over folders a run is still creating or renaming can list a folder and then miss it.
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def job_done(job_id: str) -> bool:
    """The job (all its array tasks) has left the queue or reached an end state."""
    return all(s in {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED"}
               for s in squeue_states(job_id))


def _answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        return slurm("sinfo", "--noheader", "--format=%T", check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _describe(conf: str) -> Cluster:
    accounting = slurm("sacct", "--noheader", "-X", "--starttime=now", check=False).returncode == 0
    cpus = [int(c.rstrip("+")) for c in slurm("sinfo", "--noheader", "--format=%c").stdout.split()]
    return Cluster(conf=conf, accounting=accounting, cpus=max(cpus, default=0))


@pytest.fixture(scope="session", name="slurm_cluster")
def slurm_cluster_fixture():
    """The :class:`Cluster` the session's Slurm commands go to (see the module's docstring)."""
    if os.environ.get("SLURM_CONF") and _answers():
        yield _describe(os.environ["SLURM_CONF"])
        return
    if os.geteuid() != 0:
        if shutil.which("sbatch") is None:
            pytest.skip("no Slurm: sbatch not found and cannot install it (needs root and apt-get); run "
                        "scripts/local_slurm.sh start")
        pytest.skip("no Slurm cluster answers (SLURM_CONF unset or down) and starting one needs root: sudo "
                    "scripts/local_slurm.sh start, then eval \"$(scripts/local_slurm.sh env)\"")
    proc = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=START_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"scripts/local_slurm.sh start failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    started = "already up" not in proc.stdout
    conf = subprocess.run([str(SCRIPT), "env"], capture_output=True, text=True, check=True).stdout
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf.strip().split("=", 1)[1]
    try:
        yield _describe(os.environ["SLURM_CONF"])
    finally:
        if started:
            subprocess.run([str(SCRIPT), "stop"], capture_output=True, text=True, timeout=300)
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
