"""The run folder: one self-describing directory per run that everything downstream reads.

``.hydra/`` (the resolved config, Hydra's config, the overrides), ``status.json`` (running | completed | failed,
error, timings summed over the run's attempts and per attempt (:mod:`rewarduq_exp.runs.attempts`), config hash, owner
and heartbeat, library versions, threads), ``metrics.json`` (one object per evaluated
dataset), ``predictions/<dataset>.parquet``, ``figures/<dataset>/``, ``model/`` (what the method's ``save`` wrote),
``data_summary.json``, ``train.log``. Every file is written to a temporary name and renamed, so a killed run never
leaves a half-written result. Every JSON file is strict JSON: an undefined number (NaN, inf) is written as ``null``
and logged (:mod:`rewarduq_exp.core.strict_json`); :meth:`RunFolder.read_metrics` reads it back as NaN.

One run, one folder: a run writes nothing into its folder before :meth:`RunFolder.start` has claimed it, under a
lock, from what ``status.json`` says. A folder is free when it holds no run, a failed run, an interrupted one (its
process is gone, see ``run_owner``) or, on a relaunch, the same config unfinished; it is refused (one line,
:class:`RunFolderBusy`, nothing written) while another live process runs in it, or when it holds a completed run of
another config (unless ``force``). That is why Hydra does not write ``.hydra/`` itself here
(``hydra.output_subdir: null``): :meth:`write_config` does it once the folder is ours.

Every write stays inside the folder (:mod:`rewarduq_exp.core.inside_folder`): before a run claims it, and before
``evaluate.py`` writes or swaps anything in, a link or a non-folder where the results go is refused in one line; and
at every write (:mod:`rewarduq_exp.core.atomic_write`), so a link made while the run is under way is refused too,
and the run fails with that line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import traceback
from pathlib import Path

import pandas as pd
from filelock import FileLock

from rewarduq_exp.core import file_locks
from rewarduq_exp.core.atomic_write import atomic_path, write_atomic
from rewarduq_exp.core.errors import UserError, one_line
from rewarduq_exp.core.inside_folder import check_writes_inside
from rewarduq_exp.core.saved_files import read_json_object
from rewarduq_exp.core.strict_json import nulls_to_nan, write_json  # noqa: F401 (write_json: the runners' writer)
from rewarduq_exp.runs.attempts import attempt, earlier_attempts, recorded, total_seconds
from rewarduq_exp.runs.run_identity import (  # noqa: F401 (config_hash: API)
    COMPLETED,
    VALIDATION,
    config_hash,
    is_completed,
    read_status,
)
from rewarduq_exp.runs.run_owner import (
    INTERRUPTED,
    RUNNING,
    Heartbeat,
    describe_owner,
    heartbeat_interval,
    now_iso,
    owner_alive,
    this_owner,
)

log = logging.getLogger(__name__)

CLAIM_STALE_S = 30.0
# What a run writes, relative to its folder. TREES are rewritten inside (a save, a re-run's figures, the training
# checkpoint: training_checkpoint.CHECKPOINT_DIR, named here to keep this module free of torch): no link anywhere
# below them. FOLDERS must be real folders; what is inside is another program's (wandb makes links of its own
# there) or a mutex. FILES are results and lock files: a regular file or nothing.
TREES = (".hydra", "model", "predictions", "figures", "checkpoint")
FOLDERS = ("wandb", ".claiming")
METRICS_LOCK = ".metrics.json.lock"
FILES = ("status.json", "metrics.json", METRICS_LOCK, "data_summary.json", "train_history.json",
         "metrics_per_fold.json", "train.log")
# Libraries whose versions change a run's numbers in the last decimals: recorded in status.json.
VERSIONED = ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "numpy", "scikit-learn",
             "hydra-core", "rewarduq_exp")


class RunFolderBusy(UserError):
    """The folder holds another live run, or a completed run of another config: this process must not write
    there. Raised before anything is written."""


def library_versions() -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


class RunFolder:
    def __init__(self, root: str | os.PathLike, writer: bool = True):
        self.root = Path(root)
        # Under torchrun / accelerate every process holds a RunFolder on the same directory; only the main one is
        # the writer (status, metrics, predictions). The others read, and write only a failure of their own (below).
        self.writer = writer
        # What the run is doing: "validation" until its settings are checked (a failure then means the settings
        # are invalid, not that training broke; selection lists such runs apart), then "running".
        self.stage = VALIDATION
        self._status: dict | None = None      # this process's status.json, once it has claimed the folder
        self._lock = threading.Lock()         # the heartbeat thread and the run write status.json in turn
        self._heartbeat: Heartbeat | None = None
        self._earlier: list[dict] = []        # the attempts before this one of the run this process continues

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

    # ------------------------------------------------------------------ writes stay inside
    def check_run_writes(self) -> None:
        """A run's writes (``TREES``, ``FOLDERS``, ``FILES``) stay inside the folder; :class:`UserError` naming the
        first link or misplaced non-folder otherwise."""
        check_writes_inside(self.root, trees=TREES, folders=FOLDERS, files=FILES)

    def check_evaluation_writes(self, datasets) -> None:
        """What ``evaluate.py`` writes for ``datasets`` (predictions files, figure folders, metrics.json and its lock)
        stays inside the folder. The figure folders are swapped in whole, so what is below them does not matter."""
        check_writes_inside(self.root, folders=("predictions", "figures", *(f"figures/{d}" for d in datasets)),
                            files=("metrics.json", METRICS_LOCK, *(f"predictions/{d}.parquet" for d in datasets)))

    @contextlib.contextmanager
    def metrics_lock(self):
        """Held while ``metrics.json`` is read, merged and replaced, so two ``evaluate.py`` runs finishing together
        on one run folder both land. The lock file must be a plain file of the folder: ``FileLock`` opens it for
        writing and would follow a link out of the folder (or fail on a folder). Waiting for another process that
        holds it is said in one log line, with the holder (:mod:`rewarduq_exp.core.file_locks`)."""
        check_writes_inside(self.root, files=(METRICS_LOCK,))
        path = self.root / METRICS_LOCK
        with file_locks.held(path, f"the metrics of {self.root}", lock=FileLock(str(path))):
            yield

    def merged_metrics(self, blocks: dict[str, dict]) -> dict:
        """``metrics.json`` with ``blocks`` added or replacing theirs (as stored: undefined values stay null); call it
        under :meth:`metrics_lock`."""
        kept = read_json_object(self.metrics_path) if self.metrics_path.exists() else {}
        return {**kept, **blocks}

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        return read_status(self.root)

    def is_completed(self, chash: str) -> bool:
        return is_completed(self.root, chash)

    def start(self, chash: str | None, force: bool = False, **info) -> None:
        """Claim the folder for this process and mark the run ``running`` (see the module docstring), then keep
        its heartbeat going. ``chash`` is None when the config could not be resolved (it fails validation next);
        ``info`` goes into ``status.json`` as it is. Raises :class:`RunFolderBusy`, having written nothing, when
        the folder is not free."""
        self._started, self._started_at = time.time(), now_iso()
        if not self.writer:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.check_run_writes()  # nothing written yet: a link or a misplaced file is refused in one line
            with self._claim_mutex():
                previous = self.status()
                self._refuse_unless_free(previous, chash, force)
                self._earlier = earlier_attempts(previous, chash, force)
                every = heartbeat_interval()
                self._status = {"state": RUNNING, "config_hash": chash, "started_at": self._started_at,
                                **this_owner(), "heartbeat_at": now_iso(), "heartbeat_every_s": every,
                                "versions": library_versions(), **info}
                if self._earlier:
                    self._status["attempts"] = self._earlier
                write_json(self.status_path, self._status)
        except PermissionError as err:
            raise UserError(f"run folder {self.root} is not writable ({err.strerror}); choose another "
                            "hydra.run.dir or paths.output_root") from None
        self._heartbeat = Heartbeat(self._beat, every)

    @contextlib.contextmanager
    def _claim_mutex(self):
        """Exclusive while held: a ``.claiming`` folder made with ``mkdir`` (atomic, also on NFS) and removed after,
        so a claim leaves no lock file behind in the run folder. One left by a process killed in the middle of a
        claim (a few milliseconds) is taken as stale after ``CLAIM_STALE_S``."""
        mutex = self.root / ".claiming"
        while True:
            try:
                os.mkdir(mutex)
                break
            except FileExistsError:
                try:
                    if time.time() - mutex.stat().st_mtime > CLAIM_STALE_S:
                        os.rmdir(mutex)
                except FileNotFoundError:
                    pass
                time.sleep(0.05)
        try:
            yield
        finally:
            os.rmdir(mutex)

    def _refuse_unless_free(self, status: dict, chash: str | None, force: bool) -> None:
        state = status.get("state")
        if state == RUNNING and owner_alive(status):
            raise RunFolderBusy(f"{self.root} is in use by another run ({describe_owner(status)}); "
                                "wait for it, or give this run another folder (hydra.run.dir=...)")
        if state == COMPLETED and status.get("config_hash") != chash and not force:
            raise RunFolderBusy(f"{self.root} holds a completed run of another config (hash "
                                f"{status.get('config_hash')}, this one {chash}); give this run another folder "
                                "(hydra.run.dir=...), or force=true to replace that run")

    def _beat(self) -> None:
        with self._lock:
            if self._status is None or self._status.get("state") != RUNNING:
                return
            self._status["heartbeat_at"] = now_iso()
            try:
                write_json(self.status_path, self._status)
            except UserError:
                pass  # status.json made a link meanwhile: refused, never written through; the final status says it

    def _end(self, status: dict) -> None:
        """Write the final status; the heartbeat stops first, so it can never write ``running`` over it."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        with self._lock:
            self._status = status
            try:
                write_json(self.status_path, status)
            except UserError as err:  # status.json made a link meanwhile (refused, never written through)
                if status.get("state") == COMPLETED:
                    raise             # the run fails with that line (and this ends here again, without raising)
                log.error("%s: not updated (state %s): %s", self.status_path, status.get("state"), one_line(err))

    def write_config(self, task_cfg, hydra_cfg, overrides) -> None:
        """``.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml``, as Hydra writes them, once the folder is
        ours."""
        from omegaconf import OmegaConf

        if not self.writer:
            return
        hydra_dir = self.root / ".hydra"
        write_atomic(hydra_dir / "config.yaml", OmegaConf.to_yaml(task_cfg))
        write_atomic(hydra_dir / "hydra.yaml", OmegaConf.to_yaml(hydra_cfg))
        write_atomic(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(overrides))

    def finish(self, **info) -> None:
        if not self.writer:
            return
        st = dict(self._status or self.status())
        st.update(state=COMPLETED, finished_at=now_iso(), **info)
        self._close_attempt(st, st["finished_at"])
        for key in ("error", "traceback", "stage", "heartbeat_at"):
            st.pop(key, None)
        self._end(st)

    def interrupt(self, message: str) -> None:
        """A signal stopped the run (preemption, time limit, ``kill``): ``interrupted``, not failed; the launchers
        submit it again and it resumes from its training checkpoint."""
        if not self.writer:
            return
        st = dict(self._status or self.status())
        st.update(state=INTERRUPTED, interrupted_at=now_iso(), error=message, stage=self.stage)
        st.pop("heartbeat_at", None)
        self._close_attempt(st, st["interrupted_at"])
        self._end(st)

    def fail(self, err: BaseException, with_traceback: bool = True) -> None:
        # Every process records its own failure: when a non-main process dies the launcher kills the main one with
        # SIGTERM (no Python exception), so otherwise status.json would say "running" forever.
        st = dict(self._status or self.status())
        st.update(state="failed", finished_at=now_iso(), error=f"{type(err).__name__}: {one_line(err)}",
                  stage=self.stage)
        st.pop("heartbeat_at", None)
        if not self.writer:
            st["failed_rank"] = _rank()
        self._close_attempt(st, st["finished_at"])
        if with_traceback:
            st["traceback"] = traceback.format_exc()
        self._end(st)

    def _close_attempt(self, st: dict, ended_at: str) -> None:
        """Add this attempt to ``st["attempts"]`` and make ``st["seconds"]`` their sum (nothing when this process
        never started the run)."""
        if not hasattr(self, "_started"):
            return
        # A non-main process has no earlier attempts of its own: it continues the list rank 0's status holds.
        earlier = self._earlier if self.writer else recorded(st)
        done = [*earlier, attempt(self._started_at, ended_at, time.time() - self._started, st["state"])]
        st.update(attempts=done, seconds=total_seconds(done))

    # ------------------------------------------------------------------ results
    def read_metrics(self) -> dict:
        """``metrics.json`` as written, with a ``null`` metric (NaN/inf when it was computed, see
        :mod:`rewarduq_exp.core.strict_json`) read back as NaN; ``{}`` when there is none yet."""
        if not self.metrics_path.exists():
            return {}
        return nulls_to_nan(read_json_object(self.metrics_path))

    def write_metrics(self, blocks: dict[str, dict], merge: bool = False) -> None:
        """Write ``metrics.json``; ``merge`` adds/replaces these blocks and keeps the others. The read-merge-write
        runs under a file lock, so two ``evaluate.py`` runs finishing together on one run folder both land."""
        if not self.writer:
            return
        if not merge:
            write_json(self.metrics_path, blocks)
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with self.metrics_lock():
            write_json(self.metrics_path, self.merged_metrics(blocks))

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
