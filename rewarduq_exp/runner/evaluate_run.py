"""What ``python evaluate.py`` does.

* ``run=<run folder> [dataset=<name>] [dataset.<key>=<value> ...]``: rebuild the saved method from the run's config
  and ``model/``, score the dataset (its config changed by the ``dataset.<key>`` options, e.g.
  ``dataset.subsets=[harmless-base]``), and add its predictions, diagrams and metrics block to that run folder
  (metrics.json is merged, not replaced), so selection and tables see the new evaluation. Everything it reads is
  checked before anything is written, and so is every place it writes: a link or a non-folder where the results go
  (``predictions/``, ``figures/<dataset>/``, ``metrics.json`` and its lock) is refused in one line, so nothing is
  ever written outside the run folder. The new predictions, diagrams and merged metrics.json are written beside the
  old ones (a hidden staging folder in the run folder) and swapped in together, under the metrics lock, only once
  every step that can fail is done (every dataset evaluated, the lock taken, metrics.json read and merged): a
  failure changes no file of the run.
* ``predictions=<file.parquet>``: re-score a predictions file (from any source) with the chosen metric config; the
  metrics and diagrams go to this evaluation's own output folder.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from rewarduq_exp.core import job_signals
from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.checks import check_integer
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.foreign_config import MACHINE_PATHS
from rewarduq_exp.core.inside_folder import check_writes_inside, make_folders, open_parent, replace_inside
from rewarduq_exp.core.saved_files import read_json_object
from rewarduq_exp.data.contract import data_kind
from rewarduq_exp.data.registry import build_loader, resolve_eval_sets, with_options
from rewarduq_exp.models.conversation_index import ConversationIndex
from rewarduq_exp.runner.cli import report_user_error
from rewarduq_exp.runner.data_loading import load_split, quiet_datasets_unless
from rewarduq_exp.runner.evaluation import diagrams, evaluate_method, evaluate_pointwise, score_predictions
from rewarduq_exp.runner.summary import summary_table
from rewarduq_exp.runner.trained_run import load_trained_method, read_run_config
from rewarduq_exp.runner.validation import (
    check_cache_dir,
    check_eval_kind,
    check_max_length,
    method_task,
    validate_metric_config,
)
from rewarduq_exp.runs.run_folder import RunFolder, write_json
from rewarduq_exp.runs.run_owner import gone_on_this_host, this_owner

log = logging.getLogger("rewarduq_exp")


def evaluate(cfg) -> dict | None:
    try:
        validate_metric_config(cfg.metric)
        if cfg.run and cfg.predictions:
            raise UserError("pass either run=<run folder> or predictions=<file.parquet>, not both")
        if cfg.predictions:
            return rescore_predictions(cfg)
        if cfg.run:
            return evaluate_run_folder(cfg)
        raise UserError("nothing to evaluate: pass run=<run folder> [dataset=<name>] or predictions=<file.parquet>")
    except UserError as err:
        report_user_error(err)
        return None


def rescore_predictions(cfg) -> dict:
    path = Path(cfg.predictions)
    if not path.is_file():
        raise UserError(f"predictions={path}: file not found")
    try:
        frame = pd.read_parquet(path)
    except Exception as err:
        raise UserError(f"predictions={path}: not a readable parquet file ({type(err).__name__})") from None
    name = path.stem
    metrics = score_predictions(frame, cfg.metric)  # validates the columns with one-line errors
    out = Path(HydraConfig.get().runtime.output_dir)
    check_writes_inside(out, folders=("figures", f"figures/{name}"), files=("metrics.json",))
    diagrams(frame, out / "figures" / name, cfg.metric, title=name, metrics=metrics)
    write_json(out / "metrics.json", {name: metrics})
    print(f"re-scored {path} -> {out / 'metrics.json'}\n{summary_table({name: metrics})}", flush=True)
    return {name: metrics}


def evaluate_run_folder(cfg) -> dict:
    check_cache_dir(cfg.paths.cache_dir)  # before the run's config, data or model is read
    # this machine's local copies of the data win over the folders the run was trained with
    own_paths = {key: cfg.paths.get(key) for key in MACHINE_PATHS}
    folder, run_cfg = read_run_config(cfg.run, own_paths)  # checked before any data or model is touched
    quiet_datasets_unless(bool(cfg.progress))
    names = cfg.eval_datasets if cfg.eval_datasets is not None else run_cfg.eval_datasets
    also = run_cfg.get("also_evaluate") or () if cfg.eval_datasets is None else ()
    seed = check_integer(f"{folder.root}/.hydra/config.yaml: seed", run_cfg.seed, minimum=0)
    eval_sets = resolve_eval_sets(names, run_cfg.dataset, seed, cfg.paths, also)
    # dataset.<key>=... (e.g. dataset.subsets=[harmless-base]) sets that key of each evaluated dataset's config
    options = OmegaConf.to_container(cfg.dataset, resolve=True) if cfg.get("dataset") is not None else None
    if options is not None and not isinstance(options, dict):
        raise UserError(f"dataset options must be dataset.<key>=<value>, not dataset={options}")
    eval_sets = with_options(eval_sets, options)
    folder.check_evaluation_writes([es.name for es in eval_sets])  # before any work; again before the swap
    if folder.metrics_path.exists():  # merged into at the end: a corrupt one is refused now, before any work
        read_json_object(folder.metrics_path, "the run's metrics")
    eval_loaders = {es.name: build_loader(es.config) for es in eval_sets}
    task = method_task(run_cfg.method)
    for name, loader in eval_loaders.items():
        check_eval_kind(name, loader, task)
    if cfg.max_length is not None:
        max_length = check_integer("max_length", cfg.max_length, minimum=1)
        check_max_length(max_length, run_cfg.model, cfg.paths.cache_dir)   # the backbone's context window
    else:
        max_length = check_integer(f"{folder.root}/.hydra/config.yaml: max_length", run_cfg.max_length, minimum=1)
    run = load_trained_method(cfg.run, device=cfg.device, cache_dir=cfg.paths.cache_dir, progress=bool(cfg.progress),
                              max_length=max_length, trust_remote_code=cfg.get("trust_remote_code", False))
    folder, method, backbone = run.folder, run.method, run.backbone
    calibration, other = run_calibration(folder.root, cfg)
    # the length filter from the recorded conversations: no tokenizer where all are recorded (train.py's records)
    conversations = ConversationIndex(backbone, Path(cfg.paths.cache_dir) / "features" / "conversations",
                                      token_cache=Path(cfg.paths.cache_dir) / "token_lengths")
    blocks = {}
    with staged_results(folder) as staging:
        for es in eval_sets:
            frame, _ = load_split(eval_loaders[es.name], es.split, es.name, None, max_length,
                                  n_bins=cfg.metric.n_bins, conversations=conversations)
            evaluate = evaluate_pointwise if data_kind(frame) == "pointwise" else evaluate_method
            if calibration is not None and calibration.fitted_on.get("split") == es.name:
                raise UserError(f"{es.name} is the split this run's recalibration was fitted on: its recalibrated "
                                "metrics would be fitted on what they report; pass recalibrated=false")
            blocks[es.name], _ = evaluate(method, frame, es.name, staging, cfg.metric, calibration, also=other)
        # Every step that can fail comes before the first rename: the lock (a link or a folder there is refused),
        # the checks (a link made while the datasets were scored), reading and merging metrics.json. What is left
        # are renames within one filesystem.
        with folder.metrics_lock():
            folder.check_evaluation_writes(list(blocks))
            write_json(staging.metrics_path, folder.merged_metrics(blocks))
            # A signal (Ctrl-C, SIGTERM) from here on waits for the renames: never half an evaluation swapped in.
            with job_signals.deferred(f"the evaluation had finished: its results are in {folder.root}"):
                swap_in(staging, folder, list(blocks))
                remove_staging(staging.root)
    print(f"evaluated {folder.root}\n{summary_table(blocks)}", flush=True)
    return blocks


def run_calibration(run_dir, cfg):
    """(the run's recalibration as it was trained, the same with evaluate.py's ``recalibrate_interval`` where that
    applies another interval scale, else None); (None, None) for a run without calibration.json (one line says so)
    or with ``recalibrated=false``. The run's own ``recal/...`` metrics are never replaced by another choice's: those
    go beside them as ``recal@<interval>/...``. An infeasible conformal scale asked for falls back (one line), and
    where that lands on the run's own interval there is nothing to add."""
    from rewarduq_exp.recalibration import read_calibration

    if not isinstance(cfg.get("recalibrated", True), bool):
        raise UserError(f"recalibrated={cfg.get('recalibrated')!r} is invalid: must be true or false")
    if not cfg.get("recalibrated", True):
        return None, None
    calibration = read_calibration(run_dir)
    interval = cfg.get("recalibrate_interval")
    if calibration is None or interval is None:
        return calibration, None
    other = calibration.with_interval(str(interval))
    return calibration, (None if other.interval == calibration.interval else other)


