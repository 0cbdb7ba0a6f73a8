"""Entry-point plumbing shared by ``train.py`` and ``evaluate.py``.

* Config-group names given on the command line are checked before Hydra starts, so an unknown
  ``method=``/``model=``/``dataset=`` gets one line naming the allowed values instead of Hydra's multi-line report.
* ``run_name`` names a multirun job folder after its overrides plus a short hash (stable across launches, so a
  relaunched sweep finds its finished runs).
* ``guarded`` turns a :class:`UserError` into ``error: <message>`` and exit status 2 (single runs); inside a sweep
  the failure is recorded in the run folder and the sweep goes on.
"""

from __future__ import annotations

import hashlib
import logging
import re
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rewarduq_exp.data.registry import CONF_DIR
from rewarduq_exp.errors import UserError, one_line

GROUPS = ("model", "method", "dataset", "probe", "metric", "logger", "sweep")
log = logging.getLogger("rewarduq_exp")


def run_name(override_dirname: str, *, _root_=None) -> str:
    """``<readable overrides>-<hash of the resolved run config>`` (dora-style identity).

    The hash is the ``config_hash`` a run writes into ``status.json``: a changed default (in a YAML file, not only
    on the command line) gives a new folder instead of overwriting the old results, while relaunching the same
    sweep, or extending a grid, lands on the same folders for the points that did not change.
    """
    readable = re.sub(r"[^A-Za-z0-9=.,_-]+", "_", override_dirname)[:80] or "defaults"
    if _root_ is None:
        return f"{readable}-{hashlib.sha1(override_dirname.encode()).hexdigest()[:8]}"
    from rewarduq_exp.run_folder import config_hash

    task = OmegaConf.masked_copy(_root_, [k for k in _root_ if k != "hydra"])
    return f"{readable}-{config_hash(task)[:10]}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", run_name)


def _choices(arg: str) -> tuple[str, list[str]] | None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_override(arg)
    except Exception:
        return None  # not ours to judge: Hydra reports malformed overrides itself
    if override.is_delete() or override.key_or_group not in GROUPS or override.package:
        return None
    if override.is_sweep_override():
        return override.key_or_group, list(override.sweep_string_iterator())
    value = override.value()
    return (override.key_or_group, [str(value)]) if isinstance(value, str) else None


def check_group_choices(args: list[str], conf_dir: Path = CONF_DIR, groups=GROUPS) -> None:
    """Exit with one line if a command-line override names a config that does not exist."""
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        parsed = _choices(arg)
        if parsed is None or parsed[0] not in groups:
            continue
        group, values = parsed
        allowed = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        for value in values:
            if value not in allowed:
                fail(f"unknown {group} '{value}'; allowed: {', '.join(allowed)}")


def fail(message: str, code: int = 2) -> None:
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
    sys.exit(code)


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def report_user_error(err: UserError) -> None:
    """Single run: one line on stderr and exit 2. Sweep: log it and go on (the run folder records it)."""
    if not in_multirun():
        fail(str(err), err.exit_code)
    log.error("error: %s", one_line(err))
