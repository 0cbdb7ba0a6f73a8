"""A completed run folder back as a ready method: its config, its backbone, its trained parameters.

``evaluate.py run=<folder>`` and the Python API (``rewarduq_exp.load_run``) both rebuild a run through
:func:`load_trained_method`, so they score with exactly the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.base import load_method
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.features import FeatureEncoder
from rewarduq_exp.runs.run_folder import RunFolder


@dataclass
class TrainedRun:
    folder: RunFolder
    config: DictConfig   # the run's resolved config (.hydra/config.yaml)
    method: object       # the method, trained parameters loaded, ready to score
    backbone: Backbone


def read_run_config(run_dir) -> tuple[RunFolder, DictConfig]:
    """The folder and config of a completed run; a one-line error for anything else."""
    folder = RunFolder(run_dir)
    config_path = folder.root / ".hydra" / "config.yaml"
    if not config_path.exists():
        raise UserError(f"run={folder.root} is not a run folder (no .hydra/config.yaml)")
    state = folder.status().get("state", "missing")
    if state != "completed":
        raise UserError(f"run={folder.root} did not complete (status: {state}); train it first")
    return folder, OmegaConf.load(config_path)


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
                        feature_store=None) -> TrainedRun:
    """Rebuild the run's method from ``model/method.json`` (the class and hyperparameters it was trained with) and
    load what ``save`` wrote beside it. The backbone comes from the run's model config (hub id, local path or the tiny
    builder; ``backbone_path`` points at a checkpoint that moved, ``dtype`` overrides the run's) through ``cache_dir``
    (default: the run's own). Feature-head methods keep the features of what they score in ``feature_store``
    (default: the disk cache under ``cache_dir``; the Python API passes a bounded in-memory store). ``batch_size``
    sets the sequences per forward pass when scoring."""
    folder, run_cfg = read_run_config(run_dir)
    if cache_dir is None:
        cache_dir = run_cache_dir(folder.root, str(run_cfg.paths.cache_dir))
    model_cfg, probe_cfg = OmegaConf.create(OmegaConf.to_container(run_cfg.model, resolve=True)), run_cfg.probe
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
