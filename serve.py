"""Serve a trained run's reward model over HTTP, with its uncertainty: ``python serve.py run=<run folder>``
(OpenRLHF's ``--remote_rm_url`` protocol and more; see docs/serving.md)."""

import sys

from rewarduq_exp.core import job_signals

if __name__ == "__main__":
    job_signals.guard_startup()   # Ctrl-C while the imports below run: one line, not a traceback

import hydra  # noqa: E402

from rewarduq_exp.core.errors import UserError  # noqa: E402
from rewarduq_exp.runner.cli import check_mode_flags, check_setting_keys, fail, register_resolvers  # noqa: E402

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="serve")
def main(cfg):
    from rewarduq_exp.serving.server import serve

    try:
        serve(cfg)
    except UserError as err:
        fail(str(err), err.exit_code)


def cli() -> None:
    check_mode_flags(sys.argv[1:])
    check_setting_keys(sys.argv[1:], "serve")
    main()


if __name__ == "__main__":
    job_signals.entry_point(cli, "stopped before the server started")
