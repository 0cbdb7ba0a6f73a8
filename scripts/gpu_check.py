"""One GPU check, ready for any node: what a cluster's GPU node does with this project, in one command.

    make gpu-check                                   # on a GPU node: the full check, results in outputs/gpu_check
    python scripts/gpu_check.py --out <folder>       # the same, results where you say
    python scripts/gpu_check.py --steps bench,mission
    python scripts/gpu_check.py --device cpu         # the same steps at tiny sizes on the CPU (what CI runs)

Offline, on one GPU, in 8 minutes at most, start-up included. First a preflight (``scripts/preflight.py``): every
package the project needs is imported, and one line per missing package ends the check (exit status 2) before any
step. Then the steps, each in its own processes under its own time limit, so one failure (or hang) does not stop the
rest:

1. ``tests``: the test suite (``-m "not slow and not slurm"``) with CUDA visible; on a CPU a few test files that
   exercise the GPU-facing paths (token budgets, the batched multi-LoRA, shared prompts).
2. ``methods``: every method end to end on the tiny model (``train.py``), side by side: ENS-MLP, BAY-LIN, ENS-LoRA,
   MCD-DPO and BoRP, on CUDA in bf16 (on a CPU: float32, two at a time, smaller ensembles, and BoRP without the
   1,000-pair preference set, which alone took 50 of its 73 s).
3. ``resume``: ENS-LoRA and MCD-DPO stopped by SIGTERM in the middle of training and launched again, against an
   uninterrupted run and a second uninterrupted run beside it (the device's own run-to-run difference): the resumed
   run must end within 4 x that difference (or 1e-5). The three first runs of both methods start together, then the
   two relaunches together: two rounds of process start-up, not eight.
4. ``bench``: ``scripts/bench_gpu.py`` at the Qwen3-0.6B and -4B shapes (``--smoke`` on a CPU): tokens/s, MFU,
   measured against planned memory, at the old fixed batch and at the planner's. Its random-init bf16 bodies are
   built once into the check's cache (``<out>/cache/models/random-<shape>``) and loaded after, by a rerun and by:
5. ``mission``: ``train.py method=ens_mlp model=qwen3-4b`` on that random-init 4B backbone (the tiny model on a CPU)
   with a fresh feature cache: wall time, peak device memory, backbone passes, and wall time over extraction time.

At the end a summary table (each step's time against its limit); in the folder: ``summary.json``, ``summary.md``,
``<step>.log`` per step (every command and its output) and ``bench_gpu.json``. Exit status 1 when a step failed,
2 when the preflight found packages missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("tests", "methods", "resume", "bench", "mission")

# ---------------------------------------------------------------------------------------------------- time limits
# On one GPU the whole check, start-up included, ends within GPU_BUDGET_S: the step limits and STARTUP_S add up to it,
# and no step runs into the time the steps after it are given (the mission's included). No GPU was at hand while these
# were set, so the GPU figures are estimates from what the project measured on an H100 (16 cores) with earlier code
# and from the CPU times of the same work; each says how. Without a GPU there is no overall budget: each step has its
# CPU limit, at least twice its time measured on 2 cores with a `make test` and three busy loops beside it (load
# 6-8.7; the preflight took 50 s there, 12 s quiet): tests 80 s, methods 84, resume 107, bench 25, mission 26.
GPU_BUDGET_S = 480
# gpu_check's own start and the preflight, which imports every package (torch, transformers, trl, datasets, ...):
# 14 s measured on a quiet 2-core CPU here; a node's cores are faster, its file system may be slower.
STARTUP_S = 30
LIMITS = {   # step: (GPU, CPU) seconds
    # GPU: the suite is about 600 worker-seconds on 2 CPU workers (5 min x 2); 12 workers on 16 cores share it at
    # about 4-6x the pace, plus a CUDA context per worker: about 100-150 s, estimated. A suite that runs past its limit
    # is reported with the counts it reached. CPU: 3 files, 45 s quiet, 80 s under load.
    "tests": (140, 200),
    # GPU: the five runs at once, each ~10 s of start-up (imports, CUDA) and a few seconds of work on 2,000 pairs of
    # the tiny model (its steps take milliseconds on a GPU): about 30-40 s, estimated. CPU: two at a time, 1 thread
    # each, at 160 pairs: 51 s quiet (one by one: 102 s), 84 s under load.
    "methods": (55, 200),
    # GPU: two rounds of start-up (6 runs at once, then the 2 relaunches) and 100 optimizer steps of the tiny model
    # per run with a checkpoint every 20: about 40-50 s, estimated. CPU: 20 steps, a checkpoint every 5, two runs at
    # a time: 77 s quiet (one by one: 137 s), 107 s under load.
    "resume": (60, 240),
    # GPU: the 0.6B and 4B shapes, median of 3: the H100 run of the earlier benchmark took about 2 min at 5 repeats
    # with the 4B body built in memory; 3 repeats and the body built once (shared with the mission): about 80-90 s,
    # estimated. CPU: the tiny shape (--smoke), 27 s quiet, 25 s under load (one torch thread).
    "bench": (95, 100),
    # GPU: measured on an H100: train.py ENS-MLP on a random 4B at the synthetic world's default sizes, 79.8 s (626
    # backbone passes); +20 s to build the random 4B if the bench step did not (init on the GPU, 8 GB written).
    # CPU: the tiny model at 2,000 pairs, 20 s quiet, 26 s under load.
    "mission": (100, 100),
}
assert STARTUP_S + sum(gpu for gpu, _ in LIMITS.values()) <= GPU_BUDGET_S, "the GPU limits exceed the budget"

CPU_TESTS = ["tests/test_token_budget.py", "tests/test_multi_lora.py", "tests/test_shared_prefix.py"]
METHODS = {
    "ens_mlp": ["method=ens_mlp"],
    "bay_lin": ["method=bay_lin"],
    "ens_lora": ["method=ens_lora", "method.num_members=4"],
    "mcd_dpo": ["method=mcd_dpo", "method.num_samples=8"],
    "borp": ["method=borp", "probe=borp_contrastive", "dataset=synthetic_ratings", "model.build.num_layers=4",
             "also_evaluate=[synthetic_eval]"],
}
# On a CPU the fine-tuning methods run smaller ensembles, and BoRP scores no preference set: the synthetic world's
# 1,000 eval pairs are 1,500 of its 1,830 backbone passes (73 s -> 23 s); tests/test_borp_run.py covers that path.
CPU_METHODS = {"ens_lora": ["method.num_members=3", "method.lora_rank=4"], "mcd_dpo": ["method.num_samples=4"],
               "borp": ["also_evaluate=[]"]}
CPU_NOTES = {"methods": "CPU variant: ENS-LoRA K=3 rank 4, MCD-DPO 4 masks, BoRP without the preference set",
             "tests": "CPU variant: " + ", ".join(Path(t).name for t in CPU_TESTS), "bench": "CPU variant: --smoke",
             "mission": "CPU variant: the tiny model"}
RESUME = {
    "ens_lora": ["method=ens_lora", "method.num_members=3", "method.lora_rank=4", "method.batch_size=8"],
    "mcd_dpo": ["method=mcd_dpo", "method.num_samples=4", "method.batch_size=8", "method.micro_batch_size=4"],
}
# (training pairs, checkpoint every N steps) for the resume runs: batches of 8, so 100 steps on a GPU, 20 on a CPU;
# the stopped run gets SIGTERM once its first checkpoint is on disk (its SIGTERM handler writes another, where it is).
RESUME_SIZES = {"cuda": (800, 20), "cpu": (160, 5)}


# ---------------------------------------------------------------------------------------------------- processes
class Log:
    """One step's log file: every command, its exit status, time and output."""

    def __init__(self, path: Path):
        self.path = path
        path.write_text("")

    def write(self, text: str) -> None:
        with self.path.open("a") as f:
            f.write(text if text.endswith("\n") else text + "\n")


