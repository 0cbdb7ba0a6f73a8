"""Evaluate a trained run on a dataset, or re-score a predictions file: ``python evaluate.py ...`` (see README)."""

import sys

import hydra

from rewarduq_exp.cli import check_group_choices, register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg):
    from rewarduq_exp.evaluate_run import evaluate

    evaluate(cfg)


def _dataset_as_plain_key(args: list[str]) -> list[str]:
    # conf/dataset is a config group (train.py selects it), but here dataset=<name>[_<split>] only names what to
    # score, and <name>_<split> is not a config file; pass it on as the plain key eval_datasets.
    return [f"eval_datasets={a.split('=', 1)[1]}" if a.startswith("dataset=") else a for a in args]


if __name__ == "__main__":
    sys.argv[1:] = _dataset_as_plain_key(sys.argv[1:])
    check_group_choices(sys.argv[1:], groups=("metric",))
    main()
