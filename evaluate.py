"""Evaluate a trained run on a dataset, or re-score a predictions file: ``python evaluate.py ...``
(see docs/evaluate.md)."""

import sys

from rewarduq_exp.core import job_signals

if __name__ == "__main__":
    job_signals.guard_startup()   # Ctrl-C while the imports below run: one line, not a traceback

import hydra  # noqa: E402

from rewarduq_exp.runner.cli import check_group_choices, check_setting_keys, register_resolvers  # noqa: E402

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg):
    from rewarduq_exp.runner.evaluate_run import evaluate

    evaluate(cfg)


def _dataset_as_plain_key(args: list[str]) -> list[str]:
    # conf/dataset is a config group (train.py selects it), but here dataset=<name>[_<split>] only names what to
    # score, and <name>_<split> is not a config file; pass it on as the plain key eval_datasets.
    # dataset.<key>=<value> sets a key of the evaluated dataset's config: conf/evaluate.yaml cannot list every
    # dataset's keys, so it is added (++) under `dataset` and checked against that config once it is known.
    def plain(arg: str) -> str:
        if arg.startswith("dataset="):
            return f"eval_datasets={arg.split('=', 1)[1]}"
        if arg.startswith("dataset.") and "=" in arg:
            return f"++{arg}"
        return arg

    return [plain(a) for a in args]


def cli() -> None:
    sys.argv[1:] = _dataset_as_plain_key(sys.argv[1:])
    check_group_choices(sys.argv[1:], groups=("metric",))
    check_setting_keys(sys.argv[1:], "evaluate")
    main()


if __name__ == "__main__":
    # A signal while it scores: one line, exit 128 + the signal; the staged results are removed and the run folder
    # is as it was (rewarduq_exp/runner/evaluate_run.py).
    job_signals.entry_point(cli, "nothing of this evaluation was kept")
