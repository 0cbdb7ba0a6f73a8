"""What a run's task hands back to the one run lifecycle in ``train_run``, whatever the task (reward models and
probes, label ranking): the lifecycle writes, logs and prints it the same way for all of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunOutput:
    blocks: dict[str, dict]                                         # {evaluated dataset: metrics} -> metrics.json
    info: dict                                                      # extra fields of status.json (timings, stats)
    figures: dict[str, list[Path]] = field(default_factory=dict)    # {dataset: PNG files} for the logger
    history: list[dict] = field(default_factory=list)              # the method's training log
    summary: dict = field(default_factory=dict)                     # run-level scalars for the logger
    notes: list[str] = field(default_factory=list)                  # lines printed under the summary table
