"""A completed run folder back as a ready method: its config, its backbone, its trained parameters.

``evaluate.py run=<folder>`` and the Python API (``rewarduq_exp.load_run``) both rebuild a run through
:func:`load_trained_method`, so they score with exactly the same model.

A run folder is a file someone may have handed you (copied from another cluster, downloaded), so reading one never
executes code it names: its config may build only this package's methods and dataset loaders
(:func:`read_run_config`), ``model/method.json`` names a method of the registry with checked hyperparameters
(``load_method``), and a backbone whose config asks for ``trust_remote_code`` loads only when the caller allows it
(:func:`run_model_config`); each refusal is one line naming the file and the field. Its config is read as data
(:func:`load_run_config_file`): no resolver runs and nothing of the environment is read, so reading a run writes
nothing outside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError, first_line, one_line
from rewarduq_exp.core.foreign_config import read_foreign_config
from rewarduq_exp.data.registry import check_untrusted_dataset
from rewarduq_exp.methods.base import load_method, read_saved_method
from rewarduq_exp.methods.registry import allowed_classes, method_name_of_target
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.features import FeatureEncoder
from rewarduq_exp.runs.run_folder import RunFolder


@dataclass
class TrainedRun:
    folder: RunFolder
    config: DictConfig   # the run's resolved config (.hydra/config.yaml)
    method: object       # the method, trained parameters loaded, ready to score
    backbone: Backbone


def read_run_config(run_dir, paths: dict | None = None) -> tuple[RunFolder, DictConfig]:
    """The folder and config of a completed run, its config read as data (:func:`load_run_config_file`; ``paths``:
    this machine's ``paths.<key>`` folders, which win over the run's) and checked
    (:func:`check_untrusted_run_config`); a one-line error for anything else."""
    folder = RunFolder(run_dir)
    config_path = folder.root / ".hydra" / "config.yaml"
    if not config_path.exists():
        raise UserError(f"run={folder.root} is not a run folder (no .hydra/config.yaml)")
    state = folder.status().get("state", "missing")
    if state != "completed":
        raise UserError(f"run={folder.root} did not complete (status: {state}); train it first")
    config = load_run_config_file(config_path, paths)
    check_untrusted_run_config(config, config_path)
    return folder, config


def load_run_config_file(config_path: Path, paths: dict | None = None) -> DictConfig:
    """A run's ``.hydra/config.yaml`` read as data (:func:`rewarduq_exp.core.foreign_config.read_foreign_config`):
    bounded, references to its own settings resolved, no resolver called, nothing of the environment read; one line
    naming the file and the key otherwise."""
    return read_foreign_config(config_path, paths=paths)


def check_untrusted_run_config(config: DictConfig, config_path: Path) -> None:
    """What a run's config may build when the run is read back: a method of this package's registry and one of its
    dataset loaders (evaluate.py builds the run's dataset when no dataset= is given); a ``model.trust_remote_code``
    that is true or false. Each refusal is one line naming the file and the field."""
    method_cfg = config.get("method")
    if method_cfg is not None:
        target = method_cfg.get("_target_") if isinstance(method_cfg, DictConfig) else None
        if method_name_of_target(target) is None:
            raise UserError(one_line(f"{config_path}: method._target_ names {target!r}, not a method of "
                                     f"rewarduq_exp (allowed: {allowed_classes()})"))
    if config.get("dataset") is not None:
        check_untrusted_dataset(config.dataset, str(config_path))
    model_cfg = config.get("model")
    if isinstance(model_cfg, DictConfig) and not isinstance(model_cfg.get("trust_remote_code", False), bool):
        raise UserError(one_line(f"{config_path}: model.trust_remote_code is "
                                 f"{model_cfg.get('trust_remote_code')!r}, not true or false"))


def run_model_config(run_cfg: DictConfig, config_path: Path, *, trust_remote_code: bool) -> DictConfig:
    """The run's model config, resolved. A run whose config turns ``model.trust_remote_code`` on loads its backbone
    with it only when the caller allows it (``trust_remote_code=True``): a run folder's say-so alone would let it run
    any code that comes with the checkpoint it points at. Without that, one line says how to allow it."""
    if not isinstance(trust_remote_code, bool):
        raise UserError(f"trust_remote_code={trust_remote_code!r} is invalid: must be true or false")
    model_cfg = OmegaConf.create(OmegaConf.to_container(run_cfg.model, resolve=True))
    wanted = model_cfg.get("trust_remote_code", False)
    if not isinstance(wanted, bool):
        raise UserError(one_line(f"{config_path}: model.trust_remote_code is {wanted!r}, not true or false"))
    if wanted and not trust_remote_code:
        raise UserError(f"{config_path}: model.trust_remote_code is true: loading this run's backbone "
                        f"('{model_cfg.get('name')}') would run code that comes with its checkpoint; if you trust "
                        "the run folder and that checkpoint, allow it with load_run(..., trust_remote_code=True) or "
                        "trust_remote_code=true on the command line of evaluate.py / downstream.py")
    model_cfg.trust_remote_code = wanted
    if model_cfg.get("builder") == "tiny-qwen3":
        from rewarduq_exp.models.tiny_qwen3 import checked_build

        try:   # the tiny model's build settings reach a call: only its own numbers
            checked_build(model_cfg.get("build"))
        except UserError as err:
            raise UserError(one_line(f"{config_path}: {err}")) from None
    return model_cfg


def run_method_settings(run_cfg: DictConfig, config_path: Path) -> tuple[str, dict]:
    """(method name, settings) of the run's method config, for building a fresh, untrained copy of the method (what
    ``downstream.py task=active_learning`` retrains): the name from the registry by the config's ``_target_``, and
    only settings of that method with plain values (:func:`rewarduq_exp.methods.registry.check_settings`; runtime
    settings such as ``device`` included, as a run's config holds them)."""
    from rewarduq_exp.methods.registry import check_settings

    method_cfg = run_cfg.get("method")
    target = method_cfg.get("_target_") if isinstance(method_cfg, DictConfig) else None
    name = method_name_of_target(target)
    if name is None:
        raise UserError(one_line(f"{config_path}: method._target_ names {target!r}, not a method of rewarduq_exp "
                                 f"(allowed: {allowed_classes()})"))
    try:
        values = OmegaConf.to_container(method_cfg, resolve=True)
    except Exception as err:  # noqa: BLE001 (an interpolation that does not resolve: OmegaConf's errors vary)
        raise UserError(one_line(f"{config_path}: method does not resolve ({type(err).__name__}: "
                                 f"{first_line(err)})")) from None
    values.pop("_target_", None)
    return name, check_settings(name, values, str(config_path), "method.", runtime=True)


def run_cache_dir(run_dir: Path, configured: str) -> Path:
    """The run's ``paths.cache_dir``: as written when absolute; when relative it was relative to the directory the
    run was launched from, taken as the working directory or the first ancestor of the run folder where it exists."""
    path = Path(configured)
    if path.is_absolute():
        return path
    for base in (Path.cwd(), *Path(run_dir).resolve().parents):
        if (base / path).is_dir():
            return base / path
    return Path.cwd() / path


def load_trained_method(run_dir, *, device: str, cache_dir=None, progress: bool, max_length: int | None = None,
                        dtype: str | None = None, batch_size: int | None = None, backbone_path=None,
                        feature_store=None, trust_remote_code: bool = False) -> TrainedRun:
    """Rebuild the run's method from ``model/method.json`` (the method and hyperparameters it was trained with) and
    load what ``save`` wrote beside it. The backbone comes from the run's model config (hub id, local path or the tiny
    builder; ``backbone_path`` points at a checkpoint that moved, ``dtype`` overrides the run's) through ``cache_dir``
    (default: the run's own ``paths.cache_dir``, which only ``downstream.py`` with ``paths.cache_dir: null`` asks for;
    ``evaluate.py`` passes its own config's, and ``load_run`` its argument or a temporary folder, so that reading a
    run folder writes nothing where its config points); a config with ``model.trust_remote_code: true`` is refused
    unless ``trust_remote_code=True``. Feature-head methods keep the features of what they score in ``feature_store``
    (default: the disk cache under ``cache_dir``; the Python API passes a bounded in-memory store). ``batch_size``
    sets the sequences per forward pass when scoring. The config and ``method.json`` are checked before any model
    is touched."""
    folder, run_cfg = read_run_config(run_dir)
    model_cfg = run_model_config(run_cfg, folder.root / ".hydra" / "config.yaml", trust_remote_code=trust_remote_code)
    read_saved_method(folder.model_dir)  # a hostile or damaged method.json is refused before the backbone loads
    if cache_dir is None:
        cache_dir = run_cache_dir(folder.root, str(run_cfg.paths.cache_dir))
    probe_cfg = run_cfg.probe
    if backbone_path is not None:
        model_cfg.path, model_cfg.builder = str(backbone_path), None  # a local path wins over the hub id
    if dtype is not None:
        model_cfg.dtype = str(dtype)
    runtime = {}
    if batch_size is not None:
        check_positive(batch_size, "batch_size", integer=True)
        probe_cfg = OmegaConf.merge(probe_cfg, {"batch_size": int(batch_size)})
        runtime["score_batch_size"] = int(batch_size)
    backbone = Backbone(model_cfg, cache_dir=cache_dir, device=device)
    _ = backbone.source  # a moved or missing local checkpoint fails here, in one line, not at the first score
    store = feature_store if feature_store is not None else Path(cache_dir) / "features"
    encoder = FeatureEncoder(backbone, probe_cfg, store, int(max_length or run_cfg.max_length),
                             show_progress=bool(progress))
    method = load_method(folder.model_dir, encoder=encoder, device=device, show_progress=bool(progress), **runtime)
    return TrainedRun(folder, run_cfg, method, backbone)