STAGING_PREFIX = ".evaluate-"
STAGING_OWNER = "owner.json"   # the evaluate.py process that stages there: host, pid, its start time
# A staging folder without an owner record older than this was left by a process killed between creating it and
# recording itself (microseconds apart); minutes, so that clocks of a shared filesystem's hosts may disagree a little.
OWNERLESS_STAGING_S = 600
# what os.mkdir raises in a folder this process cannot write: no permission, or a read-only mount
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


@contextlib.contextmanager
def staged_results(folder: RunFolder):
    """A hidden folder inside the run folder (same filesystem: the swap is a rename) laid out as a run folder, removed
    afterwards whatever happened (an error, a signal). It records its owner process (``owner.json``), so that one
    left by a process that could not remove it (``kill -9``, a lost node) is removed by the next evaluation of the
    run on the same host (:func:`remove_dead_staging`)."""
    remove_dead_staging(folder.root)
    staging = folder.root / f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    # One try from the folder's creation on: a signal handled on the first instruction after os.mkdir returns must
    # still say what was kept and remove the folder (a test that signals as soon as the folder appears caught it).
    try:
        try:
            os.mkdir(staging)  # a fresh real folder (never an existing name, nor a link someone left there)
        except OSError as err:
            if err.errno not in NOT_WRITABLE:
                raise
            raise UserError(f"run folder {folder.root} is not writable ({err.strerror}): evaluate.py adds its "
                            "results there; copy the run folder somewhere writable and evaluate the copy") from None
        write_atomic(staging / STAGING_OWNER, json.dumps(this_owner()))
        yield RunFolder(staging)
    except job_signals.TrainingInterrupted as err:
        err.message = err.message or f"nothing of this evaluation was kept: {folder.root} is as it was"
        raise
    finally:
        remove_staging(staging)


