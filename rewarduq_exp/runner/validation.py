"""Checks that ``train.py`` and ``evaluate.py`` run before any data or model is touched: mandatory settings, the
metric options, the seed, a writable cache folder, and whether the method and the datasets are of the same kind
(preference pairs, rated responses, label rankings). Each failure is one :class:`UserError` line naming the setting
and what is allowed."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.checks import check_integer, check_seed, is_seed
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
    check_seeds(cfg)
    check_integer("max_length", cfg.max_length, minimum=1)
    validate_metric_config(cfg.metric)
    check_cache_dir(cfg.paths.cache_dir)
    check_device_per_rank(str(cfg.get("device", "auto")))


def check_seeds(node: DictConfig, prefix: str = "") -> None:
    """Every seed of the run (``seed``, ``method.seed``, ``dataset.sample_seed``, ...) in [0, 2**32 - 1], also when
    it comes from a config file rather than the command line (where :mod:`rewarduq_exp.runner.cli` checks it)."""
    for key in node.keys():
        path = f"{prefix}{key}"
        if path == "hydra":
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            check_seeds(child, f"{path}.")
        elif is_seed(path):
            check_seed(path, node[key])


def check_device_per_rank(device: str) -> None:
    """Under a launcher (torchrun, accelerate launch, a multi-task Slurm job) every rank takes ``cuda:LOCAL_RANK``
    (nccl, one GPU per rank): a device naming one GPU would put every rank on it, which nccl refuses."""
    import os

    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and device.startswith("cuda:"):
        raise UserError(f"device={device} names one GPU, but this run has {os.environ['WORLD_SIZE']} processes that "
                        "each take their own (cuda:LOCAL_RANK); use device=cuda or device=auto")


def check_cache_dir(cache_dir) -> None:
    """``paths.cache_dir`` must be a folder this process can create and write (the tiny model, features and token
    counts go there): checked by creating it and a scratch file in it, because permission bits do not tell (root
    writes anywhere, a read-only mount refuses everyone)."""
    folder = Path(str(cache_dir))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise UserError(f"paths.cache_dir={cache_dir} is not a writable folder ({err.strerror or type(err).__name__}); "
                        "point it at a writable folder: paths.cache_dir=<folder>") from None


def method_task(method_cfg) -> str:
    """What a method config trains on: ``preferences`` (the reward models), ``pointwise`` (BoRP: rated responses) or
    ``label_ranking`` (the learners). The class is looked up in the method registry, never imported from the
    config's ``_target_`` string (a run folder's config is a file someone may have handed you)."""
    from rewarduq_exp.methods.registry import method_class, method_name_of_target

    name = method_name_of_target(method_cfg.get("_target_"))
    if name is None:
        return "preferences"  # not one of ours: it gets its own one-line error when it is built (or loaded)
    return method_class(name).task


def dataset_task(dataset_cfg) -> str:
    """What a dataset config trains: label_ranking, pointwise (rated responses) or preferences (pairs). The loader
    class is one that this package's dataset configs name, never one imported from the config's string."""
    from rewarduq_exp.data.registry import loader_class

    if dataset_cfg.get("kind") == "label_ranking":
        return "label_ranking"
    cls = loader_class(dataset_cfg.get("_target_"))
    kind = getattr(cls, "kind", "pairs") if cls is not None else "pairs"
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
