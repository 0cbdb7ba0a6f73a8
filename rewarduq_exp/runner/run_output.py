"""What a run's task hands back to the one run lifecycle in ``train_run``, whatever the task (reward models and
probes, label ranking): the lifecycle writes, logs and prints it the same way for all of them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rewarduq_exp.core.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class RunOutput:
    blocks: dict[str, dict]                                         # {evaluated dataset: metrics} -> metrics.json
    info: dict                                                      # extra fields of status.json (timings, stats)
    figures: dict[str, list[Path]] = field(default_factory=dict)    # {dataset: PNG files} for the logger
    history: list[dict] = field(default_factory=list)              # the method's training log
    summary: dict = field(default_factory=dict)                     # run-level scalars for the logger
    notes: list[str] = field(default_factory=list)                  # lines printed under the summary table
    # {dataset: figures not drawn yet}, each a function that draws them and returns their files (draw_figures)
    drawings: dict[str, list[Callable[[], list[Path]]]] = field(default_factory=dict)

    def draw_figures(self) -> list[str]:
        """Draw the figures left in ``drawings``, their files added to ``figures``; the lifecycle calls this once
        metrics.json is written and the summary printed. A drawing that fails is logged and named in the lines
        returned (``dataset: error``), and the others are still drawn: the metrics are written by then, and a figure
        is no reason to lose the run. A refused write (:class:`UserError`: a link made in the run folder) fails the
        run, as every refused write of a run does; its metrics.json stays."""
        failed = []
        for name, drawings in self.drawings.items():
            for draw in drawings:
                try:
                    self.figures.setdefault(name, []).extend(draw())
                except UserError:
                    raise
                except Exception as err:   # Ctrl-C and job signals (BaseException) still stop the run
                    log.warning("%s: figures not drawn (%s: %s); its metrics are in metrics.json", name,
                                type(err).__name__, err, exc_info=True)
                    failed.append(f"{name}: {type(err).__name__}: {err}")
        self.drawings = {}
        return failed
