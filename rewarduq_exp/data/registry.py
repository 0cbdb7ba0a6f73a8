"""Dataset names: ``conf/dataset/<name>.yaml`` builds a loader; ``<name>_<split>`` names one of its splits.

A loader (``_target_`` of a dataset config) has ``name``, ``train_split``, ``eval_splits`` and ``load(split)``, which
returns a frame in the preference-data contract. Evaluated datasets are called ``<name>_<split>`` (e.g.
``synthetic_eval``, ``synthetic_ood``); that is the key of their metrics block and the name of their predictions
file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def available(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The options of a config group, nested ones by their path (``label_ranking/iris``)."""
    root = conf_dir / group
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))


@dataclass
class EvalSet:
    """One evaluated dataset: its report name, the loader config and the split."""

    name: str
    config: DictConfig
    split: str


def build(node: DictConfig, key: str, **kwargs):
    """``instantiate`` with user errors surfaced as one line instead of Hydra's wrapped traceback."""
    import inspect

    from hydra.errors import InstantiationException
    from hydra.utils import get_class

    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, TypeError) and "unexpected keyword argument" in str(cause):
            params = inspect.signature(get_class(node._target_)).parameters
            allowed = [p for p in params if p not in ("self", "common", "encoder")]
            bad = str(cause).split("argument")[-1].strip(" '")
            raise UserError(f"{key}.{bad} is not a setting of {node._target_.rsplit('.', 1)[-1]}; "
                            f"allowed: {', '.join(allowed)}") from None
        raise


def build_loader(dataset_cfg: DictConfig):
    missing = sorted(OmegaConf.missing_keys(dataset_cfg))
    if missing:  # e.g. dataset=local named by evaluate.py without its file: one line, not OmegaConf's report
        keys = ", ".join(f"dataset.{k.removeprefix('dataset.')}" for k in missing)
        raise UserError(f"dataset '{dataset_cfg.get('name')}' needs {keys}: pass {keys.split(', ')[0]}=<value>")
    return build(dataset_cfg, "dataset")


def load_dataset_config(name: str, seed: int, paths=None, conf_dir: Path = CONF_DIR) -> DictConfig:
    path = conf_dir / "dataset" / f"{name}.yaml"
    if not path.exists():
        raise UserError(f"unknown dataset '{name}'; allowed: {', '.join(available('dataset', conf_dir))}")
    # Dataset configs interpolate root keys such as ${seed} and ${paths.datasets_dir}; give them a root.
    paths = OmegaConf.to_container(paths, resolve=True) if isinstance(paths, DictConfig) else dict(paths or {})
    paths.setdefault("datasets_dir", None)
    paths.setdefault("label_ranking_dir", None)
    paths.setdefault("cache_dir", "outputs/cache")
    root = OmegaConf.create({"seed": seed, "paths": paths, "dataset": OmegaConf.load(path)})
    node = root.dataset
    OmegaConf.resolve(root)
    return node


def resolve_eval_sets(names, train_cfg: DictConfig | None, seed: int, paths=None, also=(),
                      conf_dir: Path = CONF_DIR) -> list[EvalSet]:
    """Turn ``eval_datasets`` entries (``<name>`` or ``<name>_<split>``) into eval sets.

    ``None`` means the training dataset's own eval splits plus ``also`` (``also_evaluate``: the paper's tuned
    configs add RewardBench). A name that matches the training dataset uses the run's
    dataset config (with its command-line overrides), so the synthetic world's eval splits come from the same world.
    """
    if names is None:
        if train_cfg is None:
            raise UserError("no dataset to evaluate: pass dataset=<name> (or <name>_<split>)")
        own = [EvalSet(f"{train_cfg.name}_{s}", train_cfg, s) for s in train_cfg.eval_splits]
        return own + (resolve_eval_sets(list(also), train_cfg, seed, paths, (), conf_dir) if also else [])
    if isinstance(names, str):
        names = [names]
    known = set(available("dataset", conf_dir))
    out: list[EvalSet] = []
    for entry in names:
        entry = str(entry)
        base, split = entry, None
        if entry not in known and "_" in entry:
            base, split = entry.rsplit("_", 1)
        if train_cfg is not None and base == train_cfg.name:
            cfg = train_cfg
        elif base in known:
            cfg = load_dataset_config(base, seed, paths, conf_dir)
        else:
            names_list = ", ".join(sorted(known))
            raise UserError(f"unknown eval dataset '{entry}'; use <name> or <name>_<split> with name in: {names_list}")
        splits = [split] if split is not None else list(cfg.eval_splits)
        for s in splits:
            out.append(EvalSet(f"{cfg.name}_{s}", cfg, s))
    return out


def _check_option_keys(node: DictConfig, options: dict, prefix: str, dataset: str) -> None:
    for key, value in options.items():
        allowed = [k for k in node.keys() if k not in ("_target_", "name")]
        if key not in allowed:
            raise UserError(f"{prefix}{key} is not a setting of dataset '{dataset}'; allowed: "
                            f"{', '.join(prefix + k for k in allowed) or '(none)'}")
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            if not isinstance(value, dict):
                raise UserError(f"{prefix}{key} is a group of settings, not one value; set them one by one, "
                                f"e.g. {prefix}{key}.{next(iter(child.keys()), '<key>')}=<value>")
            _check_option_keys(child, value, f"{prefix}{key}.", dataset)


def with_options(eval_sets: list[EvalSet], options: dict | None) -> list[EvalSet]:
    """The eval sets with ``options`` (``dataset.<key>=...`` given to evaluate.py) set in each one's loader config.

    Every evaluated dataset must have every key (a key it lacks is a UserError naming the allowed keys). Each eval
    set gets its own resolved copy, so the run's own config (and its interpolations) stays as it was.
    """
    if not options:
        return list(eval_sets)
    out = []
    for es in eval_sets:
        _check_option_keys(es.config, options, "dataset.", str(es.config.name))
        config = OmegaConf.create(OmegaConf.to_container(es.config, resolve=True))
        out.append(replace(es, config=OmegaConf.merge(config, options)))
    return out