def remove_staging(staging: Path) -> None:
    """Remove a staging folder, its owner record last: a removal cut short (a second Ctrl-C) leaves a folder that
    still names its (then dead) owner."""
    if not staging.is_dir() or staging.is_symlink():
        return
    for child in staging.iterdir():
        if child.name != STAGING_OWNER:
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    (staging / STAGING_OWNER).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        staging.rmdir()


def remove_dead_staging(root: Path) -> None:
    """Remove the staging folders of evaluations whose process is provably gone: its ``owner.json`` names this host
    and a pid that no longer runs (or now belongs to a process started at another time). Any other one is kept: a
    live owner's, another host's (a shared filesystem: its process cannot be checked from here), one without an
    owner record."""
    for path in sorted(root.glob(f"{STAGING_PREFIX}*")):
        if not path.is_dir() or path.is_symlink():
            continue
        try:
            owner = read_json_object(path / STAGING_OWNER, "a staging folder's owner")
        except UserError:
            owner = None
        if owner is None:
            age = time.time() - path.stat().st_mtime
            if age > OWNERLESS_STAGING_S:
                log.info("removing %s: it names no owner process and is %.0f s old (its evaluate.py was killed "
                         "before recording itself)", path, age)
                remove_staging(path)
            else:
                log.info("kept %s: it names no owner process yet; delete it if no evaluate.py is running on this "
                         "run folder", path)
        elif gone_on_this_host(owner):
            log.info("removing %s: left by evaluate.py (pid %s on this host), which is gone", path, owner.get("pid"))
            remove_staging(path)


def swap_in(staging: RunFolder, folder: RunFolder, names: list[str]) -> None:
    """Move each dataset's staged predictions file and diagrams folder, then the staged metrics.json, over the run's
    own: a file by one rename, a folder by renaming the old one aside first. metrics.json comes last: it is what
    selection and tables read, so it never names an evaluation whose files are not in place."""
    # Every rename goes through folders reached without following a link and checked right before it
    # (replace_inside): a link made at predictions/ or figures/ while the evaluation ran is refused there.
    for name in names:
        staged = staging.predictions_path(name)
        if staged.exists():
            make_folders(folder.predictions_path(name).parent)
            replace_inside(staged, folder.predictions_path(name))
        staged_figures, figures = staging.figures_dir(name), folder.figures_dir(name)
        if staged_figures.exists():
            make_folders(figures.parent)
            old = figures.parent / f".{figures.name}.{uuid.uuid4().hex[:12]}.old"
            if figures.exists():
                replace_inside(figures, old, "folder")
            replace_inside(staged_figures, figures, "folder")
            with open_parent(old, create=False) as parent:
                if parent.lstat(old.name) is not None:
                    parent.remove_tree(old.name)
    if staging.metrics_path.exists():
        replace_inside(staging.metrics_path, folder.metrics_path)
