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
from rewarduq_exp.core.setting_bounds import check_config_bounds
from rewarduq_exp.methods.registry import method_bounds
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
    check_config_bounds(metric_cfg, prefixes=("metric.",), at="metric")   # the bins (and the ranking metrics' sizes)
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
    """Checks of a training run's config that need no data, model or method: every size within its bounds
    (:mod:`rewarduq_exp.core.setting_bounds`), also when it comes from a config file, and the sizes that depend on
    the backbone or the device checked against them (:func:`check_model_limits`), before anything is allocated."""
    check_seeds(cfg)
    check_config_bounds(cfg, extra=method_bounds(cfg.get("method")))   # the method's own bounds: its settings
    check_integer("max_length", cfg.max_length, minimum=1)
    validate_metric_config(cfg.metric)
    check_cache_dir(cfg.paths.cache_dir)
    check_device_per_rank(str(cfg.get("device", "auto")))
    if dataset_task(cfg.dataset) != "label_ranking":   # label rankers read no backbone
        check_model_limits(cfg)


# ------------------------------------------------------------------------------------------ limits of the backbone
def model_shape(model_cfg, cache_dir) -> dict | None:
    """The backbone's ``config.json`` fields where they are known without downloading anything: a shipped shape
    file, the tiny model's build settings, a local checkpoint (:func:`rewarduq_exp.models.shapes.shape_config`) or a
    copy already in the Hugging Face cache; None when none is."""
    from rewarduq_exp.models.shapes import shape_config

    try:
        return shape_config(model_cfg, cache_dir)
    except UserError:
        pass
    except Exception:  # noqa: BLE001 (an unreadable shape file: the run's own loading reports it)
        return None
    hub_id = model_cfg.get("hub_id")
    if not hub_id:
        return None
    try:
        import json

        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(str(hub_id), "config.json", revision=model_cfg.get("revision") or None)
        return json.loads(Path(found).read_text()) if isinstance(found, str) else None
    except Exception:  # noqa: BLE001 (no cache, no copy: the limit is not known, the static bound still holds)
        return None


def check_max_length(max_length: int, model_cfg, cache_dir, key: str = "max_length") -> int:
    """``max_length`` no longer than the backbone's context window (``max_position_embeddings``), where it is known
    without downloading: pairs up to ``max_length`` tokens are kept and scored, and positions beyond the window are
    ones the model was never trained on."""
    window = (model_shape(model_cfg, cache_dir) or {}).get("max_position_embeddings")
    if isinstance(window, int) and not isinstance(window, bool) and max_length > window:
        raise UserError(f"{key}={max_length} is too large for model '{model_cfg.get('name')}': at most {window} "
                        f"tokens, its context window (max_position_embeddings); pairs up to max_length tokens are "
                        f"kept and scored whole; set {key}<={window}")
    return max_length


def check_model_limits(cfg: DictConfig) -> None:
    """What the backbone bounds: ``max_length`` (its context window), ``probe.layer`` / ``probe.intermediate_layer``
    (its depth), and the memory of ENS-MLP's K heads against what the planner takes the device's memory to be."""
    shape = model_shape(cfg.model, cfg.paths.cache_dir) or {}
    check_max_length(int(cfg.max_length), cfg.model, cfg.paths.cache_dir)
    layers = shape.get("num_hidden_layers")
    probe = cfg.get("probe") or {}
    if isinstance(layers, int) and not isinstance(layers, bool):
        for key in ("layer", "intermediate_layer"):
            value = probe.get(key)
            if not isinstance(value, int) or isinstance(value, bool):
                continue   # null / none: chosen from the depth; anything else: refused by the bounds already
            # hidden_states has layers + 1 entries (0: the embeddings); the feature probes also read -1 (after the
            # final norm), BoRP's contrastive probe any index of hidden_states
            low = -(layers + 1) if probe.get("kind") == "borp_contrastive" else -1
            if not low <= value <= layers:
                allowed = f"{low}..{layers}" if low < -1 else f"-1 (the last, after the final norm) or 0..{layers}"
                raise UserError(f"probe.{key}={value} is out of range for model '{cfg.model.get('name')}' "
                                f"({layers} layer{'s' if layers != 1 else ''}): allowed {allowed}")
    check_head_memory(cfg, shape)


def check_head_memory(cfg: DictConfig, shape: dict) -> None:
    """A head whose size is set by its settings must fit the memory the planner takes the device to have
    (``plan.device_memory_gib``, else an H100's on a GPU, the host's available memory on a CPU): the method's own
    check (``check_fits`` of its class, e.g. ENS-MLP's K heads), refused before anything is loaded."""
    from rewarduq_exp.methods.registry import method_class, method_name_of_target

    name = method_name_of_target(cfg.method.get("_target_"))
    check = getattr(method_class(name), "check_fits", None) if name else None
    d = shape.get("hidden_size") or cfg.model.get("hidden_size")
    if check is None or not (isinstance(d, int) and d > 0):
        return
    from rewarduq_exp.models.backbone import resolve_device
    from rewarduq_exp.models.memory_plan import device_memory

    check(cfg.method, d, device_memory(cfg, resolve_device(str(cfg.get("device", "auto"))).type))


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
