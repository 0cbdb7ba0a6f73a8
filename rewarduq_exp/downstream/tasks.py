"""``downstream.py``'s dispatch: the task named by ``task.name``, run into the task folder."""

from __future__ import annotations

from pathlib import Path

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.inside_folder import check_writes_inside
from rewarduq_exp.core.setting_bounds import check_config_bounds

TASKS = ("best_of_n", "active_learning", "rl")
# What each task writes into its folder (a fresh one per call, unless hydra.run.dir names an existing one).
OUTPUTS = {"best_of_n": ("curves.csv", "summary.csv", "overoptimization.csv", "shortcut.csv", "shortcut_bins.csv",
                         "correlation.csv", "selection.csv", "per_prompt.csv.gz", "best_of_n.png",
                         "uncertainty_use.png", "overoptimization.png", "shortcut.png",
                         "selection_vs_loss.png", "selection_vs_gold.png"),
           "active_learning": ("curves.csv", "summary.csv", "paired.csv", "active_learning.png"),
           "rl": ("status.json", "reference_check.csv", "samples.csv.gz", "curves.csv", "summary.csv",
                  "comparisons.csv", "over_worlds.csv", "choices.csv", "rl_gold_vs_kl.png", "rl_proxy_vs_gold.png",
                  "rl_feature.png")}


def run_task(cfg, out_dir: Path) -> dict:
    name = str(cfg.task.name)
    check_config_bounds(cfg, prefixes=("task.",))   # candidates, draws, pool sizes: before any model or data
    if name in OUTPUTS:  # before any work: nothing is written through a link out of the task folder
        check_writes_inside(out_dir, files=OUTPUTS[name])
    if name == "best_of_n":
        from rewarduq_exp.downstream.best_of_n_task import best_of_n

        return best_of_n(cfg, out_dir)
    if name == "active_learning":
        from rewarduq_exp.downstream.active_learning import active_learning

        return active_learning(cfg, out_dir)
    if name == "rl":
        from rewarduq_exp.downstream.rl.task import rl

        return rl(cfg, out_dir)
    raise UserError(f"task.name={name!r} is invalid; allowed: {', '.join(TASKS)}")
