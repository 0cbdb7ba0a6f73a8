"""Checks that ``train.py`` and ``evaluate.py`` run before any data or model is touched: mandatory settings, the
metric options, and whether the method and the datasets are of the same kind (preference pairs, rated responses,
label rankings). Each failure is one :class:`UserError` line naming the setting and what is allowed."""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics import check_alphas, check_n_bins
from rewarduq_exp.metrics.kwise import check_tie_rule
from rewarduq_exp.metrics.reward_bench import check_scoring


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
    """Checks of a training run's config that need no data, model or method."""
    validate_metric_config(cfg.metric)
    if int(cfg.max_length) < 1:
        raise UserError(f"max_length={cfg.max_length} is invalid: must be an integer >= 1")


def method_task(method_cfg) -> str:
    """What a method config trains on: ``preferences`` (the reward models), ``pointwise`` (BoRP: rated responses) or
    ``label_ranking`` (the learners)."""
    from hydra.utils import get_class

    try:
        return get_class(str(method_cfg._target_)).task
    except (ImportError, AttributeError, ValueError):
        return "preferences"  # an unknown class gets its own one-line error when it is built


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


def check_task(cfg: DictConfig) -> str:
    """The run's task from the dataset, and a one-line error when the method trains on something else."""
    task = dataset_task(cfg.dataset)
    have = method_task(cfg.method)
    if have != task:
        from rewarduq_exp.data.registry import CONF_DIR, available

        methods = [m for m in available("method")
                   if method_task(OmegaConf.load(CONF_DIR / "method" / f"{m}.yaml")) == task]
        what = {"label_ranking": "a label-ranking dataset", "pointwise": "pointwise data (rated responses)"}.get(
            task, "preference data")
        raise UserError(f"method={_choice('method')} trains on {have.replace('_', '-')} data, but dataset="
                        f"{_choice('dataset')} is {what}; allowed methods here: {', '.join(methods)}")
    return task


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


def _choice(group: str) -> str:
    try:
        return str(HydraConfig.get().runtime.choices.get(group))
    except ValueError:  # not under Hydra (tests calling train() directly)
        return "?"
