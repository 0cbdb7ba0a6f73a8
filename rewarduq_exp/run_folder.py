"""The run folder (DESIGN section 3): one self-describing directory per run that everything downstream reads.

``.hydra/`` (written by Hydra), ``status.json`` (running | completed | failed, error, timings, config hash),
``metrics.json`` (one object per evaluated dataset), ``predictions/<dataset>.parquet``, ``figures/<dataset>/``,
``model/`` (what the method's ``save`` wrote), ``data_summary.json``, ``train.log``. Every file is written to a
temporary name and renamed, so a killed run never leaves a half-written result.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.backbone import stable_hash
from rewarduq_exp.errors import one_line
from rewarduq_exp.feature_cache import write_atomic

# Keys that do not change a run's numbers: they are left out of its identity (config hash).
NON_IDENTITY_KEYS = ("force", "progress", "logger", "paths", "sweep_name")


def config_hash(cfg: DictConfig) -> str:
    container = OmegaConf.to_container(cfg, resolve=True)
    for key in NON_IDENTITY_KEYS:
        container.pop(key, None)
    method = container.get("method", {})
    if isinstance(method, dict):
        method.pop("show_progress", None)
    return stable_hash(container, n=12)


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1, default=str) + "\n")


class RunFolder:
    def __init__(self, root: str | os.PathLike, writer: bool = True):
        self.root = Path(root)
        # Under torchrun / accelerate every process holds a RunFolder on the same directory; only the main one is
        # the writer (status, metrics, predictions). The others read, and write only a failure of their own (below).
        self.writer = writer

    # ------------------------------------------------------------------ paths
    @property
    def status_path(self) -> Path:
        return self.root / "status.json"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.json"

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    def predictions_path(self, dataset: str) -> Path:
        return self.root / "predictions" / f"{dataset}.parquet"

    def figures_dir(self, dataset: str) -> Path:
        return self.root / "figures" / dataset

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        if not self.status_path.exists():
            return {}
        return json.loads(self.status_path.read_text())

    def is_completed(self, chash: str) -> bool:
        st = self.status()
        return st.get("state") == "completed" and st.get("config_hash") == chash and self.metrics_path.exists()

    def start(self, chash: str) -> None:
        self._started = time.time()
        if not self.writer:
            return
        write_json(self.status_path, {"state": "running", "config_hash": chash, "started_at": _now(),
                                      "host": socket.gethostname(), "pid": os.getpid()})

    def finish(self, **info) -> None:
        if not self.writer:
            return
        st = self.status()
        st.update(state="completed", finished_at=_now(), seconds=round(time.time() - self._started, 2), **info)
        st.pop("error", None)
        st.pop("traceback", None)
        write_json(self.status_path, st)

    def fail(self, err: BaseException, with_traceback: bool = True) -> None:
        # Every process records its own failure: when a non-main process dies the launcher kills the main one with
        # SIGTERM (no Python exception), so otherwise status.json would say "running" forever.
        st = self.status()
        st.update(state="failed", finished_at=_now(), error=f"{type(err).__name__}: {one_line(err)}")
        if not self.writer:
            st["failed_rank"] = _rank()
        if hasattr(self, "_started"):
            st["seconds"] = round(time.time() - self._started, 2)
        if with_traceback:
            st["traceback"] = traceback.format_exc()
        write_json(self.status_path, st)

    # ------------------------------------------------------------------ results
    def read_metrics(self) -> dict:
        if not self.metrics_path.exists():
            return {}
        return json.loads(self.metrics_path.read_text())

    def write_metrics(self, blocks: dict[str, dict], merge: bool = False) -> None:
        if not self.writer:
            return
        data = {**self.read_metrics(), **blocks} if merge else blocks
        write_json(self.metrics_path, data)

    def write_predictions(self, dataset: str, frame: pd.DataFrame) -> Path:
        path = self.predictions_path(dataset)
        if not self.writer:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            frame.to_parquet(tmp, index=False)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path


def _rank() -> int:
    from rewarduq_exp.distributed import rank

    return rank()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
