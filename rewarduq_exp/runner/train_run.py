"""What ``python train.py`` does, for every task:

compose -> validate (the config, then the method constructed once with its settings, the data sources; no data or
weights yet) -> the task's work (reward models and probes: load datasets, fit, score each eval set; label ranking:
cross-validation) -> metrics.json, status.json, the logger, the summary table.

The run lifecycle (skip when completed, start, validation vs running stage, log, finish or fail) is :func:`train`
and :func:`_run`, shared by the tasks; a task only says how it is prepared (``__init__``: validation, raising
:class:`UserError`) and what it computes (``run() -> RunOutput``).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rewarduq_exp.core import distributed, job_signals, job_threads, progress, training_checkpoint
from rewarduq_exp.core.checks import check_integer, check_positive
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.training_checkpoint import CHECKPOINT_DIR, TrainingCheckpoints
from rewarduq_exp.data.contract import data_kind
from rewarduq_exp.data.registry import build, build_loader, resolve_eval_sets
from rewarduq_exp.models.backbone import Backbone, resolve_device
from rewarduq_exp.models.conversation_index import ConversationIndex
from rewarduq_exp.models.features import FeatureEncoder
from rewarduq_exp.runner.cli import in_multirun, remove_refused_run_folder, report_user_error
from rewarduq_exp.runner.data_loading import load_split, quiet_datasets_unless
from rewarduq_exp.runner.evaluation import calibration_predictions, evaluate_method, evaluate_pointwise
from rewarduq_exp.runner.loggers import NullLogger, make_logger
from rewarduq_exp.runner.run_output import RunOutput
from rewarduq_exp.runner.summary import summary_table
from rewarduq_exp.runner.validation import check_data_kinds, check_task, require_complete, validate_run_config
from rewarduq_exp.runs.run_folder import RunFolder, config_hash, write_json
from rewarduq_exp.runs.run_identity import VALIDATION

log = logging.getLogger("rewarduq_exp")


def seed_everything(seed: int) -> None:
    """``seed`` is in [0, 2**32 - 1] (validation.check_seeds): numpy takes it as it is, no seed aliases another."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: DictConfig) -> dict | None:
    out = Path(HydraConfig.get().runtime.output_dir)
    # torchrun / accelerate launch: every process trains and scores, only rank 0 writes the run folder.
    folder = RunFolder(out, writer=distributed.is_main())
    try:
        require_complete(cfg)
        incomplete, chash = None, config_hash(cfg)
    except UserError as err:
        incomplete, chash = err, None   # recorded below as invalid settings, once the folder is ours
    if chash and not cfg.force and folder.is_completed(chash):
        log.info("skipping %s: already completed with this config (force=true re-runs it)", out)
        blocks = folder.read_metrics()
        if folder.writer:
            print(summary_table(blocks), flush=True)
        return blocks
    threads = job_threads.apply()   # a Slurm job's CPUs, before anything computes
    try:
        folder.start(chash, force=bool(cfg.force), **threads)
    except UserError as err:  # another live run's folder, or not writable: nothing was written, nothing to record
        report_user_error(err)
        return None
    log_file = _log_to_file(out / "train.log") if folder.writer else None
    log.info("threads: %d (%s)", threads["threads"], threads["threads_reason"])
    checkpoints, refused = None, False
    owns_signals = job_signals.install()   # False under train.py's entry point, which listens already
    try:
        if folder.writer:
            hydra_cfg = HydraConfig.instance().cfg
            folder.write_config(cfg, hydra_cfg, hydra_cfg.hydra.overrides.task)
        if incomplete is not None:
            raise incomplete
        checkpoints = _checkpoints(cfg, out, chash)
        with training_checkpoint.activate(checkpoints):
            return _run(cfg, out, folder, checkpoints)
    except (job_signals.TrainingInterrupted, KeyboardInterrupt) as caught:
        # KeyboardInterrupt: Ctrl-C while a library had put Python's own SIGINT handler back
        err = (caught if isinstance(caught, job_signals.TrainingInterrupted)
               else job_signals.TrainingInterrupted(signal.SIGINT, "(KeyboardInterrupt)"))
        saved = checkpoints is not None and checkpoints.exists()
        message = (f"interrupted by {err.signal_name} {err.where}; "
                   + (f"training state saved in {checkpoints.directory}: launch the same command again to resume"
                      if saved else "no training state saved yet: launching the same command again starts it over"))
        log.warning("%s", message)
        err.message = interrupted_line(err, checkpoints, in_multirun())
        with job_signals.deferred():   # a second Ctrl-C waits for status.json, then leaves at once
            folder.interrupt(message)
        job_signals.leave(err)
    except UserError as err:
        folder.fail(err, with_traceback=False)
        # settings, or data they name, refused before anything was trained: a single run leaves no folder (a sweep
        # records it in the job's folder, so that its summary lists it)
        refused = not in_multirun() and folder.stage == VALIDATION
        report_user_error(err)
        return None
    except BaseException as err:
        folder.fail(err)
        if in_multirun() and isinstance(err, Exception):
            # One crashed run must not stop a sweep: it is recorded (error + traceback in status.json) and the
            # launcher, the other jobs and the selection step go on.
            log.exception("run failed; recorded in %s", folder.status_path)
            return None
        raise
    finally:
        if owns_signals:
            job_signals.uninstall()
        if log_file is not None:
            logging.getLogger().removeHandler(log_file)
            log_file.close()
        if refused:
            remove_refused_run_folder(out)


