"""One GPU check, ready for any node: what a cluster's GPU node does with this project, in one command.

    make gpu-check                                   # on a GPU node: the full check, results in outputs/gpu_check
    python scripts/gpu_check.py --out <folder>       # the same, results where you say
    python scripts/gpu_check.py --steps bench,mission
    python scripts/gpu_check.py --device cpu         # the same steps at tiny sizes on the CPU (what CI runs)

Offline, on one GPU, in under 8 minutes. The steps, each in its own processes under its own timeout, so one failure
(or hang) does not stop the rest:

1. ``tests``: the test suite (``-m "not slow and not slurm"``) with CUDA visible; on a CPU a few test files that
   exercise the GPU-facing paths (token budgets, the batched multi-LoRA, shared prompts).
2. ``methods``: every method end to end on the tiny model (``train.py``): ENS-MLP, BAY-LIN, ENS-LoRA, MCD-DPO and
   BoRP, on CUDA in bf16 (on a CPU: float32).
3. ``resume``: ENS-LoRA and MCD-DPO stopped by SIGTERM in the middle of training and launched again, against an
   uninterrupted run and a second uninterrupted run beside it (the device's own run-to-run difference): the resumed
   run must end within 4 x that difference (or 1e-5).
4. ``bench``: ``scripts/bench_gpu.py`` at the Qwen3-0.6B and -4B shapes (``--smoke`` on a CPU): tokens/s, MFU,
   measured against planned memory, at the old fixed batch and at the planner's.
5. ``mission``: ``train.py method=ens_mlp model=qwen3-4b`` on a random-init 4B backbone built from
   ``conf/model/shapes/qwen3-4b.json`` (the tiny model on a CPU): wall time, peak device memory, backbone passes, and
   the wall time over the extraction time.

At the end a summary table; in the folder: ``summary.json``, ``summary.md``, ``<step>.log`` per step (every command
and its output) and ``bench_gpu.json``. Exit status 1 when a step failed.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("tests", "methods", "resume", "bench", "mission")
# Seconds per step on a GPU node / on a CPU (CI's two cores): the whole check stays under 8 minutes on one GPU.
TIMEOUTS = {"tests": (180, 300), "methods": (90, 420), "resume": (80, 420), "bench": (150, 240),
            "mission": (100, 240)}
GPU_BUDGET_S = 470   # on a GPU no step starts, and none runs on, past this: the check ends within 8 minutes
CPU_TESTS = ["tests/test_token_budget.py", "tests/test_multi_lora.py", "tests/test_shared_prefix.py"]
METHODS = {
    "ens_mlp": ["method=ens_mlp"],
    "bay_lin": ["method=bay_lin"],
    "ens_lora": ["method=ens_lora", "method.num_members=4"],
    "mcd_dpo": ["method=mcd_dpo", "method.num_samples=8"],
    "borp": ["method=borp", "probe=borp_contrastive", "dataset=synthetic_ratings", "model.build.num_layers=4",
             "also_evaluate=[synthetic_eval]"],
}
# On a CPU (CI's two cores) the fine-tuning methods run smaller ensembles.
CPU_METHODS = {"ens_lora": ["method.num_members=3", "method.lora_rank=4"], "mcd_dpo": ["method.num_samples=4"]}
RESUME = {
    "ens_lora": ["method=ens_lora", "method.num_members=3", "method.lora_rank=4", "method.batch_size=8"],
    "mcd_dpo": ["method=mcd_dpo", "method.num_samples=4", "method.batch_size=8", "method.micro_batch_size=4"],
}


# ---------------------------------------------------------------------------------------------------- running
class Log:
    """One step's log file: every command, its exit status, time and output."""

    def __init__(self, path: Path):
        self.path = path
        path.write_text("")

    def write(self, text: str) -> None:
        with self.path.open("a") as f:
            f.write(text if text.endswith("\n") else text + "\n")


