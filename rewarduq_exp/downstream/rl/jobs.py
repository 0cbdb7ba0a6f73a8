"""The RL runs of a study as jobs: each is one (trained run, objective, RL seed), its measurements saved in the task
folder (``rl_runs/<key>.csv.gz``, written atomically) the moment it ends, so a study stopped by Ctrl-C or a scheduler
resumes with the same command (``hydra.run.dir=<the folder>``) and runs only what is missing. A job is a fixed
function of its settings (:mod:`.training`), so a resumed study gives the numbers an uninterrupted one would.

``task.workers`` > 1 runs jobs in that many processes (spawned; each keeps the reward models and worlds it loaded, and
uses cores / workers threads), so a study uses every core of a machine with a small policy.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from rewarduq_exp.core.atomic_write import write_atomic

log = logging.getLogger("rewarduq_exp")


@dataclass(frozen=True)
class Job:
    run_path: str
    run_label: str
    tags: tuple            # ((key, value), ...): method, world, strength, ... of the trained run
    reference_dir: str
    pool_file: str         # the reference's samples (the pool the objectives' units come from)
    objective: str
    coef: float
    seed: int
    role: str              # "select" or "report"
    settings: tuple        # RLSettings as ((key, value), ...)
    device: str
    cache_dir: str | None
    batch_size: int | None
    recalibrated: bool
    knn: int
    trust_remote_code: bool = False
    extra: tuple = field(default_factory=tuple)

    def key(self) -> str:
        blob = json.dumps(asdict(self) | {"role": None}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def result_path(folder: Path, job: Job) -> Path:
    return Path(folder) / "rl_runs" / f"{job.key()}.csv.gz"


def read_result(path: Path) -> pd.DataFrame:
    return pd.read_csv(io.BytesIO(gzip.decompress(path.read_bytes())))


# ------------------------------------------------------------------------------------------ in a worker
_LOADED: dict = {}


def _scorer(job: Job):
    """The job's reward model, world and scorer, loaded once per process and run (and the settings they are loaded
    with: another study in the same process may read the same run otherwise)."""
    key = (job.run_path, job.pool_file, job.device, job.cache_dir, job.batch_size, job.recalibrated, job.knn,
           job.trust_remote_code, job.extra)
    if key not in _LOADED:
        from rewarduq_exp.api import RewardModel
        from rewarduq_exp.downstream.rl.objectives import RunScorer
        from rewarduq_exp.downstream.rl.vader_world import rl_world
        from rewarduq_exp.recalibration import read_calibration
        from rewarduq_exp.runner.trained_run import load_trained_method

        path = Path(job.run_path)
        trained = load_trained_method(path, device=job.device, progress=False, batch_size=job.batch_size,
                                      cache_dir=job.cache_dir, trust_remote_code=job.trust_remote_code)
        calibration = read_calibration(path) if job.recalibrated else None
        model = RewardModel(trained.method, path, trained.config, calibration=calibration)
        world, world_text = rl_world(trained.config, path / ".hydra" / "config.yaml", dict(job.extra).get("gold_run"),
                                     device=job.device, cache_dir=job.cache_dir, batch_size=job.batch_size,
                                     trust_remote_code=job.trust_remote_code)
        scorer = RunScorer(model, world, job.knn, recalibrated=job.recalibrated)
        pool = pd.read_csv(job.pool_file)
        scorer.fit_pool([world.prompt(int(t)) for t in pool.topic], pool.text.fillna("").tolist())
        _LOADED.clear()   # one run at a time per process: a study's jobs come grouped by run
        _LOADED[key] = (scorer, world_text)
    return _LOADED[key]


def run_job(job: Job, folder: str) -> str:
    """Train and measure one RL run; its table goes to ``rl_runs/<key>.csv.gz``; returns that path."""
    from rewarduq_exp.downstream.rl.objectives import Objective
    from rewarduq_exp.downstream.rl.training import RLSettings, train_policy

    out = result_path(Path(folder), job)
    if out.is_file():
        return str(out)
    scorer, world_text = _scorer(job)
    settings = RLSettings(**dict(job.settings))
    work = Path(folder) / "rl_runs" / f".work-{job.key()}"
    frame = train_policy(job.reference_dir, scorer, Objective(job.objective, job.coef), world_text, settings,
                         job.seed, job.device, work)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    seconds = frame.attrs.get("seconds", float("nan"))
    frame = frame.assign(run=job.run_label, **dict(job.tags), objective=job.objective, coef=job.coef,
                         rl_seed=job.seed, role=job.role, seconds=seconds)
    write_atomic(out, gzip.compress(frame.to_csv(index=False).encode(), mtime=0))
    return str(out)


def _worker_init(threads: int) -> None:
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent handles Ctrl-C and stops the pool
    torch.set_num_threads(threads)
    logging.getLogger("rewarduq_exp").setLevel(logging.WARNING)
    _worker_quiet()


def run_jobs(jobs: list[Job], folder: Path, workers: int, bar) -> list[pd.DataFrame]:
    """Every job's table (those already in the folder read, the rest run), in the order of ``jobs``."""
    todo = [j for j in jobs if not result_path(folder, j).is_file()]
    done = len(jobs) - len(todo)
    if done:
        log.info("rl: %d of %d RL runs already in %s (resumed)", done, len(jobs), folder)
    bar.update(done)
    if workers <= 1 or len(todo) <= 1:
        _worker_quiet()
        for job in todo:
            run_job(job, str(folder))
            bar.update(1)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        threads = max(1, (os.cpu_count() or 1) // workers)
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_init, initargs=(threads,))
        try:
            futures = [pool.submit(run_job, job, str(folder)) for job in todo]
            for future in as_completed(futures):
                future.result()
                bar.update(1)
        finally:   # Ctrl-C or a failed job: what is running stops, what is written stays
            for process in list(getattr(pool, "_processes", {}).values()):
                process.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
    return [read_result(result_path(folder, j)) for j in jobs]


def _worker_quiet() -> None:
    from datasets.utils.logging import disable_progress_bar
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bar()   # the trainers' dataset maps: one bar per RL run would flood the terminal
