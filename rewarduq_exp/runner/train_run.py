"""What ``python train.py`` does:

compose -> validate -> load datasets (normalise, filter) -> backbone + tokenizer -> method.fit (features from the
cache) -> method.score on each eval dataset -> metrics -> run folder -> wandb (if enabled).
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core import distributed
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import data_kind, filter_by_length, validate_preferences
from rewarduq_exp.data.registry import build, build_loader, resolve_eval_sets
from rewarduq_exp.metrics import check_alphas, check_n_bins
from rewarduq_exp.metrics.kwise import check_tie_rule
from rewarduq_exp.metrics.reward_bench import check_scoring
from rewarduq_exp.models.backbone import Backbone, resolve_device
from rewarduq_exp.models.features import FeatureEncoder
from rewarduq_exp.models.token_counter import TokenCounter
from rewarduq_exp.runner.cli import in_multirun, report_user_error
from rewarduq_exp.runner.evaluation import evaluate_method, evaluate_pointwise
from rewarduq_exp.runner.loggers import NullLogger, make_logger
from rewarduq_exp.runner.summary import summary_table
from rewarduq_exp.runs.run_folder import RunFolder, config_hash, write_json

log = logging.getLogger("rewarduq_exp")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def require_complete(cfg: DictConfig) -> None:
    """Mandatory values (``???`` in a config, e.g. ``dataset.path`` of ``dataset=local``) must be given."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(f"missing required setting(s): {', '.join(missing)}; pass them on the command line, "
                        f"e.g. {missing[0]}=<value>")


def validate_metric_config(metric_cfg) -> None:
    try:
        check_n_bins(metric_cfg.n_bins)
    except UserError:
        raise UserError(f"metric.n_bins={metric_cfg.n_bins} is invalid: must be an integer >= 1") from None
    try:
        check_alphas(metric_cfg.alphas)
    except UserError:
        raise UserError(f"metric.alphas={list(metric_cfg.alphas)} is invalid: each alpha must be in [0, 1]") from None
    check_scoring(metric_cfg)
    check_tie_rule(metric_cfg.get("kwise_tie_rule", "official"))


def validate_run_config(cfg: DictConfig) -> None:
    """Checks that need no data or model, done before any heavy work."""
    validate_metric_config(cfg.metric)
    if int(cfg.max_length) < 1:
        raise UserError(f"max_length={cfg.max_length} is invalid: must be an integer >= 1")


def load_split(loader, split: str, name: str, tokenizer, max_length: int, count=None):
    frame = loader.load(split)
    if data_kind(frame) == "pairs":
        frame = validate_preferences(frame, f"dataset '{name}'")
    unsplittable = int(frame.attrs.get("dropped_unsplittable", 0))
    frame, report = filter_by_length(frame, tokenizer, max_length, name, count)
    report.unsplittable = unsplittable
    log.info(report.line())
    return frame, report


def check_data_kinds(train_loader, eval_loaders: dict, task: str = "preferences") -> None:
    """Preference methods train on pairs and score pairs or K-wise sets; pointwise methods (BoRP) train on rated
    responses and also score pairs / K-wise sets; say so before any data is fetched."""
    name = train_loader.name
    if getattr(train_loader, "train_split", "train") is None:
        raise UserError(f"dataset '{name}' is an evaluation set without a train split; train on another dataset "
                        f"and pass eval_datasets=[{name}]")
    kind = getattr(train_loader, "kind", "pairs")
    if task == "preferences" and kind != "pairs":
        raise UserError(f"dataset '{name}' is {kind} data; preference methods train on pairwise data "
                        "(e.g. dataset=ultrafeedback, skywork_pref, tulu3_pref, hh_rlhf, local)")
    for es_name, loader in eval_loaders.items():
        check_eval_kind(es_name, loader, task)


def check_eval_kind(name: str, loader, task: str = "preferences") -> None:
    if getattr(loader, "kind", "pairs") == "pointwise" and task != "pointwise":
        raise UserError(f"eval dataset '{name}' is pointwise (one rated response per row) and has no preference "
                        "to score; evaluate on pairwise or K-wise data")


def train(cfg: DictConfig) -> dict | None:
    out = Path(HydraConfig.get().runtime.output_dir)
    # torchrun / accelerate launch: every process trains and scores, only rank 0 writes the run folder.
    folder = RunFolder(out, writer=distributed.is_main())
    if not folder.writer:
        _leave_log_file_to_rank0()
    try:
        require_complete(cfg)
    except UserError as err:
        folder.fail(err, with_traceback=False)  # recorded as invalid settings, not as a run that never started
        report_user_error(err)
        return None
    chash = config_hash(cfg)
    if not cfg.force and folder.is_completed(chash):
        log.info("skipping %s: already completed with this config (force=true re-runs it)", out)
        blocks = folder.read_metrics()
        if folder.writer:
            print(summary_table(blocks), flush=True)
        return blocks
    folder.start(chash)
    try:
        return _train(cfg, out, folder)
    except UserError as err:
        folder.fail(err, with_traceback=False)
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


