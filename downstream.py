"""Downstream uses of a trained reward model's uncertainty, against a gold reward (the synthetic world's, or the
human ratings of the VADER sentences): ``python downstream.py task=best_of_n run=<run or sweep>`` or
``task=active_learning`` or ``task=rl`` (see docs/downstream.md)."""

import sys

from rewarduq_exp.core import job_signals

if __name__ == "__main__":
    job_signals.guard_startup()   # Ctrl-C while the imports below run: one line, not a traceback

import hydra  # noqa: E402

from rewarduq_exp.core.errors import UserError  # noqa: E402
from rewarduq_exp.runner.cli import check_group_choices, check_setting_keys, fail, register_resolvers  # noqa: E402

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="downstream")
def main(cfg):
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from rewarduq_exp.downstream.tasks import run_task  # heavy imports after Hydra has parsed the command line

    out = Path(HydraConfig.get().runtime.output_dir)
    try:
        run_task(cfg, out)
    except UserError as err:
        fail(str(err), err.exit_code)
    except job_signals.TrainingInterrupted as err:
        # the task writes its results at the end (each file atomically): what is there is complete, the rest missing
        err.message = err.message or f"the {cfg.task.name} task stopped before it finished; {out} lacks its results"
        raise


def cli() -> None:
    check_group_choices(sys.argv[1:], groups=("task",))
    check_setting_keys(sys.argv[1:], "downstream")
    main()


if __name__ == "__main__":
    job_signals.entry_point(cli, "stopped before the task started; nothing was written")
