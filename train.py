"""Train and evaluate an uncertainty-aware reward model: ``python train.py [overrides]`` (see README)."""

import os
import sys
from pathlib import Path

from rewarduq_exp.core import job_signals

if __name__ == "__main__":
    job_signals.guard_startup()   # Ctrl-C while the imports below run: one line, not a traceback

import hydra  # noqa: E402

from rewarduq_exp.core.distributed import launcher_overrides  # noqa: E402
from rewarduq_exp.core.errors import UserError  # noqa: E402
from rewarduq_exp.runner.cli import check_group_choices, check_setting_keys, fail, register_resolvers  # noqa: E402
from rewarduq_exp.runs import sweep_outcome  # noqa: E402

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg):
    from rewarduq_exp.runner.train_run import train  # heavy imports after Hydra has parsed the command line

    train(cfg)


def let_sweep_jobs_import_this_repo() -> None:
    """Submitit jobs (local processes or Slurm tasks, which inherit the environment) unpickle our launcher and import
    the package. ``python train.py`` runs the code beside it (the script's folder is first on ``sys.path``), but a
    job's interpreter starts elsewhere and would import whatever is installed, with a non-editable install an older
    copy: put this folder first on their path, so that they run the code that launched them (from a folder that holds
    only ``train.py`` and ``conf/``, the installed package, which ships the launchers)."""
    root = str(Path(__file__).resolve().parent)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])


def cli() -> None:
    let_sweep_jobs_import_this_repo()
    check_group_choices(sys.argv[1:])
    from rewarduq_exp.runner import plan

    if plan.wants_plan(sys.argv[1:]):   # what the run needs (memory, FLOPs, time), without loading anything
        check_setting_keys([a for a in sys.argv[1:] if not plan.wants_plan([a])], "train")
        try:
            sys.exit(plan.plan_command(sys.argv[1:]))
        except UserError as err:
            fail(str(err), err.exit_code)
    check_setting_keys(sys.argv[1:], "train")
    # torchrun / accelerate launch: one shared run folder (hydra.run.dir required), .hydra/ written by rank 0 only.
    extra, error = launcher_overrides(sys.argv[1:])
    if error:
        fail(error)
    sys.argv += extra
    main()
    # A multirun: say what became of every job, and fail the command when a run failed (each is recorded in its
    # folder, and the sweep went on with the others).
    summary, any_failed = sweep_outcome.report()
    if summary:
        print(summary, flush=True)
    if any_failed:
        sys.exit(1)


def interrupted_outside_a_run() -> str:
    """The one line's message for a signal that no run of this process recorded (while Hydra composes, between the
    runs of a sweep, while a launcher waits for its jobs, which record their own interruption)."""
    if any(a in ("-m", "--multirun") or a.startswith("--multirun") for a in sys.argv[1:]):
        return ("the sweep stopped; run the same command again to go on (completed runs are skipped, interrupted ones "
                "resume)")
    return "stopped before the run started; nothing was trained"


if __name__ == "__main__":
    job_signals.entry_point(cli, interrupted_outside_a_run)
