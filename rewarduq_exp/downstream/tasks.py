"""``downstream.py``'s dispatch: the task named by ``task.name``, run into the task folder."""

from __future__ import annotations

from pathlib import Path

from rewarduq_exp.core.errors import UserError

TASKS = ("best_of_n", "active_learning")


def run_task(cfg, out_dir: Path) -> dict:
    name = str(cfg.task.name)
    if name == "best_of_n":
        from rewarduq_exp.downstream.best_of_n_task import best_of_n

        return best_of_n(cfg, out_dir)
    if name == "active_learning":
        from rewarduq_exp.downstream.active_learning import active_learning

        return active_learning(cfg, out_dir)
    raise UserError(f"task.name={name!r} is invalid; allowed: {', '.join(TASKS)}")
