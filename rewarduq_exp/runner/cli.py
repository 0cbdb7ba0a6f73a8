"""Entry-point plumbing shared by ``train.py``, ``evaluate.py`` and ``downstream.py``.

* Config-group names given on the command line are checked before Hydra starts, so an unknown
  ``method=``/``model=``/``dataset=`` gets one line naming the allowed values instead of Hydra's multi-line report.
* ``run_name`` names a multirun job folder after its overrides plus a short hash (stable across launches, so a
  relaunched sweep finds its finished runs); ``unique_run_dir`` creates a single run's folder, exclusively.
* An output folder that cannot be made or written (a name over the filesystem's 255 bytes, ``/proc/x``, a file in
  the way, no permission) is one line before Hydra tries: given on the command line (:func:`output_folder_problem`),
  resolved by Hydra (:class:`CheckOutputFolder`) or made for a single run (:func:`unique_run_dir`).
* ``guarded`` turns a :class:`UserError` into ``error: <message>`` and exit status 2 (single runs); inside a sweep
  the failure is recorded in the run folder and the sweep goes on.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.errors import UserError, first_line, one_line
from rewarduq_exp.data.registry import CONF_DIR, available

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
    from rewarduq_exp.runs.run_identity import config_hash

    task = OmegaConf.masked_copy(_root_, [k for k in _root_ if k != "hydra"])
    return f"{readable}-{config_hash(task)[:10]}"


# The single runs' folders this process created (unique_run_dir): the ones a run refused before it started may remove.
CREATED_RUN_FOLDERS: set[str] = set()


def remove_refused_run_folder(folder) -> None:
    """Remove a single run's folder that this process created for a run whose settings were refused before anything
    was trained (the one line on stderr says why): a ``failed`` folder with nothing of a run in it would be the newest
    "run" whoever lists the runs finds. A folder this process did not create (an existing ``hydra.run.dir``, a resumed
    run's) is left as it is; a sweep records the refusal in the job's folder instead."""
    path = os.path.abspath(folder)
    if path in CREATED_RUN_FOLDERS:
        shutil.rmtree(path, ignore_errors=True)
        CREATED_RUN_FOLDERS.discard(path)


def unique_run_dir(base: str, *, _root_=None) -> str:
    """``${unique_run_dir:<base>}``: a single run's folder, ``<base>-<config hash>``, created here with an exclusive
    ``mkdir`` (``-2``, ``-3``, ... when that name is taken), so two runs started in the same second, on one machine
    or on two nodes of a shared filesystem, never share a folder. Hydra resolves ``hydra.run.dir`` once per run.
    The one exception: an interrupted run of the very same config that saved a checkpoint is resumed in its own
    folder (:func:`interrupted_run_with_checkpoint`; ``force=true`` starts a new one).

    A folder that cannot be created (a read-only ``paths.output_root``) is one line and exit 2, before Hydra tries.
    """
    from rewarduq_exp.runs.run_identity import config_hash

    if _root_ is not None and str(OmegaConf.select(_root_, "hydra.mode", default="")).endswith("MULTIRUN"):
        return base  # multirun jobs use hydra.sweep.dir / subdir; nothing to create
    stem, chash = base, None
    if _root_ is not None:
        try:
            chash = config_hash(OmegaConf.masked_copy(_root_, [k for k in _root_ if k != "hydra"]))
            stem = f"{base}-{chash[:8]}"
        except Exception:  # noqa: BLE001 (an incomplete config: the run fails validation in its folder next)
            pass
    parent = Path(stem).parent
    problem = writable_folder_problem(stem)   # before anything looks into the parent: a name too long, a file
    if problem:
        fail(f"cannot create the run folder {shown_path(stem)}: {problem}; paths.output_root must be a folder you can "
             "write (set paths.output_root=<folder> or hydra.run.dir=<folder>)")
    if chash is not None and not OmegaConf.select(_root_, "force", default=False):
        if (resumable := interrupted_run_with_checkpoint(parent, chash)) is not None:
            return str(resumable)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 10_000):
            path = stem if n == 1 else f"{stem}-{n}"
            try:
                os.mkdir(path, 0o777)
                CREATED_RUN_FOLDERS.add(os.path.abspath(path))
                return path
            except FileExistsError:
                continue
    except OSError as err:
        fail(f"cannot create the run folder {stem} ({err.strerror or err}); paths.output_root must be a folder you "
             "can write (set paths.output_root=<folder> or hydra.run.dir=<folder>)")
    fail(f"cannot create the run folder {stem}: 10000 folders of that name exist")


def interrupted_run_with_checkpoint(parent: Path, chash: str) -> Path | None:
    """The newest folder in ``parent`` of an unfinished run of this very config whose process is gone (killed,
    preempted, crashed) and that saved a training checkpoint: the same command, launched again, resumes there
    instead of starting over in a new folder. ``force=true`` starts a new run."""
    from rewarduq_exp.core.training_checkpoint import CHECKPOINT_DIR
    from rewarduq_exp.runs.run_identity import read_status
    from rewarduq_exp.runs.run_owner import INTERRUPTED, effective_state

    candidates = []
    for folder in [*parent.glob(f"*-{chash[:8]}"), *parent.glob(f"*-{chash[:8]}-[0-9]*")]:
        status = read_status(folder)
        if (status.get("config_hash") == chash and effective_state(status) in (INTERRUPTED, "failed")
                and any((folder / CHECKPOINT_DIR).glob("*.safetensors"))):
            candidates.append(folder)
    if not candidates:
        return None
    folder = max(candidates, key=lambda f: f.stat().st_mtime)
    log.info("resuming the unfinished run in %s (force=true starts a new one instead)", folder)
    return folder


def shown_path(path: str | os.PathLike, longest: int = 80) -> str:
    """``path`` for a one-line message: a name longer than ``longest`` characters cut, with its length."""
    parts = [part if len(part) <= longest else f"{part[:24]}...({len(part)} characters)" for part in Path(path).parts]
    return str(Path(*parts)) if parts else str(path)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long (ENAMETOOLONG), a loop of links: nothing there to use
        return False


def writable_folder_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be created or written as a folder, else None: a name in it longer than its filesystem
    allows (NAME_MAX, 255 bytes on most), the whole path longer than PATH_MAX, its nearest existing ancestor a file
    or not writable, or a folder the filesystem will not make there (``/proc/x``; found by making the missing
    folders and removing them again). Nothing is left behind."""
    path = Path(path).absolute()
    existing = next((p for p in (path, *path.parents) if _exists(p)), None)
    if existing is None:
        return None
    try:
        name_max, path_max = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    too_long = next((part for part in path.parts if len(os.fsencode(part)) > name_max), None)
    if too_long is not None:
        return (f"the name {shown_path(too_long)} is {len(os.fsencode(too_long))} bytes long, more than the "
                f"{name_max} a file name may have")
    if len(os.fsencode(str(path))) >= path_max:
        return f"the path is {len(os.fsencode(str(path)))} bytes long, more than the {path_max - 1} a path may have"
    if not existing.is_dir():
        return f"{shown_path(existing)} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{shown_path(existing)} is not writable"
    if existing == path:
        return None
    missing = [p for p in (path, *path.parents) if p != existing and existing in p.parents]
    try:
        path.mkdir(parents=True)
        problem = None
    except FileExistsError:  # made by someone else meanwhile: usable, and not ours to remove
        return None
    except OSError as err:
        problem = f"{shown_path(path)} cannot be created ({err.strerror or type(err).__name__})"
    for folder in missing:  # deepest first: the empty folders this call made
        if _exists(folder):
            try:
                folder.rmdir()
            except OSError:
                break
    return problem


class CheckOutputFolder(Callback):
    """A Hydra callback (``hydra.callbacks`` in conf/train.yaml): a run or sweep folder that cannot be written is one
    line and exit 2 before Hydra creates it (Hydra's own attempt ends in a traceback). The default single-run folder
    is checked by :func:`unique_run_dir`, which creates it."""

    def on_run_start(self, config, **kwargs) -> None:
        raw = OmegaConf.to_container(config.hydra.run, resolve=False).get("dir", "")
        if not str(raw).startswith("${unique_run_dir:"):
            self._check(config.hydra.run.dir, "hydra.run.dir")
            if not os.path.lexists(str(config.hydra.run.dir)):   # Hydra creates it next: a refused run removes it
                CREATED_RUN_FOLDERS.add(os.path.abspath(str(config.hydra.run.dir)))

    def on_multirun_start(self, config, **kwargs) -> None:
        self._check(config.hydra.sweep.dir, "hydra.sweep.dir")

    @staticmethod
    def _check(folder, key: str) -> None:
        problem = writable_folder_problem(str(folder))
        if problem:
            fail(f"cannot write the run folder {shown_path(folder)} ({key}): {problem}; set paths.output_root=<a "
                 f"folder you can write> (or {key}=...)")


def run_identity(name: str):
    """``${run_identity:<name>}``: a value owned by :mod:`rewarduq_exp.runs.run_identity` (e.g. the keys a multirun
    folder name leaves out), so the config does not repeat what the code defines."""
    from rewarduq_exp.runs import run_identity as ident

    values = {"override_dirname_excluded": ident.override_dirname_excluded}
    if name not in values:
        raise ValueError(f"run_identity:{name} is unknown; allowed: {', '.join(values)}")
    return values[name]()


def register_resolvers() -> None:
    """Resolvers that conf/train.yaml uses; every process that composes or resolves it (train.py, the launchers'
    jobs, tests) calls this first."""
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", run_name)
    if not OmegaConf.has_resolver("unique_run_dir"):
        OmegaConf.register_new_resolver("unique_run_dir", unique_run_dir)
    if not OmegaConf.has_resolver("run_identity"):
        OmegaConf.register_new_resolver("run_identity", run_identity)


INTERVAL = ("interval(...) is sampled by optimising sweepers, it is not a grid; the basic sweeper runs lists (a,b), "
            "choice(...), range(...) and glob(...)")


def sweep_strings(override, conf_dir: Path = CONF_DIR) -> list[str]:
    """The values of a config group's sweep override as the strings Hydra's sweeper puts after ``key=``;
    ``glob(...)`` over the group's options in ``conf_dir`` (Hydra's own expansion needs its config loader). A
    :class:`UserError` for an ``interval(...)`` and for a glob that matches no option."""
    from hydra.core.override_parser.types import Glob

    value = override.value()
    if not override.is_discrete_sweep():
        raise UserError(f"{override.input_line} is invalid: {INTERVAL}")
    if isinstance(value, Glob):
        options = available(override.key_or_group, conf_dir)
        if not (chosen := value.filter(options)):
            raise UserError(f"{override.input_line} matches no {override.key_or_group}; allowed: {', '.join(options)}")
        return chosen
    return list(override.sweep_string_iterator())


def _choices(arg: str, groups=GROUPS) -> tuple[str, list[str]] | None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_override(arg)
    except Exception:
        return None  # not ours to judge: Hydra reports malformed overrides itself
    if override.is_delete() or override.key_or_group not in groups or override.package:
        return None
    if override.is_sweep_override():
        return override.key_or_group, sweep_strings(override)
    value = override.value()
    return (override.key_or_group, [str(value)]) if isinstance(value, str) else None


def extra_config_dirs(args: list[str]) -> list[Path]:
    """The folders given with Hydra's ``--config-dir`` / ``-cd``: the user's own configs, searched besides ours."""
    found = []
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            found.append(Path(args[i + 1]))
        elif arg.startswith("--config-dir="):
            found.append(Path(arg.split("=", 1)[1]))
    return found


# Hydra's modes: at most one per command (Hydra itself stops with a ValueError traceback).
MODE_FLAGS = {"-m": "--multirun", "--multirun": "--multirun", "-c": "--cfg", "--cfg": "--cfg", "--run": "--run",
              "-i": "--info", "--info": "--info", "-sc": "--shell-completion",
              "--shell-completion": "--shell-completion"}


def check_mode_flags(args: list[str]) -> None:
    """One line when the command line names two of Hydra's modes, e.g. ``-m`` with ``--cfg job`` (a sweep's job
    config is printed by dropping ``-m`` and giving one value of each swept setting)."""
    modes = list(dict.fromkeys(MODE_FLAGS[a.split("=")[0]] for a in args if a.split("=")[0] in MODE_FLAGS))
    if len(modes) > 1:
        fail(f"{' and '.join(modes)} cannot be combined: give one of them (to see a sweep's config, drop -m and "
             "give one value of each swept setting with --cfg job)")


def check_group_choices(args: list[str], conf_dir: Path = CONF_DIR, groups=GROUPS) -> None:
    """Exit with one line if a command-line override names a config that does not exist (in our configs or in a
    ``--config-dir`` of the user's)."""
    check_mode_flags(args)
    extra = extra_config_dirs(args)
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            parsed = _choices(arg, groups)
        except UserError as err:
            fail(str(err))
        if parsed is None:
            continue
        group, values = parsed
        allowed = sorted({*available(group, conf_dir), *(name for d in extra for name in available(group, d))})
        for value in values:
            if value not in allowed:
                fail(f"unknown {group} '{value}'; allowed: {', '.join(allowed)}")


def check_setting_keys(args: list[str], config_name: str, conf_dir: Path = CONF_DIR) -> None:
    """Exit with one line (status 2) if a ``key=value`` override names a setting the config does not have, gives a
    setting a value of the wrong kind (:func:`bad_setting_value`) or cannot be merged into the config."""
    try:
        problem = (malformed_override(args) or unknown_setting(args, config_name, conf_dir)
                   or bad_setting_value(args, config_name, conf_dir) or merge_problem(args, config_name, conf_dir)
                   or output_folder_problem(args) or device_problem(args))
    except UserError as err:  # a group's sweep that gives no value (sweep_strings)
        problem = str(err)
    if problem:
        fail(problem)


def device_problem(args: list[str]) -> str | None:
    """The one-line message for a ``device=`` (or a sweep of them) that is not auto, cpu, cuda or cuda:N, before any
    run folder exists (a run refused at start-up would leave a ``failed`` folder behind)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rewarduq_exp.core.checks import device_problem as form_problem

    parser = OverridesParser.create()
    for arg in args:
        if not arg.startswith("device="):
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:  # noqa: BLE001 (malformed_override reports it)
            continue
        values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        for value in values:
            if problem := form_problem(value):
                return problem
    return None


def output_folder_problem(args: list[str]) -> str | None:
    """The one-line message when the output folder given on the command line cannot be made or written
    (:func:`writable_folder_problem`): ``hydra.sweep.dir`` of a multirun (``-m``), ``hydra.run.dir`` of a single
    run, else ``paths.output_root``. Hydra's own attempt ends in a traceback. A value that interpolates (``${...}``)
    is checked once resolved (:class:`CheckOutputFolder`, :func:`unique_run_dir`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    given = {}
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:  # noqa: BLE001 (malformed_override reports it)
            continue
        value = None if override.is_sweep_override() or override.is_delete() else override.value()
        if isinstance(value, str) and value and "${" not in value:
            given[override.key_or_group] = value
    multirun = any(a in ("-m", "--multirun") for a in args)
    key = next((k for k in ("hydra.sweep.dir" if multirun else "hydra.run.dir", "paths.output_root") if k in given),
               None)
    problem = writable_folder_problem(given[key]) if key else None
    return f"{key}={shown_path(given[key])} cannot be used: {problem}" if problem else None


def _overrides(args: list[str], conf_dir: Path):
    """(group choices given: {group: [options]}, [(key, override, text after ``=``)] of the plain ``key=value``
    settings), skipping ``+key=`` / ``++key=`` / ``~key`` (adding or deleting on purpose), ``hydra.*`` (Hydra's)
    and malformed overrides (:func:`malformed_override` reports those)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    choices: dict[str, list[str]] = {}
    settings = []
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:
            continue
        name = override.key_or_group
        if override.package or name == "hydra" or name.startswith(("hydra.", "hydra/")):
            continue
        if "/" in name or (conf_dir / name).is_dir():  # a config group choice
            values = sweep_strings(override, conf_dir) if override.is_sweep_override() else [override.value()]
            choices[name] = [str(v) for v in values if isinstance(v, str)]
        elif not (override.is_add() or override.is_force_add() or override.is_delete()):
            settings.append((name, override, arg.split("=", 1)[1]))
    return choices, settings


def _configs_of(key: str, choices: dict, config_name: str, conf_dir: Path):
    """(chosen option of the key's group or None, composed config) for every option given for the group the key
    lives in (``method=ens_mlp,bay_lin method.num_heads=3`` checks both)."""
    top = key.split(".", 1)[0]
    for value in choices.get(top) or [None]:
        groups = [f"{g}={(value if g == top else vs[0])}" for g, vs in choices.items() if vs]
        yield value, _compose(config_name, tuple(groups), conf_dir)


def malformed_override(args: list[str]) -> str | None:
    """The one-line message for the first argument that is not an override Hydra can parse (Hydra's own report
    is three lines and exit status 1)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            parser.parse_override(arg)
        except Exception as err:  # noqa: BLE001 (Hydra's parse errors have no common public type)
            return (f"{arg} is not a valid override ({first_line(err)}); see "
                    "https://hydra.cc/docs/advanced/override_grammar/basic/ (quote values with spaces or brackets)")
    return None


def unknown_setting(args: list[str], config_name: str, conf_dir: Path = CONF_DIR) -> str | None:
    """The one-line message for the first ``key=value`` override that names no setting of the config, or None.

    Hydra reports ``method.num_head=3`` in five lines ("Key 'num_head' is not in struct ...") with exit status 1;
    a typo is bad input like any other, so it gets one line naming the key, the config it is not in and the allowed
    keys, and exit 2. ``+key=`` / ``++key=`` / ``~key`` (adding or deleting on purpose) and ``hydra.*`` are Hydra's.
    The config is composed once per choice of the group the key lives in (``method=ens_mlp,bay_lin`` checks both).
    """
    choices, settings = _overrides(args, conf_dir)
    for key, _, _ in settings:  # nothing to check: no composition cost for plain commands
        top = key.split(".", 1)[0]
        for value, cfg in _configs_of(key, choices, config_name, conf_dir):
            problem = _missing_key(cfg, key)
            if problem:
                chosen = value or (OmegaConf.select(cfg, f"hydra.runtime.choices.{top}") if "." in key else None)
                where = f" of {top} '{chosen}'" if chosen else ""
                return f"{key} is not a setting{where}; allowed: {problem}; to add a new key on purpose, use +{key}=..."
    return None


# ``plan`` is both a switch (plan=true: print the plan, run nothing) and a group of the planner's settings.
PLAN_SWITCH = "plan"


def bad_setting_value(args: list[str], config_name: str, conf_dir: Path = CONF_DIR) -> str | None:
    """The one-line message for the first ``key=value`` override whose value is not of its setting's kind (true or
    false for a boolean, a number for a number, a seed in [0, 2**32 - 1]: :func:`check_like_default`), or None.

    Checked against the config's own default before Hydra starts, so no run folder is made for a run that cannot
    start; every value of a sweep (``seed=1,2,abc``) is checked."""
    from hydra.core.override_parser.types import Glob

    from rewarduq_exp.core.checks import check_like_default

    choices, settings = _overrides(args, conf_dir)
    for key, override, text in settings:
        sweep = override.is_sweep_override()
        if isinstance(override.value(), Glob):
            return (f"{key}={text} is invalid: glob(...) picks among the options of a config group, and {key} is a "
                    "setting; give a list (a,b), choice(...) or range(...)")
        if sweep and not override.is_discrete_sweep():
            return f"{key}={text} is invalid: {INTERVAL}"
        values = list(override.sweep_iterator()) if sweep else [override.value()]
        for _, cfg in _configs_of(key, choices, config_name, conf_dir):
            default = _default(cfg, key)
            if key == PLAN_SWITCH and isinstance(default, DictConfig):
                default = False  # plan=true|false switches the planner; plan.<key>=... sets its options
            bound, real_valued, takes_text = _method_setting_kind(cfg, key)
            for value in values:
                try:
                    check_like_default(key, value, default, shown=None if sweep else text, bound=bound,
                                       real_valued=real_valued, takes_text=takes_text)
                except UserError as err:
                    return str(err)
    return None


def _method_setting_kind(cfg, key: str):
    """(bound, real-valued, takes a word) of ``method.<name>`` as the composed config's method declares it on its
    settings (None, None, False for any other key, or a method outside the table: the table's rules then)."""
    if cfg is None or not key.startswith("method.") or key.count(".") != 1:
        return None, None, False
    from rewarduq_exp.methods.registry import settings_class_of

    settings = settings_class_of(cfg.get("method"))
    if settings is None:
        return None, None, False
    return settings.bounds().get(key), key in settings.real_valued(), key in settings.takes_text()


def _default(cfg, key: str):
    """The config's value of ``key`` (a DictConfig for a group of settings), or None when it has none or it cannot
    be resolved here."""
    if cfg is None:
        return None
    try:
        return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    except Exception:  # noqa: BLE001 (an interpolation that resolves only in a run; its own check judges it)
        return None


def merge_problem(args: list[str], config_name: str, conf_dir: Path = CONF_DIR) -> str | None:
    """The one-line message when Hydra cannot merge a ``key=value`` override into the config (a value of the wrong
    type for a typed setting, e.g. Hydra's own ``hydra.job.chdir=maybe``), or None. Hydra reports it in six lines
    with exit status 1. A sweep is checked value by value instead (:func:`bad_setting_value`)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ValidationError

    overrides = [a for a in args if not a.startswith("-") and "=" in a]
    if extra_config_dirs(args) or not any(a.lstrip("+~").startswith("hydra.") for a in overrides):
        # Only Hydra's own settings are typed (our configs are plain YAML, checked by bad_setting_value), so only
        # they cost this composition; configs of the user's (--config-dir) this check would not see
        return None
    parser = OverridesParser.create()
    if any(parser.parse_override(a).is_sweep_override() for a in overrides):
        return None
    register_resolvers()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            compose(config_name, overrides=overrides, return_hydra_config=True)
    except ConfigCompositionException as err:
        cause = err.__cause__
        if isinstance(cause, ValidationError):
            key = getattr(cause, "full_key", None)
            given = next((a for a in overrides if key and a.split("=", 1)[0].lstrip("+") == key), key)
            return f"{given} is invalid: {first_line(getattr(cause, 'msg', cause))}"
    except Exception:  # noqa: BLE001 (anything else: Hydra reports it as it always has)
        return None
    finally:
        GlobalHydra.instance().clear()
    return None


@functools.lru_cache(maxsize=64)
def _compose(config_name: str, overrides: tuple, conf_dir: Path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_resolvers()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            return compose(config_name, overrides=list(overrides), return_hydra_config=True)
    except Exception:
        return None  # e.g. a bad group value: reported by check_group_choices or by Hydra itself
    finally:
        GlobalHydra.instance().clear()


def _missing_key(cfg, key: str) -> str | None:
    """None if ``key`` exists in ``cfg`` (or cannot be judged); else the allowed keys at the first missing level."""
    from omegaconf import DictConfig

    if cfg is None:
        return None
    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig):
            return None  # inside a list or a value: not ours to judge
        if part not in node.keys():  # (``in`` is False for a mandatory ``???`` value that exists)
            return ", ".join(k for k in node.keys() if k not in ("_target_", "hydra")) or "(none)"
        node = node._get_node(part)
        if not isinstance(node, DictConfig):
            node = None if node is None else node._value()
    return None


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
