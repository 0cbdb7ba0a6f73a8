"""Downstream uses of a trained reward model's uncertainty, against a gold reward (the synthetic world's, or the
human ratings of the VADER sentences): ``python downstream.py task=best_of_n run=<run or sweep>`` or
``task=active_learning`` (see README)."""

import sys

import hydra

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.runner.cli import check_group_choices, check_setting_keys, fail, register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="downstream")
def main(cfg):
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from rewarduq_exp.downstream.tasks import run_task  # heavy imports after Hydra has parsed the command line

    try:
        run_task(cfg, Path(HydraConfig.get().runtime.output_dir))
    except UserError as err:
        fail(str(err), err.exit_code)


if __name__ == "__main__":
    check_group_choices(sys.argv[1:], groups=("task",))
    check_setting_keys(sys.argv[1:], "downstream")
    main()
