"""The trained runs a downstream task studies, and the world they were trained in.

Downstream tasks need a gold reward, so they accept runs trained on the synthetic world (``dataset=synthetic``, its
true reward) or on the VADER sentences (``dataset=vader_pairs``, or ``vader_ratings`` for BoRP: the crowd's mean
rating, :mod:`~rewarduq_exp.downstream.vader_gold`). The world is rebuilt from the run's own dataset config, so
candidates and labels come from the distribution the model was trained on. ``run=`` may name run folders or sweep
folders; every completed run below them is used, and runs that did not complete are listed and skipped (a failed
point of a sweep does not stop the study). A run's config is read as any run folder is (``read_run_config``): it
builds only this package's methods and loaders.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.registry import build_loader, check_untrusted_dataset
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.data.vader_ratings import VaderPairs, VaderRatings
from rewarduq_exp.downstream.vader_gold import VaderGold
from rewarduq_exp.runner.trained_run import read_run_config, run_cache_dir
from rewarduq_exp.runs.run_records import RunRecord, find_runs

SYNTHETIC_WORLD = f"{SyntheticWorld.__module__}.{SyntheticWorld.__qualname__}"
VADER_WORLDS = {f"{c.__module__}.{c.__qualname__}" for c in (VaderPairs, VaderRatings)}
ALLOWED = "dataset=synthetic (its true reward) or dataset=vader_pairs / vader_ratings (the human ratings)"

log = logging.getLogger("rewarduq_exp")


@dataclass
class WorldRun:
    record: RunRecord
    config: DictConfig  # the run's resolved config
    label: str          # short and unique within the study: the method, plus what sets its runs apart

    @property
    def path(self) -> Path:
        return self.record.path


def run_paths(run) -> list[str]:
    if run is None or (isinstance(run, str) and not run.strip()):
        raise UserError("run= is missing; give a run folder or a sweep folder trained on dataset=synthetic or "
                        "dataset=vader_pairs (e.g. run=outputs/multirun/<sweep>)")
    return [str(r) for r in run] if isinstance(run, (list, tuple, ListConfig)) else [str(run)]


def world_of(config: DictConfig, config_path: Path | str = ".hydra/config.yaml") -> SyntheticWorld | VaderGold:
    """The world of a run's config (``config_path``: its ``.hydra/config.yaml``, named in errors). The dataset node
    is a run folder's, so it may build only this package's loaders, and here only the worlds with a gold reward: the
    class is compared by its full path, never by how its name ends."""
    check_untrusted_dataset(config.get("dataset"), str(config_path))
    target = config.dataset.get("_target_")
    if target == SYNTHETIC_WORLD:
        world = build_loader(config.dataset)
    elif target in VADER_WORLDS:
        # A relative cache_dir was relative to where the run was launched (the sdist is found there, no download)
        node = OmegaConf.create(OmegaConf.to_container(config.dataset, resolve=True))
        node.cache_dir = str(run_cache_dir(Path(config_path).parent.parent, str(node.cache_dir)))
        world = VaderGold(build_loader(node))
    else:
        world = None
    if not isinstance(world, (SyntheticWorld, VaderGold)):
        raise UserError(f"downstream tasks need runs trained on {ALLOWED}; this run was trained on dataset "
                        f"'{config.dataset.get('name')}'")
    return world


def completed_world_runs(run) -> list[WorldRun]:
    """The completed runs below ``run`` (a path or list of paths), each with its config; one line for none."""
    records = find_runs(run_paths(run))
    done = [r for r in records if r.state == "completed"]
    for r in records:
        if r.state != "completed":
            log.warning("skipping %s: %s%s", r.path, r.state, f" ({r.error})" if r.error else "")
    if not done:
        raise UserError(f"no completed runs under {', '.join(run_paths(run))}; train them first")
    configs = []
    for r in done:
        _, config = read_run_config(r.path)  # checked: only this package's methods and loaders
        world_of(config, r.path / ".hydra" / "config.yaml")  # refuse a run from another dataset before any work
        configs.append(config)
    labels = run_labels([r.method for r in done], configs, [r.path.name for r in done])
    return [WorldRun(r, c, label) for r, c, label in zip(done, configs, labels)]


# The settings that tell a method's runs apart in a label (a sweep's axes); paths and bookkeeping are left out.
LABEL_SECTIONS = ("seed", "dataset", "method", "model", "probe")


def _label_settings(config: DictConfig) -> dict[str, str]:
    flat = {}
    for section in LABEL_SECTIONS:
        node = config.get(section)
        if isinstance(node, DictConfig):
            for key, value in OmegaConf.to_container(node, resolve=False).items():
                if not key.startswith("_") and not isinstance(value, (dict, list)) and key not in ("cache_dir", "path"):
                    flat[f"{section}.{key}"] = str(value)
        elif node is not None:
            flat[section] = str(node)
    return flat


# Settings shown under a name of their own: the world's seed is not the model's (the top-level ``seed``).
LABEL_NAMES = {"dataset.seed": "world"}


def _label_names(keys: list[str], values: dict[str, list[str]]) -> dict[str, str]:
    """The name each varying key is shown under: its last part (``dataset.filler_bias`` -> ``filler_bias``), or its
    name in ``LABEL_NAMES``. A key that repeats another of the same name run for run (``method.seed`` copying
    ``seed``) is dropped; when names still clash, the top-level key keeps its name and the others show their whole
    key (``seed=1,method.seed=3``), so a label never holds one name twice."""
    short = {k: LABEL_NAMES.get(k, k.rsplit(".", 1)[-1]) for k in keys}
    kept: list[str] = []
    for k in sorted(keys, key=lambda k: (k.count("."), k)):   # the top-level key first: it is the one kept
        if not any(short[j] == short[k] and values[j] == values[k] for j in kept):
            kept.append(k)
    names = {}
    for k in kept:
        clash = [j for j in kept if short[j] == short[k]]
        names[k] = short[k] if len(clash) == 1 or k == short[k] else k
    return names


def run_labels(methods: list[str], configs: list[DictConfig], folders: list[str]) -> list[str]:
    """Short labels, unique within a study: the method alone when it has one run, else the method and the settings
    in which its runs differ (``ens_mlp/filler_bias=1,world=0,seed=1``), else the folder name (runs that differ in
    nothing listed, e.g. two copies of one run). A setting is named by the last part of its key, except the world's
    seed (``dataset.seed``), shown as ``world=`` apart from the model's ``seed=``; a key that merely repeats another
    of the same name (``method.seed`` = ``seed``) is shown once, and when two keys would still share a name the
    nested one shows its whole key (``method.seed=3``). Order: the other settings by key, then ``world=``, then
    ``seed=`` last."""
    settings = [_label_settings(c) for c in configs]
    labels = []
    for i, method in enumerate(methods):
        peers = [j for j, m in enumerate(methods) if m == method]
        if len(peers) == 1:
            labels.append(method)
            continue
        keys = sorted({k for j in peers for k in settings[j]})
        values = {k: [settings[j].get(k) for j in peers] for k in keys}
        varying = [k for k in keys if len(set(values[k])) > 1]
        names = _label_names(varying, values)
        # the world, then the model's seed, after every other setting
        shown = sorted(names, key=lambda k: (1 if k == "dataset.seed" else 2 if "seed" in (k, names[k]) else 0, k))
        labels.append(f"{method}/" + ",".join(f"{names[k]}={settings[i].get(k)}" for k in shown))
    if len(set(labels)) < len(labels):  # not told apart by their settings: fall back to the folders
        return [m if methods.count(m) == 1 else f"{m}/{f}" for m, f in zip(methods, folders)]
    return labels