def method_task(method_cfg) -> str:
    """What a method config trains on: ``preferences`` (the reward models), ``pointwise`` (BoRP: rated responses) or
    ``label_ranking`` (the learners)."""
    from hydra.utils import get_class

    try:
        return get_class(str(method_cfg._target_)).task
    except (ImportError, AttributeError, ValueError):
        return "preferences"  # an unknown class gets its own one-line error when it is built


def check_task(cfg: DictConfig) -> str:
    """The run's task from the dataset, and a one-line error when the method trains on something else."""
    task = dataset_task(cfg.dataset)
    have = method_task(cfg.method)
    if have != task:
        from rewarduq_exp.data.registry import available

        methods = [m for m in available("method") if method_task(load_method_config(m)) == task]
        what = {"label_ranking": "a label-ranking dataset", "pointwise": "pointwise data (rated responses)"}.get(
            task, "preference data")
        raise UserError(f"method={_choice('method')} trains on {have.replace('_', '-')} data, but dataset="
                        f"{_choice('dataset')} is {what}; allowed methods here: {', '.join(methods)}")
    return task


def dataset_task(dataset_cfg) -> str:
    """What a dataset config trains: label_ranking, pointwise (rated responses) or preferences (pairs)."""
    from hydra.utils import get_class

    if dataset_cfg.get("kind") == "label_ranking":
        return "label_ranking"
    try:
        kind = getattr(get_class(str(dataset_cfg._target_)), "kind", "pairs")
    except (ImportError, AttributeError, ValueError):
        kind = "pairs"
    return "pointwise" if kind == "pointwise" else "preferences"


def _choice(group: str) -> str:
    try:
        return str(HydraConfig.get().runtime.choices.get(group))
    except ValueError:  # not under Hydra (tests calling train() directly)
        return "?"


def load_method_config(name: str):
    from rewarduq_exp.data.registry import CONF_DIR

    return OmegaConf.load(CONF_DIR / "method" / f"{name}.yaml")


def _train(cfg: DictConfig, out: Path, folder: RunFolder) -> dict:
    t0 = time.perf_counter()
    validate_run_config(cfg)
    if check_task(cfg) == "label_ranking":
        return _train_label_ranking(cfg, out, folder, t0)
    # torchrun / accelerate launch / a multi-task Slurm job: one process group before any model or tensor exists
    # (on GPUs this also binds each process to its own device).
    distributed.setup(resolve_device(cfg.device).type)
    if not distributed.is_main():
        os.environ["TQDM_DISABLE"] = "1"  # one set of progress bars (rank 0's): methods, encoder and TRL read it
    # Validate the method's settings before any data or model is touched (a dry construction, no backbone yet);
    # the method itself is constructed with the backbone once that exists.
    build(cfg.method, "method", encoder=None)
    loader = build_loader(cfg.dataset)
    eval_sets = resolve_eval_sets(cfg.eval_datasets, cfg.dataset, int(cfg.seed), cfg.paths,
                                  cfg.get("also_evaluate") or ())
    eval_loaders = {es.name: loader if es.config is cfg.dataset else build_loader(es.config) for es in eval_sets}
    check_data_kinds(loader, eval_loaders, method_task(cfg.method))
    folder.stage = "running"  # the settings are valid; from here a failure is the run's, not the settings'
    seed_everything(int(cfg.seed))
    logger = make_logger(cfg, out, out.name) if folder.writer else NullLogger()
    failed = True
    try:
        blocks = _fit_and_evaluate(cfg, out, folder, loader, eval_sets, eval_loaders, logger, t0)
        failed = False
        return blocks
    finally:
        logger.finish(failed=failed)  # always finished, also on error


def _train_label_ranking(cfg: DictConfig, out: Path, folder: RunFolder, t0: float) -> dict:
    """The calibrated-label-ranking protocol (rewarduq_exp/runner/label_ranking_run.py): no backbone, no eval sets."""
    from rewarduq_exp.runner.label_ranking_run import run_label_ranking, validate_ranking_options

    validate_ranking_options(cfg.metric)
    build(cfg.method, "method")  # settings checked before the data is read
    build_loader(cfg.dataset)
    folder.stage = "running"
    seed_everything(int(cfg.seed))
    logger = make_logger(cfg, out, out.name) if folder.writer else NullLogger()
    failed = True
    try:
        blocks, info = run_label_ranking(cfg, out, folder, show_progress=bool(cfg.progress))
        folder.write_metrics(blocks)
        for name, metrics in blocks.items():
            logger.log_metrics(name, metrics, [])
        folder.finish(**info, seconds_total=round(time.perf_counter() - t0, 2))
        if folder.writer:
            print(f"run folder: {out}\n{summary_table(blocks)}", flush=True)
        failed = False
        return blocks
    finally:
        logger.finish(failed=failed)