class Job:
    """One process of a step: a command, and optionally a condition on which it gets SIGTERM once (``stop_when``).
    After ``run_jobs``: ``code`` (124: killed at the time limit), ``seconds``, ``out`` and ``stopped``."""

    def __init__(self, cmd: list, stop_when=None):
        self.cmd = [str(c) for c in cmd]
        self.stop_when = stop_when
        self.code: int | None = None
        self.seconds = 0.0
        self.out = ""
        self.stopped = False
        self.proc: subprocess.Popen | None = None   # while it runs: the process, its output file, its start
        self.file = None
        self.t0 = 0.0


def run_jobs(jobs: list[Job], log: Log, timeout: float, parallel: int = 1, env: dict | None = None) -> None:
    """Run ``jobs`` from the project root, at most ``parallel`` at a time, each in its own process group (killed with
    its children when the step's ``timeout`` is up); output goes to a file, not a pipe that could fill."""
    deadline = time.perf_counter() + max(1.0, timeout)
    waiting, running = list(jobs), []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        while waiting or running:
            while waiting and len(running) < parallel:
                job = waiting.pop(0)
                job.file = open(Path(tmp) / f"{id(job)}.out", "w+")
                job.t0 = time.perf_counter()
                job.proc = subprocess.Popen(job.cmd, cwd=ROOT, stdout=job.file, stderr=subprocess.STDOUT, text=True,
                                            env={**os.environ, **(env or {})}, start_new_session=True)
                running.append(job)
            time.sleep(0.05)
            for job in list(running):
                if job.stop_when and not job.stopped and job.proc.poll() is None and job.stop_when():
                    os.kill(job.proc.pid, signal.SIGTERM)
                    job.stopped = True
                code = job.proc.poll()
                late = time.perf_counter() > deadline
                if code is None and not late:
                    continue
                if code is None:
                    os.killpg(job.proc.pid, signal.SIGKILL)
                    job.proc.wait()
                    code = 124
                job.code, job.seconds = code, time.perf_counter() - job.t0
                job.file.seek(0)
                job.out = job.file.read() + (f"\n[gpu_check] killed after {timeout:.0f} s" if code == 124 else "")
                job.file.close()
                log.write(f"$ {' '.join(job.cmd)}\n{job.out}\n[exit {code} after {job.seconds:.1f} s]\n")
                running.remove(job)
            if time.perf_counter() > deadline:   # the step's time is up: what never started is not run
                for job in waiting:
                    job.code, job.out = 124, "[gpu_check] not started: the step's time was up"
                waiting = []