def interrupted_line(err: job_signals.TrainingInterrupted, checkpoints: TrainingCheckpoints | None,
                     sweep: bool = False) -> str:
    """What the one line on stderr says was kept of an interrupted run, and what the same command will do."""
    again = "run the same command again to resume" + (" the sweep" if sweep else "")
    last = checkpoints.last_saved if checkpoints is not None else None
    kept = checkpoints is not None and checkpoints.exists()
    if err.forced:
        head = "stopped in the middle of a training step, without saving it; "
        if last and kept:
            return head + f"the training state saved at {last} is kept; {again}"
        if kept:
            return head + f"the training state saved earlier is kept; {again}"
        return head + "no training state was saved: the same command starts the run over"
    if last and kept:
        return f"training state saved at {last}; {again}"
    if kept:
        return f"the training state saved by an earlier attempt is kept in {checkpoints.directory}; {again}"
    return "no training state was saved yet: the same command starts the run over"


def _checkpoints(cfg: DictConfig, out: Path, chash: str | None) -> TrainingCheckpoints | None:
    """The run's training checkpoints (``<run>/checkpoint``); with ``force=true`` an old one is deleted first, so the
    run starts over."""
    if chash is None:
        return None
    settings = cfg.get("checkpoint") or {}
    every_steps, every_minutes = settings.get("every_steps"), settings.get("every_minutes")
    if every_steps is not None:
        check_integer("checkpoint.every_steps", every_steps, minimum=1)
    if every_minutes is not None:
        check_positive(every_minutes, "checkpoint.every_minutes")
    checkpoints = TrainingCheckpoints(out / CHECKPOINT_DIR, chash, every_steps=every_steps,
                                      every_minutes=every_minutes)
    if checkpoints.exists() and distributed.is_main():
        if cfg.force:
            log.info("force=true: deleting the training checkpoint in %s; training starts over", checkpoints.directory)
            checkpoints.clear()
        else:
            log.info("found a training checkpoint in %s: this run resumes from it", checkpoints.directory)
    distributed.barrier()
    return checkpoints