def run(cmd: list[str], log: Log, timeout: float, env: dict | None = None) -> tuple[int, float, str]:
    """(exit status, seconds, output) of ``cmd`` from the project root; 124 when it ran past ``timeout`` (killed
    with its process group)."""
    log.write(f"$ {' '.join(map(str, cmd))}")
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = 124
        out += f"\n[gpu_check] killed after {timeout:.0f} s"
    seconds = time.perf_counter() - t0
    log.write(f"{out}\n[exit {code} after {seconds:.1f} s]\n")
    return code, seconds, out


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

    def timeout(self, step: str) -> float:
        limit = TIMEOUTS[step][0 if self.cuda else 1]
        return min(limit, max(1.0, self.deadline - time.perf_counter())) if self.deadline else limit

    def train_args(self, name: str, folder: Path) -> list[str]:
        dtype = "bfloat16" if self.cuda else "float32"
        return [f"device={self.device}", f"model.dtype={dtype}", "progress=false", f"hydra.run.dir={folder}",
                f"paths.output_root={self.out / 'outputs'}", f"paths.cache_dir={self.cache}"]

    def sizes(self) -> list[str]:
        n = (2000, 300) if self.cuda else (160, 60)
        return [f"dataset.n_train={n[0]}", f"dataset.n_eval={n[1]}", f"dataset.n_ood={n[1]}"]

    # ------------------------------------------------------------------------------------------------ steps
    def tests(self, log: Log, timeout: float) -> dict:
        import importlib.util

        missing = [m for m in ("pytest", "xdist") if importlib.util.find_spec(m) is None]
        if missing:   # a plain install: the test tools are the dev extra
            return {"ok": False, "seconds": 0.0, "figures": {"error": f"{', '.join(missing)} not installed: "
                                                                      "pip install -e '.[dev]' (or make setup)"}}
        cmd = [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        if self.cuda:
            workers = max(2, min(8, (os.cpu_count() or 2) // 2))
            cmd += ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder", "-m", "not slow and not slurm"]
        else:
            cmd += ["-n", "2", *CPU_TESTS]
        code, seconds, out = run(cmd, log, timeout)
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", out.splitlines()[-1]
                                                   if out.strip() else "")}
        cuda_skips = len(re.findall(r"SKIPPED.*(?:cuda|gpu|CUDA|GPU)", out))
        ok = code == 0 and not counts.get("failed") and not counts.get("error") and not counts.get("errors")
        return {"ok": ok and not cuda_skips, "seconds": seconds, "figures": {**counts, "skipped_for_cuda": cuda_skips,
                                                                           "scope": "suite" if self.cuda else
                                                                           ", ".join(CPU_TESTS)}}

    def methods(self, log: Log, timeout: float) -> dict:
        figures, ok, t0 = {}, True, time.perf_counter()
        for name, args in METHODS.items():
            left = timeout - (time.perf_counter() - t0)
            folder = self.out / "runs" / name
            shutil.rmtree(folder, ignore_errors=True)   # a fresh run folder each time the check runs
            if not self.cuda:
                args = [*args, *CPU_METHODS.get(name, [])]
            code, seconds, _ = run([self.python, "train.py", *args, *self.sizes(), *self.train_args(name, folder)],
                                   log, left)
            row = {"exit": code, "seconds": round(seconds, 1)}
            metrics = _read_json(folder / "metrics.json")
            if code == 0 and metrics:
                first = next(iter(metrics.values()))
                row.update({k: first.get(k) for k in ("win_rate", "ece", "probe/spearman") if k in first})
            ok &= code == 0
            figures[name] = row
        return {"ok": ok, "seconds": time.perf_counter() - t0, "figures": figures}

    def resume(self, log: Log, timeout: float) -> dict:
        figures, ok, t0 = {}, True, time.perf_counter()
        for name, args in RESUME.items():
            budget = (timeout - (time.perf_counter() - t0)) / (len(RESUME) - len(figures))
            row = self._resume_one(name, [*args, *self.sizes()], log, budget)
            ok &= row.pop("ok")
            figures[name] = row
        return {"ok": ok, "seconds": time.perf_counter() - t0, "figures": figures}

    def _resume_one(self, name: str, args: list[str], log: Log, budget: float) -> dict:
        t0 = time.perf_counter()
        base = self.out / "resume" / name
        shutil.rmtree(base, ignore_errors=True)
        runs = {}
        for label in ("uninterrupted", "again"):
            folder = base / label
            code, _, _ = run([self.python, "train.py", *args, *self.train_args(name, folder)], log,
                             budget - (time.perf_counter() - t0))
            if code != 0:
                return {"ok": False, "error": f"the {label} run exited {code}"}
            runs[label] = folder
        folder = base / "stopped"
        cmd = [self.python, "train.py", *args, *self.train_args(name, folder), "checkpoint.every_steps=1"]
        log.write(f"$ {' '.join(cmd)}   (SIGTERM once a training checkpoint exists)")
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
        stopped = False
        try:
            deadline = time.perf_counter() + max(1.0, budget - (time.perf_counter() - t0))
            while time.perf_counter() < deadline and child.poll() is None:
                if any((folder / "checkpoint").rglob("*.safetensors")):
                    os.kill(child.pid, signal.SIGTERM)
                    stopped = True
                    break
                time.sleep(0.05)
            out, _ = child.communicate(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, _ = child.communicate()
        log.write(f"{out}\n[exit {child.returncode}]")
        if not stopped:
            return {"ok": False, "error": "training ended before a checkpoint was seen: nothing was interrupted"}
        step = re.search(r"interrupted by SIG\w+ at step (\d+)", out)
        code, _, _ = run(cmd, log, budget - (time.perf_counter() - t0))
        status = _read_json(folder / "status.json") or {}
        if code != 0 or status.get("state") != "completed" or "resumed" not in status:
            return {"ok": False, "error": f"the relaunch exited {code} with state {status.get('state')}"}
        resumed = _max_difference(runs["uninterrupted"], folder)
        run_to_run = _max_difference(runs["uninterrupted"], runs["again"])
        # a resume bug moves rewards by ~lr (1e-3 and more); float32 sums reduced by several CPU threads already
        # differ by ~2e-6 between two uninterrupted processes (MCD-DPO, 2 threads, measured)
        allowed = max(1e-5, 4 * run_to_run)
        return {"ok": resumed <= allowed, "stopped_at_step": int(step.group(1)) if step else None,
                "resumed_vs_uninterrupted": resumed, "run_to_run": run_to_run, "allowed": allowed}

    def bench(self, log: Log, timeout: float) -> dict:
        path = self.out / "bench_gpu.json"
        cmd = [self.python, "scripts/bench_gpu.py", "--out", str(path), "--cache-dir", str(self.cache)]
        if not self.cuda:
            cmd.append("--smoke")
        code, seconds, _ = run(cmd, log, timeout)
        result = _read_json(path) if code == 0 else None
        figures = {}
        for shape, data in (result or {}).get("shapes", {}).items():
            for key, row in data.get("measurements", {}).items():
                if "error" in row:
                    figures[f"{shape}/{key}"] = row["error"][:80]
                    continue
                figures[f"{shape}/{key}"] = {k: _round(row.get(k)) for k in
                                             ("tokens_per_s", "mfu", "measured_over_planned") if row.get(k)}
            figures.update({f"{shape}/ratio/{k}": round(v, 3) for k, v in data.get("ratios", {}).items()})
        return {"ok": code == 0, "seconds": seconds, "figures": figures}

    def mission(self, log: Log, timeout: float) -> dict:
        t0 = time.perf_counter()
        folder = self.out / "mission"
        shutil.rmtree(folder, ignore_errors=True)
        cache = self.out / "cache-mission"   # its own feature cache: the extraction is measured, never a cache hit
        if self.cuda:
            model = self.cache / "models" / "random-qwen3-4b"
            code, _, _ = run([self.python, __file__, "--build-random", "qwen3-4b", "--into", str(model),
                              "--cache-dir", str(self.cache)], log, timeout / 2)
            if code != 0:
                return {"ok": False, "seconds": time.perf_counter() - t0,
                        "figures": {"error": f"building the random 4B backbone exited {code}"}}
            args = ["method=ens_mlp", "model=qwen3-4b", f"model.path={model}", "also_evaluate=[]"]
        else:
            args = ["method=ens_mlp", "also_evaluate=[]", "dataset.n_train=2000", "dataset.n_eval=500",
                    "dataset.n_ood=500"]
        shutil.rmtree(cache / "features", ignore_errors=True)
        common = [a for a in self.train_args("mission", folder) if not a.startswith(("paths.cache_dir", "model.dtype"))]
        if cache != self.cache:
            (cache / "models").mkdir(parents=True, exist_ok=True)
            for built in (self.cache / "models").glob("tiny-qwen3-*"):   # the tokenizer / tiny model, not rebuilt
                link = cache / "models" / built.name
                if not link.exists():
                    link.symlink_to(built)
        code, seconds, out = run([self.python, "train.py", *args, *common, f"paths.cache_dir={cache}"], log,
                                 timeout - (time.perf_counter() - t0))
        status = _read_json(folder / "status.json") or {}
        feats = status.get("features", {})
        memory = status.get("device_memory", {})
        extraction = feats.get("seconds_extracting")
        figures = {"wall_s": round(seconds, 1), "run_s": status.get("seconds_total"),
                   "extraction_s": extraction, "backbone_passes": feats.get("backbone_forward_passes"),
                   "wall_over_extraction": round(seconds / extraction, 2) if extraction else None,
                   "peak_allocated_gib": _round(memory.get("peak_allocated_bytes", 0) / 2**30) if memory else None}
        return {"ok": code == 0 and status.get("state") == "completed", "seconds": time.perf_counter() - t0,
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


def build_random(shape: str, into: Path, cache_dir: Path) -> None:
    """A random-init checkpoint of a shipped shape in bf16 on the GPU, with the tiny model's tokenizer (its ids are
    a subset of the vocabulary), saved once: what the mission step loads through ``model.path``."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from rewarduq_exp.models.shapes import SHAPES_DIR
    from rewarduq_exp.models.tiny_qwen3 import ensure_tiny_qwen3, save_checkpoint

    if (into / "model.safetensors").exists():
        return
    fields = json.loads((SHAPES_DIR / f"{shape}.json").read_text())
    fields.pop("architectures", None)
    tok = AutoTokenizer.from_pretrained(ensure_tiny_qwen3(cache_dir))
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = AutoModel.from_config(config, dtype=torch.bfloat16)
    tmp = into.with_name(into.name + ".part")
    tmp.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, tmp)
    tok.save_pretrained(tmp)
    tmp.rename(into)


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
    lines = ["| step | result | seconds | figures |", "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {'pass' if r['ok'] else 'FAIL'} | {r['seconds']:.0f} | {_describe(r['figures'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/gpu_check", help="folder for the summary, logs and bench JSON")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    parser.add_argument("--device", default="auto", help="auto (a GPU when visible) | cuda | cpu")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"the whole check's time: each step gets at most what is left (default on a GPU: "
                             f"{GPU_BUDGET_S}; on a CPU: the sum of the step timeouts)")
    parser.add_argument("--build-random", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--into", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default="outputs/cache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.build_random:
        build_random(args.build_random, Path(args.into), Path(args.cache_dir))
        return 0
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"--steps: unknown {', '.join(unknown)}; allowed: {', '.join(STEPS)}")
    check = Check(args)
    budget = args.budget_s or (GPU_BUDGET_S if check.cuda else None)
    if budget:
        check.deadline = time.perf_counter() + budget
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    print(f"gpu_check on {check.device}; results in {check.out}", flush=True)
    results = {}
    for step in steps:
        log = Log(check.out / f"{step}.log")
        try:
            result = getattr(check, step)(log, check.timeout(step))
        except Exception as err:   # one broken step is recorded; the others still run
            log.write(f"[gpu_check] {type(err).__name__}: {err}")
            result = {"ok": False, "seconds": 0.0, "figures": {"error": f"{type(err).__name__}: {err}"[:200]}}
        results[step] = result
        verdict = "pass" if result["ok"] else "FAIL"
        print(f"{step}: {verdict} ({result['seconds']:.0f} s) {_describe(result['figures'])}", flush=True)
    table = summary_table(results)
    summary = {"device": check.device, "steps": results}
    if check.cuda:
        import torch

        summary["device_name"] = torch.cuda.get_device_name(0)
        summary["torch"] = torch.__version__
    from rewarduq_exp.core.atomic_write import write_atomic
    from rewarduq_exp.core.strict_json import write_json

    write_json(check.out / "summary.json", summary)
    write_atomic(check.out / "summary.md", f"# gpu_check on {check.device}\n\n{table}\n")
    print(table, flush=True)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