# ---------------------------------------------------------------------------------------------------- the check
class Check:
    def __init__(self, args):
        import torch

        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        wanted = args.device
        self.cuda = (wanted == "auto" and torch.cuda.is_available()) or wanted.startswith("cuda")
        self.device = "cuda" if self.cuda else "cpu"
        self.python = sys.executable
        self.cache = self.out / "cache"
        self.deadline: float = 0.0
        self.cores = os.cpu_count() or 2

    def limit(self, step: str) -> float:
        return LIMITS[step][0 if self.cuda else 1]

    def timeout(self, step: str, later: list[str]) -> float:
        """The step's limit; under an overall budget never more than what is left once the later steps' limits are
        set aside (a step that started late gets less, the mission keeps its own)."""
        if not self.deadline:
            return self.limit(step)
        left = self.deadline - time.perf_counter() - sum(self.limit(s) for s in later)
        return max(1.0, min(self.limit(step), left))

    def parallel_env(self, parallel: int) -> dict:
        """Threads per process when ``parallel`` run at once: the cores shared out (on a CPU, 1 each: more threads
        than free cores make every kernel many times slower on a busy machine)."""
        threads = str(max(1, self.cores // parallel) if self.cuda else 1)
        return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}

    def train_args(self, folder: Path) -> list[str]:
        dtype = "bfloat16" if self.cuda else "float32"
        return [f"device={self.device}", f"model.dtype={dtype}", "progress=false", f"hydra.run.dir={folder}",
                f"paths.output_root={self.out / 'outputs'}", f"paths.cache_dir={self.cache}"]

    def sizes(self, n_train: int | None = None) -> list[str]:
        n = (2000, 300) if self.cuda else (160, 60)
        return [f"dataset.n_train={n_train or n[0]}", f"dataset.n_eval={n[1]}", f"dataset.n_ood={n[1]}"]

    # ------------------------------------------------------------------------------------------------ steps
    def tests(self, log: Log, timeout: float) -> dict:
        import importlib.util

        missing = [m for m in ("pytest", "xdist") if importlib.util.find_spec(m) is None]
        if missing:   # a plain install: the test tools are the dev extra
            return {"ok": False, "seconds": 0.0, "figures": {"error": f"{', '.join(missing)} not installed: "
                                                                      "pip install -e '.[dev]' (or make setup)"}}
        cmd = [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        if self.cuda:
            workers = max(2, min(12, self.cores - 2))
            cmd += ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder", "-m", "not slow and not slurm"]
        else:
            cmd += ["-n", "2", *CPU_TESTS]
        job = Job(cmd)
        run_jobs([job], log, timeout)
        lines = job.out.strip().splitlines()
        last = lines[-1] if lines else ""
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last)}
        if job.code == 124:   # killed at the limit: the progress characters it printed so far
            marks = "".join(re.findall(r"^([.FEsxX]+)\s*\[\s*\d+%\]", job.out, re.M))
            counts = {"timed_out": True, "passed_so_far": marks.count("."), "failed_so_far": marks.count("F"),
                      "errors_so_far": marks.count("E")}
        cuda_skips = len(re.findall(r"SKIPPED.*(?:cuda|gpu|CUDA|GPU)", job.out))
        ok = job.code == 0 and not counts.get("failed") and not counts.get("error") and not counts.get("errors")
        return {"ok": ok and not cuda_skips, "seconds": job.seconds,
                "figures": {**counts, "skipped_for_cuda": cuda_skips}}

    def methods(self, log: Log, timeout: float) -> dict:
        t0 = time.perf_counter()
        jobs = {}
        for name, args in METHODS.items():
            folder = self.out / "runs" / name
            shutil.rmtree(folder, ignore_errors=True)   # a fresh run folder each time the check runs
            if not self.cuda:
                args = [*args, *CPU_METHODS.get(name, [])]
            jobs[name] = Job([self.python, "train.py", *args, *self.sizes(), *self.train_args(folder)])
        parallel = len(jobs) if self.cuda else 2
        run_jobs(list(jobs.values()), log, timeout, parallel, self.parallel_env(parallel))
        figures, ok = {}, True
        for name, job in jobs.items():
            row = {"exit": job.code, "seconds": round(job.seconds, 1)}
            metrics = _read_json(self.out / "runs" / name / "metrics.json")
            if job.code == 0 and metrics:
                first = next(iter(metrics.values()))
                row.update({k: first.get(k) for k in ("win_rate", "ece", "probe/spearman") if k in first})
            ok &= job.code == 0
            figures[name] = row
        return {"ok": ok, "seconds": time.perf_counter() - t0, "figures": figures}

    def resume(self, log: Log, timeout: float) -> dict:
        """Per method: an uninterrupted run, a second one (the run-to-run difference) and one stopped by SIGTERM once
        it wrote a checkpoint, all six at once; then the two stopped runs launched again, together."""
        t0 = time.perf_counter()
        n_train, every = RESUME_SIZES[self.device]
        base = self.out / "resume"
        shutil.rmtree(base, ignore_errors=True)
        first, again = {}, {}
        for name, args in RESUME.items():
            args = [*args, *self.sizes(n_train)]
            for label in ("uninterrupted", "again"):
                first[name, label] = Job([self.python, "train.py", *args, *self.train_args(base / name / label)])
            stopped = base / name / "stopped"
            cmd = [self.python, "train.py", *args, *self.train_args(stopped), f"checkpoint.every_steps={every}"]
            first[name, "stopped"] = Job(cmd, stop_when=lambda f=stopped / "checkpoint": any(f.rglob("*.safetensors")))
            again[name] = Job(cmd)
        parallel = len(first) if self.cuda else 2
        env = self.parallel_env(parallel)
        run_jobs(list(first.values()), log, timeout, parallel, env)
        relaunch = [job for name, job in again.items() if first[name, "stopped"].stopped]
        run_jobs(relaunch, log, timeout - (time.perf_counter() - t0), len(relaunch) if self.cuda else 2, env)
        figures = {name: self._resume_verdict(name, first, again[name], base / name) for name in RESUME}
        verdicts = [row.pop("ok") for row in figures.values()]
        ok = all(verdicts)
        return {"ok": ok, "seconds": time.perf_counter() - t0, "figures": figures}

    def _resume_verdict(self, name: str, first: dict, relaunch: Job, folder: Path) -> dict:
        for label in ("uninterrupted", "again"):
            if first[name, label].code != 0:
                return {"ok": False, "error": f"the {label} run exited {first[name, label].code}"}
        stopped = first[name, "stopped"]
        if not stopped.stopped:
            return {"ok": False, "error": "training ended before a checkpoint was seen: nothing was interrupted"}
        step = re.search(r"interrupted by SIG\w+ at step (\d+)", stopped.out)
        status = _read_json(folder / "stopped" / "status.json") or {}
        if relaunch.code != 0 or status.get("state") != "completed" or "resumed" not in status:
            return {"ok": False, "error": f"the relaunch exited {relaunch.code} with state {status.get('state')}"}
        resumed = _max_difference(folder / "uninterrupted", folder / "stopped")
        run_to_run = _max_difference(folder / "uninterrupted", folder / "again")
        # a resume bug moves rewards by ~lr (1e-3 and more); float32 sums reduced by several CPU threads already
        # differ by ~2e-6 between two uninterrupted processes (MCD-DPO, 2 threads, measured)
        allowed = max(1e-5, 4 * run_to_run)
        return {"ok": resumed <= allowed, "stopped_at_step": int(step.group(1)) if step else None,
                "resumed_vs_uninterrupted": resumed, "run_to_run": run_to_run, "allowed": allowed}

    def bench(self, log: Log, timeout: float) -> dict:
        path = self.out / "bench_gpu.json"
        path.unlink(missing_ok=True)
        cmd = [self.python, "scripts/bench_gpu.py", "--out", str(path), "--cache-dir", str(self.cache)]
        cmd += ["--repeats", "3", "--weights-cache", str(self.cache)] if self.cuda else ["--smoke"]
        job = Job(cmd)
        run_jobs([job], log, timeout)
        result = _read_json(path)   # written after each shape: a run cut at its limit keeps the shapes it measured
        figures = {} if job.code == 0 else {"exit": job.code, "shapes_done": len((result or {}).get("shapes", {}))}
        for shape, data in (result or {}).get("shapes", {}).items():
            for key, row in data.get("measurements", {}).items():
                if "error" in row:
                    figures[f"{shape}/{key}"] = row["error"][:80]
                    continue
                figures[f"{shape}/{key}"] = {k: _round(row.get(k)) for k in
                                             ("tokens_per_s", "mfu", "measured_over_planned") if row.get(k)}
            figures.update({f"{shape}/ratio/{k}": round(v, 3) for k, v in data.get("ratios", {}).items()})
        return {"ok": job.code == 0, "seconds": job.seconds, "figures": figures}

    def mission(self, log: Log, timeout: float) -> dict:
        t0 = time.perf_counter()
        folder = self.out / "mission"
        shutil.rmtree(folder, ignore_errors=True)
        cache = self.out / "cache-mission"   # its own feature cache: the extraction is measured, never a cache hit
        if self.cuda:   # the random 4B that the bench step built (or built now, once, into the same place)
            model = self.cache / "models" / "random-qwen3-4b"
            if not (model / "model.safetensors").exists():
                build = Job([self.python, __file__, "--build-random", "qwen3-4b", "--cache-dir", str(self.cache)])
                run_jobs([build], log, timeout / 2)
                if build.code != 0:
                    return {"ok": False, "seconds": time.perf_counter() - t0,
                            "figures": {"error": f"building the random 4B backbone exited {build.code}"}}
            args = ["method=ens_mlp", "model=qwen3-4b", f"model.path={model}", "also_evaluate=[]"]
        else:
            args = ["method=ens_mlp", "also_evaluate=[]", "dataset.n_train=2000", "dataset.n_eval=500",
                    "dataset.n_ood=500"]
        shutil.rmtree(cache / "features", ignore_errors=True)
        common = [a for a in self.train_args(folder) if not a.startswith(("paths.cache_dir", "model.dtype"))]
        (cache / "models").mkdir(parents=True, exist_ok=True)
        for built in (self.cache / "models").glob("tiny-qwen3-*"):   # the tokenizer / tiny model, not rebuilt
            link = cache / "models" / built.name
            if not link.exists():
                link.symlink_to(built)
        job = Job([self.python, "train.py", *args, *common, f"paths.cache_dir={cache}"])
        run_jobs([job], log, timeout - (time.perf_counter() - t0), env=None if self.cuda else self.parallel_env(1))
        status = _read_json(folder / "status.json") or {}
        feats = status.get("features", {})
        memory = status.get("device_memory", {})
        extraction = feats.get("seconds_extracting")
        figures = {"wall_s": round(job.seconds, 1), "run_s": status.get("seconds_total"),
                   "extraction_s": extraction, "backbone_passes": feats.get("backbone_forward_passes"),
                   "wall_over_extraction": round(job.seconds / extraction, 2) if extraction else None,
                   "peak_allocated_gib": _round(memory.get("peak_allocated_bytes", 0) / 2**30) if memory else None}
        return {"ok": job.code == 0 and status.get("state") == "completed", "seconds": time.perf_counter() - t0,
                "figures": figures}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _round(value):
    if isinstance(value, float):
        return float(f"{value:.4g}")
    return value


