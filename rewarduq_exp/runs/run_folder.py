"""The run folder: one self-describing directory per run that everything downstream reads.

``.hydra/`` (written by Hydra), ``status.json`` (running | completed | failed, error, timings, config hash),
``metrics.json`` (one object per evaluated dataset), ``predictions/<dataset>.parquet``, ``figures/<dataset>/``,
``model/`` (what the method's ``save`` wrote), ``data_summary.json``, ``train.log``. Every file is written to a
temporary name and renamed, so a killed run never leaves a half-written result.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from pathlib import Path

import pandas as pd
from filelock import FileLock

from rewarduq_exp.core.atomic_write import atomic_path, write_atomic
from rewarduq_exp.core.errors import one_line
from rewarduq_exp.runs.run_identity import VALIDATION, config_hash, is_completed  # noqa: F401 (config_hash: API)


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1, default=str) + "\n")


class RunFolder:
    def __init__(self, root: str | os.PathLike, writer: bool = True):
        self.root = Path(root)
        # Under torchrun / accelerate every process holds a RunFolder on the same directory; only the main one is
        # the writer (status, metrics, predictions). The others read, and write only a failure of their own (below).
        self.writer = writer
        # What the run is doing: "validation" until its settings are checked (a failure then means the settings
        # are invalid, not that training broke; selection lists such runs apart), then "running".
        self.stage = VALIDATION

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
        return is_completed(self.root, chash)

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
        for key in ("error", "traceback", "stage"):
            st.pop(key, None)
        write_json(self.status_path, st)

    def fail(self, err: BaseException, with_traceback: bool = True) -> None:
        # Every process records its own failure: when a non-main process dies the launcher kills the main one with
        # SIGTERM (no Python exception), so otherwise status.json would say "running" forever.
        st = self.status()
        st.update(state="failed", finished_at=_now(), error=f"{type(err).__name__}: {one_line(err)}", stage=self.stage)
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
        """Write ``metrics.json``; ``merge`` adds/replaces these blocks and keeps the others. The read-merge-write
        runs under a file lock, so two ``evaluate.py`` runs finishing together on one run folder both land."""
        if not self.writer:
            return
        if not merge:
            write_json(self.metrics_path, blocks)
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.root / ".metrics.json.lock")):
            write_json(self.metrics_path, {**self.read_metrics(), **blocks})

    def write_predictions(self, dataset: str, frame: pd.DataFrame) -> Path:
        path = self.predictions_path(dataset)
        if not self.writer:
            return path
        with atomic_path(path) as tmp:
            frame.to_parquet(tmp, index=False)
        return path


def _rank() -> int:
    from rewarduq_exp.core.distributed import rank

    return rank()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
