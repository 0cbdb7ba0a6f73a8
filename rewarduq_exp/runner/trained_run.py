"""A completed run folder back as a ready method: its config, its backbone, its trained parameters.

``evaluate.py run=<folder>`` and the Python API (``rewarduq_exp.load_run``) both rebuild a run through
:func:`load_trained_method`, so they score with exactly the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

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
                        ) -> TrainedRun:
    """Rebuild the run's method from ``model/method.json`` (the class and hyperparameters it was trained with) and
    load what ``save`` wrote beside it. The backbone comes from the run's model config (hub id, local path or the tiny
    builder) through ``cache_dir`` (default: the run's own), where feature-head methods also cache the features of
    what they score."""
    folder, run_cfg = read_run_config(run_dir)
    if cache_dir is None:
        cache_dir = run_cache_dir(folder.root, str(run_cfg.paths.cache_dir))
    backbone = Backbone(run_cfg.model, cache_dir=cache_dir, device=device)
    encoder = FeatureEncoder(backbone, run_cfg.probe, Path(cache_dir) / "features",
                             int(max_length or run_cfg.max_length), show_progress=bool(progress))
    method = load_method(folder.model_dir, encoder=encoder, device=device, show_progress=bool(progress))
    return TrainedRun(folder, run_cfg, method, backbone)