def _max_difference(a: Path, b: Path) -> float:
    """Largest absolute difference of any reward or bound between the predictions of two runs."""
    import numpy as np
    import pandas as pd

    worst = 0.0
    for path in sorted((a / "predictions").glob("*.parquet")):
        pa, pb = pd.read_parquet(path), pd.read_parquet(b / "predictions" / path.name)
        for col in pa.columns:
            if col.endswith(("_reward", "_lower", "_upper")):
                worst = max(worst, float(np.max(np.abs(pa[col].to_numpy() - pb[col].to_numpy()))))
    return worst


# ---------------------------------------------------------------------------------------------------- summary
def _describe(figures) -> str:
    if not isinstance(figures, dict):
        return str(figures)
    parts = []
    for key, value in figures.items():
        if isinstance(value, dict):
            parts.append(f"{key}: " + ", ".join(f"{k}={_round(v)}" for k, v in value.items()))
        else:
            parts.append(f"{key}={_round(value)}")
    return "; ".join(parts)


def summary_table(results: dict) -> str:
    lines = ["| step | result | seconds / limit | figures |", "|---|---|---|---|"]
    for name, r in results.items():
        note = f" ({r['note']})" if r.get("note") else ""
        lines.append(f"| {name} | {'pass' if r['ok'] else 'FAIL'} | {r['seconds']:.0f} / {r['limit']:.0f} | "
                     f"{_describe(r['figures'])}{note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/gpu_check", help="folder for the summary, logs and bench JSON")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    parser.add_argument("--device", default="auto", help="auto (a GPU when visible) | cuda | cpu")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"the whole check's time, start-up included (default on a GPU: {GPU_BUDGET_S}; on a "
                             f"CPU: none, each step has its limit)")
    parser.add_argument("--build-random", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default="outputs/cache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"--steps: unknown {', '.join(unknown)}; allowed: {', '.join(STEPS)}")
    sys.path.insert(0, str(ROOT / "scripts"))
    import preflight  # the standard library only: it runs before anything the node may lack is imported

    if not args.build_random and preflight.main([]) != 0:
        return 2
    sys.path.insert(0, str(ROOT))
    if args.build_random:
        import torch
        from gpu_measure import random_checkpoint

        random_checkpoint(args.build_random, args.cache_dir, torch.device("cuda" if torch.cuda.is_available()
                                                                          else "cpu"))
        return 0
    check = Check(args)
    budget = args.budget_s or (GPU_BUDGET_S if check.cuda else None)
    if budget:
        check.deadline = started + budget
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    print(f"gpu_check on {check.device}; results in {check.out}; preflight passed in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    results = {}
    for i, step in enumerate(steps):
        log = Log(check.out / f"{step}.log")
        timeout = check.timeout(step, steps[i + 1:])
        try:
            result = getattr(check, step)(log, timeout)
        except Exception as err:   # one broken step is recorded; the others still run
            log.write(f"[gpu_check] {type(err).__name__}: {err}")
            result = {"ok": False, "seconds": 0.0, "figures": {"error": f"{type(err).__name__}: {err}"[:200]}}
        result["limit"] = timeout
        if not check.cuda and step in CPU_NOTES:
            result["note"] = CPU_NOTES[step]
        results[step] = result
        verdict = "pass" if result["ok"] else "FAIL"
        print(f"{step}: {verdict} ({result['seconds']:.0f} s of {timeout:.0f}) {_describe(result['figures'])}",
              flush=True)
    table = summary_table(results)
    summary = {"device": check.device, "seconds": time.perf_counter() - started, "budget_s": budget, "steps": results}
    import torch

    if check.cuda and torch.cuda.is_available():
        summary["device_name"] = torch.cuda.get_device_name(0)
        summary["torch"] = torch.__version__
    from rewarduq_exp.core.atomic_write import write_atomic
    from rewarduq_exp.core.strict_json import write_json

    write_json(check.out / "summary.json", summary)
    write_atomic(check.out / "summary.md", f"# gpu_check on {check.device}\n\n{table}\n\ntotal: "
                                           f"{summary['seconds']:.0f} s\n")
    print(table, flush=True)
    print(f"total: {summary['seconds']:.0f} s" + (f" of {budget:.0f}" if budget else ""), flush=True)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
