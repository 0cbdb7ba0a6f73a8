"""What became of the jobs a multirun launched from this process: completed, skipped, failed.

A failed run never stops a sweep (it is recorded in its folder and the other jobs go on), so without a summary a
sweep with failures would end like a good one. Our launchers (``hydra_plugins/rewarduq_launchers``: in-process,
local, Slurm) record every job here after each batch; ``train.py`` prints the summary at the end of the multirun and
exits with status 1 when any job failed, so scripts and CI notice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rewarduq_exp.runs.run_identity import is_completed, read_status
from rewarduq_exp.runs.run_owner import INTERRUPTED, RUNNING, describe_owner, effective_state

SKIPPED = "skipped"
COMPLETED = "completed"
FAILED = "failed"
BUSY = "running elsewhere"


@dataclass
class JobOutcome:
    folder: Path
    state: str   # skipped | completed | failed | running elsewhere
    error: str = ""
    where: Path | None = None  # skipped: the completed run of the same config, when it is another folder


_OUTCOMES: list[JobOutcome] = []


def record(folder: Path, skipped: bool = False, where: Path | None = None, launch: str | None = None,
           no_result: str | None = None) -> JobOutcome:
    """Record one job of this multirun from its run folder (after it ran, or because it was skipped: ``where`` is
    the completed run it was skipped for, when that is another folder). ``launch``: the id of the launch whose jobs
    have just ended (a folder it left ``running`` is interrupted). ``no_result``: what the launcher knows of a job
    that ended without a result (the scheduler's reason, its log), for a run whose folder does not say more."""
    folder = Path(folder)
    status = read_status(folder)
    state = effective_state(status, ended_launch=launch)
    if skipped:
        outcome = JobOutcome(folder, SKIPPED, where=where)
    elif is_completed(folder, status=status):
        outcome = JobOutcome(folder, COMPLETED)
    elif state == FAILED:
        outcome = JobOutcome(folder, FAILED, str(status.get("error") or "failed (no error recorded)"))
    elif state == RUNNING:  # another live process holds the folder: this job did not run there
        outcome = JobOutcome(folder, BUSY, f"in use by {describe_owner(status)}")
    elif state == INTERRUPTED and status.get("state") == INTERRUPTED:   # stopped by a signal, and said so
        outcome = JobOutcome(folder, FAILED, str(status.get("error") or "interrupted; launch again to resume"))
    elif state == INTERRUPTED:
        outcome = JobOutcome(folder, FAILED, f"interrupted: its process ({describe_owner(status)}) is "
                                             "gone; launch again to rerun it")
    else:  # killed, out of memory, lost node before it wrote a status
        state = status.get("state", "no status.json")
        outcome = JobOutcome(folder, FAILED, no_result or f"no result (state: {state}); the job died, see its log")
    _OUTCOMES.append(outcome)
    return outcome


def job_logs(folder: Path) -> list[Path]:
    """Where a run's log is: its ``train.log`` and, for a Slurm or submitit job, the job's own output and error files
    (``<sweep>/.submitit/<job>/<job>_<task>_log.{out,err}``: what the run printed before and after its log opened,
    the traceback of a crash, the scheduler's messages)."""
    logs = [folder / "train.log"] if (folder / "train.log").is_file() else []
    job = read_status(folder).get("slurm_job")
    if job:
        logs += sorted((folder.parent / ".submitit" / str(job)).glob("*_log.*"))
    return logs


def outcomes() -> list[JobOutcome]:
    return list(_OUTCOMES)


def clear() -> None:
    _OUTCOMES.clear()


def report() -> tuple[str, bool]:
    """(summary text, whether any job failed); empty text when this process launched no multirun jobs."""
    if not _OUTCOMES:
        return "", False
    counts = {s: sum(o.state == s for o in _OUTCOMES) for s in (COMPLETED, SKIPPED, BUSY, FAILED)}
    busy = f", {counts[BUSY]} running elsewhere (left to the process running them)" if counts[BUSY] else ""
    lines = [f"sweep: {len(_OUTCOMES)} jobs: {counts[COMPLETED]} completed, {counts[SKIPPED]} skipped (already "
             f"completed with the same config){busy}, {counts[FAILED]} failed"]
    for o in _OUTCOMES:
        if o.state == SKIPPED and o.where is not None and Path(o.where).resolve() != o.folder.resolve():
            lines.append(f"  skipped: {o.folder.name}  (completed with the same config in {o.where})")
        elif o.state in (FAILED, BUSY):
            lines.append(f"  {o.state}: {o.folder}  ({o.error.splitlines()[0] if o.error else ''})")
            if o.state == FAILED:
                lines += [f"    log: {path}" for path in job_logs(o.folder)]
    if counts[FAILED]:
        lines.append("  each failed run keeps its error (and traceback) in status.json; fix and launch the same "
                     "command again: completed runs are skipped")
    return "\n".join(lines), counts[FAILED] > 0
