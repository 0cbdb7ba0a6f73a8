"""Evaluate a trained run on a dataset, or re-score a predictions file: ``python evaluate.py ...`` (see README)."""

import sys

import hydra

from rewarduq_exp.cli import check_group_choices, register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg):
    from rewarduq_exp.evaluate_run import evaluate

    evaluate(cfg)


if __name__ == "__main__":
    check_group_choices(sys.argv[1:], groups=("metric",))
    main()