def quiet_datasets_unless(progress: bool) -> None:
    """``progress=false`` also silences the ``datasets`` library's bars (split generation, filters)."""
    if not progress:
        import datasets

        datasets.disable_progress_bars()


def _fit_and_evaluate(cfg, out: Path, folder: RunFolder, loader, eval_sets, eval_loaders, logger,
                      t0: float) -> dict:
    quiet_datasets_unless(bool(cfg.progress))
    backbone = Backbone(cfg.model, cache_dir=cfg.paths.cache_dir, device=cfg.device)
    tokenizer = backbone.tokenizer
    max_length = int(cfg.max_length)
    count = TokenCounter(tokenizer, backbone.identity(), Path(cfg.paths.cache_dir) / "token_lengths")
    train_frame, train_report = load_split(loader, loader.train_split, f"{cfg.dataset.name}_{loader.train_split}",
                                           tokenizer, max_length, count)
    eval_frames, reports = {}, [train_report]
    for es in eval_sets:
        eval_frames[es.name], report = load_split(eval_loaders[es.name], es.split, es.name, tokenizer, max_length,
                                                  count)
        reports.append(report)
    if folder.writer:
        write_json(out / "data_summary.json", [vars(r) | {"dropped": r.dropped} for r in reports])

    encoder = FeatureEncoder(backbone, cfg.probe, Path(cfg.paths.cache_dir) / "features", max_length,
                             show_progress=bool(cfg.progress))
    method = build(cfg.method, "method", encoder=encoder)
    if not eval_frames:
        log.info("no eval datasets: training only (pass eval_datasets=[...] or use evaluate.py later)")
    first_eval = None
    if method.uses_eval_set:
        first_eval = next((f for f in eval_frames.values() if data_kind(f) == "pairs"), None)
    fit_summary = method.fit(train_frame, first_eval).fit_summary
    log.info("trained %s: %s", cfg.method._target_.rsplit(".", 1)[-1], fit_summary)
    if folder.writer:
        method.save(folder.model_dir)
        write_json(out / "train_history.json", method.history)
    logger.log_history(method.history)

    blocks = {}
    # Under torchrun / accelerate every process takes part in scoring (evaluation.score_method splits the rows);
    # only rank 0 writes predictions and diagrams.
    for name, frame in eval_frames.items():
        evaluate = evaluate_pointwise if data_kind(frame) == "pointwise" else evaluate_method
        metrics, figures = evaluate(method, frame, name, folder, cfg.metric)
        blocks[name] = metrics
        logger.log_metrics(name, metrics, figures)
    folder.write_metrics(blocks)
    uses_features = method.uses_feature_cache  # the others run the backbone themselves
    info = {"fit": fit_summary, "token_count_cache": count.stats, "seconds_total": round(time.perf_counter() - t0, 2)}
    if distributed.world_size() > 1:
        info["world_size"] = distributed.world_size()
    if uses_features:
        info["features"] = encoder.stats
        logger.log_summary({"features/backbone_forward_passes": encoder.stats["backbone_forward_passes"]})
    if getattr(method, "stats", None):
        info["method"] = method.stats
    folder.finish(**info)
    if folder.writer:
        _print_summary(out, blocks, encoder if uses_features else None)
    return blocks


def _leave_log_file_to_rank0() -> None:
    """Ranks > 0 stop writing Hydra's ``train.log`` (it is rank 0's; their console output is still there)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()


def _print_summary(out: Path, blocks: dict, encoder) -> None:
    lines = [f"run folder: {out}", summary_table(blocks)]
    widths = {name: m["bound_width"] for name, m in blocks.items() if m.get("bound_width") is not None}
    if len(widths) > 1:
        lines.append("mean uncertainty (reward-interval width): "
                     + ", ".join(f"{k} {v:.4f}" for k, v in widths.items()))
    stats = encoder.stats if encoder is not None else None
    if stats is not None:
        lines.append(f"backbone forward passes: {stats['backbone_forward_passes']} "
                     f"(feature cache: {stats['cache_hits']} hits, {stats['cache_misses']} misses)")
    print("\n".join(lines), flush=True)
