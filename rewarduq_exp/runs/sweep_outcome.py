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

SKIPPED = "skipped"
COMPLETED = "completed"
FAILED = "failed"


@dataclass
class JobOutcome:
    folder: Path
    state: str   # skipped | completed | failed
    error: str = ""


_OUTCOMES: list[JobOutcome] = []


def record(folder: Path, skipped: bool = False) -> JobOutcome:
    """Record one job of this multirun from its run folder (after it ran, or because it was skipped)."""
    folder = Path(folder)
    status = read_status(folder)
    if skipped:
        outcome = JobOutcome(folder, SKIPPED)
    elif is_completed(folder, status=status):
        outcome = JobOutcome(folder, COMPLETED)
    elif status.get("state") == FAILED:
        outcome = JobOutcome(folder, FAILED, str(status.get("error") or "failed (no error recorded)"))
    else:  # killed, out of memory, lost node: nothing recorded its end
        state = status.get("state", "no status.json")
        outcome = JobOutcome(folder, FAILED, f"no result (state: {state}); the job died, see its log")
    _OUTCOMES.append(outcome)
    return outcome


def outcomes() -> list[JobOutcome]:
    return list(_OUTCOMES)


def clear() -> None:
    _OUTCOMES.clear()


def report() -> tuple[str, bool]:
    """(summary text, whether any job failed); empty text when this process launched no multirun jobs."""
    if not _OUTCOMES:
        return "", False
    counts = {s: sum(o.state == s for o in _OUTCOMES) for s in (COMPLETED, SKIPPED, FAILED)}
    lines = [f"sweep: {len(_OUTCOMES)} jobs: {counts[COMPLETED]} completed, {counts[SKIPPED]} skipped (already "
             f"completed with the same config), {counts[FAILED]} failed"]
    for o in _OUTCOMES:
        if o.state == FAILED:
            lines.append(f"  failed: {o.folder}  ({o.error.splitlines()[0] if o.error else ''})")
    if counts[FAILED]:
        lines.append("  each failed run keeps its error (and traceback) in status.json; fix and launch the same "
                     "command again: completed runs are skipped")
    return "\n".join(lines), counts[FAILED] > 0