def _log_to_file(path: Path) -> logging.Handler:
    """``train.log`` in the run folder, in Hydra's format. Opened here, once the folder is ours, and not by Hydra's
    job logging (conf/hydra/job_logging/rewarduq.yaml has no file handler), which would append to the log of
    whatever run already holds the folder before this one could check."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def _run(cfg: DictConfig, out: Path, folder: RunFolder, checkpoints: TrainingCheckpoints | None = None) -> dict:
    t0 = time.perf_counter()
    validate_run_config(cfg)
    seed_everything(int(cfg.seed))
    if check_task(cfg) == "label_ranking":
        # imported here: its learners and ranking metrics take about a second to import, which a reward-model run
        # (the GPU node's common case) does not need
        from rewarduq_exp.runner.label_ranking_run import LabelRankingTask

        task_class = LabelRankingTask
    else:
        task_class = RewardModelTask
    task = task_class(cfg, out, folder)     # validation: a UserError here is recorded as invalid settings
    # a logger that cannot start (wandb without a login) is a setting to fix, like the others
    logger = make_logger(cfg, out, out.name) if folder.writer else NullLogger()
    # the stage stays "validation" until the task has read its data (it says so): a setting, or data it names, refused
    # before anything is trained; a single run then leaves no folder
    failed = True
    try:
        result = task.run()
        # metrics.json and the summary table first, the figures after them (matplotlib is imported only then): the
        # table does not wait for the drawing, and a figure that fails loses no metric.
        folder.write_metrics(result.blocks)
        if folder.writer:
            print("\n".join([f"run folder: {out}", summary_table(result.blocks), *result.notes]), flush=True)
        figures_failed = result.draw_figures()
        logger.log_history(result.history)
        for name, metrics in result.blocks.items():
            logger.log_metrics(name, metrics, result.figures.get(name, []))
        if result.summary:
            logger.log_summary(result.summary)
        resumed = {"resumed": checkpoints.resumed} if checkpoints is not None and checkpoints.resumed else {}
        failures = {"figures_failed": figures_failed} if figures_failed else {}   # lines "<dataset>: <error>"
        folder.finish(**result.info, **resumed, **failures, seconds_total=round(time.perf_counter() - t0, 2))
        if checkpoints is not None and folder.writer:
            checkpoints.clear()   # the run is complete: its training state is of no further use
        failed = False
        return result.blocks
    finally:
        logger.finish(failed=failed)  # always finished, also on error


def add_earlier_training(fit_summary: dict) -> None:
    """A resumed run trained partly in earlier attempts: its ``seconds_training`` (``method.json``, ``status.json``'s
    ``fit``) covers them too, and ``seconds_training_earlier_attempts`` says how much of it they were (from the
    training checkpoints it resumed; see :class:`TrainingCheckpoints`)."""
    checkpoints = training_checkpoint.active()
    earlier = checkpoints.earlier_seconds if checkpoints is not None else 0.0
    if not earlier:
        return
    fit_summary["seconds_training_earlier_attempts"] = round(earlier, 3)
    if isinstance(fit_summary.get("seconds_training"), (int, float)):
        fit_summary["seconds_training"] += earlier


def check_not_evaluated(cal_frame, eval_frames: dict, cal_name: str) -> None:
    """Refuse a calibration split that shares a row (by ``id``) with an evaluated set: recalibrated metrics fitted on
    the rows they are reported on would be optimistic."""
    ids = set(cal_frame["id"].astype(str))
    for name, frame in eval_frames.items():
        if "id" not in frame.columns:
            continue
        shared = ids.intersection(frame["id"].astype(str))
        if shared:
            raise UserError(f"the calibration split {cal_name} shares {len(shared)} row(s) with the eval set {name} "
                            f"(e.g. id {sorted(shared)[0]!r}): recalibration must not be fitted on what it is "
                            "reported on; evaluate another split, or pass recalibrate.enabled=false")


class RewardModelTask:
    """Reward models and probes (RewardUQ's methods, BoRP): a backbone, training data, eval sets.

    Preparing it checks everything that needs no data and no weights: the backbone's settings (loaded lazily: a run
    whose features are all cached never loads the weights), the probe, the method (constructed once, here, with its
    backbone), the datasets and whether their kind fits the method."""

    def __init__(self, cfg: DictConfig, out: Path, folder: RunFolder):
        self.cfg, self.out, self.folder = cfg, out, folder
        # torchrun / accelerate launch / a multi-task Slurm job: one process group before any model or tensor exists
        # (on GPUs this also binds each process to its own device).
        distributed.setup(resolve_device(cfg.device).type)
        if not distributed.is_main():
            os.environ["TQDM_DISABLE"] = "1"  # one set of progress bars (rank 0's): methods, encoder and TRL read it
        progress.set_interval(60 * check_positive(cfg.get("progress_log_minutes", 3), "progress_log_minutes"))
        self.backbone = Backbone(cfg.model, cache_dir=cfg.paths.cache_dir, device=cfg.device)
        cache = Path(cfg.paths.cache_dir)
        # What each conversation renders to, recorded: the length filter and the feature lookup of a run whose
        # features are all cached load no tokenizer (the token counts of what is not recorded yet: token_lengths/).
        self.conversations = ConversationIndex(self.backbone, cache / "features" / "conversations",
                                               token_cache=cache / "token_lengths")
        self.features = FeatureEncoder(self.backbone, cfg.probe, cache / "features", int(cfg.max_length),
                                       show_progress=bool(cfg.progress), conversations=self.conversations)
        self.method = build(cfg.method, "method", encoder=self.features)
        self.loader = build_loader(cfg.dataset)
        self.eval_sets = resolve_eval_sets(cfg.eval_datasets, cfg.dataset, int(cfg.seed), cfg.paths,
                                           cfg.get("also_evaluate") or ())
        self.eval_loaders = {es.name: self.loader if es.config is cfg.dataset else build_loader(es.config)
                             for es in self.eval_sets}
        check_data_kinds(self.loader, self.eval_loaders, self.method.task)
        for loader in {id(x): x for x in [self.loader, *self.eval_loaders.values()]}.values():
            if hasattr(loader, "check_memory"):   # a generated world: what all its rows take of the host's memory
                loader.check_memory()
        from rewarduq_exp.recalibration import recalibrate_settings

        self.recalibrate = recalibrate_settings(cfg.get("recalibrate"))

    def run(self) -> RunOutput:
        cfg, folder, method, loader = self.cfg, self.folder, self.method, self.loader
        quiet_datasets_unless(bool(cfg.progress))
        max_length = int(cfg.max_length)
        measured = {"conversations": self.conversations}  # the tokenizer loads only for what is not recorded
        train_frame, train_report = load_split(loader, loader.train_split, f"{cfg.dataset.name}_{loader.train_split}",
                                               None, max_length, training=True,
                                               batch_size=cfg.method.get("batch_size"), **measured)
        eval_frames, reports = {}, [train_report]
        for es in self.eval_sets:
            eval_frames[es.name], report = load_split(self.eval_loaders[es.name], es.split, es.name, None,
                                                      max_length, n_bins=cfg.metric.n_bins, **measured)
            reports.append(report)
        cal_frame = self._calibration_split(max_length, eval_frames, reports)
        folder.stage = "running"   # the settings and the data they name are good: from here a failure is the run's
        if folder.writer:
            write_json(self.out / "data_summary.json", [vars(r) | {"dropped": r.dropped} for r in reports])

        if not eval_frames:
            log.info("no eval datasets: training only (pass eval_datasets=[...] or use evaluate.py later)")
        first_eval = None
        if method.uses_eval_set:
            first_eval = next((f for f in eval_frames.values() if data_kind(f) == "pairs"), None)
        fit_summary = method.fit(train_frame, first_eval).fit_summary
        add_earlier_training(fit_summary)
        log.info("trained %s: %s", type(method).__name__, fit_summary)
        if folder.writer:
            method.save(folder.model_dir)
            write_json(self.out / "train_history.json", method.history)

        calibration = None
        if cal_frame is not None:
            from rewarduq_exp.recalibration import fit_calibration, save_calibration

            cal_name = f"{cfg.dataset.name}_{loader.cal_split}"
            calibration = fit_calibration(calibration_predictions(method, cal_frame), self.recalibrate, cal_name,
                                          n_bins=int(cfg.metric.n_bins))
            if folder.writer:
                save_calibration(self.out, calibration)
            conformal = calibration.conformal_scale   # None where infeasible (a warning line said why)
            kept = str(calibration.details.get("temperature_choice", "fitted")).startswith("fitted")
            log.info("recalibration fitted on %s (%d rows): temperature %.4g (%s), interval scale %.4g (%s), "
                     "conformal scale %s", cal_name, len(cal_frame), calibration.temperature,
                     "fitted" if kept else "raw probabilities: the fitted T did not help held out",
                     calibration.scale, calibration.interval, "infeasible" if conformal is None else f"{conformal:.4g}")

        blocks, figures, drawings = {}, {}, {}
        # Under torchrun / accelerate every process takes part in scoring (evaluation.score_method splits the rows);
        # only rank 0 writes predictions and diagrams, the diagrams once metrics.json is written (_run).
        for name, frame in eval_frames.items():
            evaluate = evaluate_pointwise if data_kind(frame) == "pointwise" else evaluate_method
            drawings[name] = []
            blocks[name], figures[name] = evaluate(method, frame, name, folder, cfg.metric, calibration,
                                                   later=drawings[name])
        info = {"fit": fit_summary, "token_count_cache": self.conversations.token_count_stats(),
                "conversations": dict(self.conversations.stats)}
        if distributed.world_size() > 1:
            info["world_size"] = distributed.world_size()
        if getattr(method, "stats", None):
            info["method"] = method.stats
        if self.backbone.device.type == "cuda":   # what the run held at its peak (the planner's figure to compare)
            import torch

            info["device_memory"] = {"peak_allocated_bytes": torch.cuda.max_memory_allocated(self.backbone.device),
                                     "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.backbone.device),
                                     "device": torch.cuda.get_device_name(self.backbone.device)}
        if calibration is not None:
            info["recalibration"] = {"split": calibration.fitted_on.get("split"), "n": calibration.fitted_on.get("n"),
                                     "temperature": calibration.temperature, "scale": calibration.scale,
                                     "interval": calibration.interval}
            if calibration.interval_fallback is not None:
                info["recalibration"].update(interval_requested=calibration.interval_requested,
                                             interval_fallback=calibration.interval_fallback)
        result = RunOutput(blocks, info, figures=figures, history=method.history, drawings=drawings)
        widths = {name: m["bound_width"] for name, m in blocks.items() if m.get("bound_width") is not None}
        if len(widths) > 1:
            result.notes.append("mean uncertainty (reward-interval width): "
                                + ", ".join(f"{k} {v:.4f}" for k, v in widths.items()))
        if method.uses_feature_cache:  # the others run the backbone themselves
            stats = self.features.stats
            info["features"] = stats
            result.summary["features/backbone_forward_passes"] = stats["backbone_forward_passes"]
            result.notes.append(f"backbone forward passes: {stats['backbone_forward_passes']} "
                                f"(feature cache: {stats['cache_hits']} hits, {stats['cache_misses']} misses)")
        return result

    def _calibration_split(self, max_length: int, eval_frames: dict, reports: list):
        """The training dataset's calibration split (its report appended to ``reports``), or None with one line
        saying why there is no recalibration."""
        cfg, loader = self.cfg, self.loader
        if not self.recalibrate["enabled"]:
            return None
        split = getattr(loader, "cal_split", None)
        if split is None:
            log.info("no recalibration: dataset '%s' has no calibration split (raw metrics only)", cfg.dataset.name)
            return None
        name = f"{cfg.dataset.name}_{split}"
        frame, report = load_split(loader, split, name, None, max_length, conversations=self.conversations)
        reports.append(report)
        check_not_evaluated(frame, eval_frames, name)
        return frame

