"""Dataset names: ``conf/dataset/<name>.yaml`` builds a loader; ``<name>_<split>`` names one of its splits.

A loader (``_target_`` of a dataset config) has ``name``, ``train_split``, ``eval_splits`` and ``load(split)``, which
returns a frame in the preference-data contract. Evaluated datasets are called ``<name>_<split>`` (e.g.
``synthetic_eval``, ``synthetic_ood``); that is the key of their metrics block and the name of their predictions
file.

A dataset config read from a run folder (a file someone may have handed you) builds only the loaders this package's
own ``conf/dataset`` files name (:func:`check_untrusted_dataset`): ``instantiate`` calls whatever ``_target_`` says.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, replace
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.checks import check_like_default
from rewarduq_exp.core.config_dir import CONF_DIR  # (the CLI checks, the planner and the shapes read it from here)
from rewarduq_exp.core.errors import UserError, first_line, one_line


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


# Keys with which a config asks Hydra's ``instantiate`` for more than "call _target_ with these settings".
_INSTANTIATE_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")


@functools.lru_cache(maxsize=None)
def loader_targets(conf_dir: Path = CONF_DIR) -> frozenset[str]:
    """The loader classes this package's own dataset configs (``conf/dataset/**.yaml``) name: the only ones a
    dataset config read from a run folder may build."""
    targets = set()
    for path in (conf_dir / "dataset").rglob("*.yaml"):
        target = OmegaConf.to_container(OmegaConf.load(path), resolve=False).get("_target_")
        if isinstance(target, str):
            targets.add(target)
    return frozenset(targets)


def loader_class(target) -> type | None:
    """The loader class of ``target`` when it is one of :func:`loader_targets` (imported from that list, never
    from any other string), else None."""
    if not isinstance(target, str) or target not in loader_targets():
        return None
    module, _, qualname = target.rpartition(".")
    return getattr(importlib.import_module(module), qualname)


def check_untrusted_dataset(dataset_cfg, where: str, prefix: str = "dataset") -> None:
    """Refuse, in one line naming ``where`` (the file) and the field, a dataset config from a file someone else
    wrote (a run folder's ``.hydra/config.yaml``) that would make :func:`build_loader` build anything but one of this
    package's loaders: its ``_target_`` must be one of :func:`loader_targets`, no value inside it may ask Hydra to
    build an object of its own (a nested ``_target_``) or change how it builds (``_args_``, ``_partial_``, ...), and
    every other key must be a setting of that loader."""
    if not isinstance(dataset_cfg, DictConfig):
        raise UserError(f"{where}: {prefix} is not a mapping of settings")
    try:
        node = OmegaConf.to_container(dataset_cfg, resolve=True)
    except Exception as err:  # noqa: BLE001 (an interpolation that does not resolve: OmegaConf's errors vary)
        raise UserError(one_line(f"{where}: {prefix} does not resolve ({type(err).__name__}: "
                                 f"{first_line(err)})")) from None
    target = node.get("_target_")
    if target not in loader_targets():
        raise UserError(one_line(f"{where}: {prefix}._target_ names {target!r}, not a dataset loader of "
                                 f"rewarduq_exp (allowed: {', '.join(sorted(loader_targets()))})"))

    def walk(value, field: str, top: bool) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                if key in _INSTANTIATE_KEYS and not (top and key == "_target_"):
                    raise UserError(one_line(f"{where}: {field}.{key} is not allowed in a dataset config read "
                                             "from a run folder (it would make Hydra build or call something "
                                             "else)"))
                walk(child, f"{field}.{key}", False)
        elif isinstance(value, list):
            for i, child in enumerate(value):
                walk(child, f"{field}[{i}]", False)

    walk(node, prefix, True)
    # Every other key becomes a keyword of the loader: one it does not take is named here, with the file.
    import inspect

    params = inspect.signature(loader_class(target)).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for key in node:
            if key != "_target_" and key not in params:
                raise UserError(one_line(f"{where}: {prefix}.{key} is not a setting of {target.rsplit('.', 1)[-1]}; "
                                         f"allowed: {', '.join(params)}"))


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
        out = [EvalSet(f"{train_cfg.name}_{s}", train_cfg, s) for s in train_cfg.eval_splits]
        for entry in also:
            name, options = also_evaluate_entry(entry)
            out += with_options(resolve_eval_sets([name], train_cfg, seed, paths, (), conf_dir), options or None)
        return out
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


def also_evaluate_entry(entry) -> tuple[str, dict]:
    """One ``also_evaluate`` entry as (eval dataset name, its loader options): ``reward_bench``, or, to size or subset
    it, ``{name: synthetic_eval, n_eval: 200}`` (on the command line:
    ``'also_evaluate=[{name:synthetic_eval,n_eval:200}]'``)."""
    if isinstance(entry, DictConfig):
        entry = OmegaConf.to_container(entry, resolve=True)
    if isinstance(entry, dict):
        options = dict(entry)
        name = options.pop("name", None)
        if not isinstance(name, str) or not name:
            raise UserError(f"an also_evaluate entry with options needs its dataset as name: "
                            f"{{name: <dataset>[_<split>], <key>: <value>, ...}}, got {entry}")
        return name, options
    return str(entry), {}


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
        else:  # of the kind of the dataset's own value (dataset.n_eval=abc would fail inside the loader)
            check_like_default(f"{prefix}{key}", value, node.get(key))


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
