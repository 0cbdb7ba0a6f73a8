"""Time whole ``train.py`` processes on cached features, this checkout against another one, alternating (issue 45).

    python scripts/bench_whole_process.py --baseline /path/to/other/checkout      # e.g. a `git worktree` of main
    python scripts/bench_whole_process.py                                         # this checkout against itself
    python scripts/bench_whole_process.py --smoke                                 # tiny sizes (tests)

For ENS-MLP and BAY-LIN on the synthetic world (8000 training, 1000 eval / ood / calibration pairs) with the tiny
Qwen3 widened to the hidden size of Qwen3-0.6B (1024), each side first runs once to fill its own feature cache (the
two checkouts may key their caches differently), then the two sides alternate ``--repeats`` times: the wall time of
the whole process (start-up, data, cache lookup, training, evaluation, recalibration, figures) and the training
loop's own ``seconds_training`` (from the run's log). Then the metric call (``compute_metrics`` on ``--metric-pairs``
pairs, the RewardUQ families) in a fresh process per side, alternating. Medians with min-max, and the ratio
baseline / this checkout, with the geometric mean of the alternating pairs' ratios and its 95 % paired t-interval.
Both sides use the same interpreter (this one) and the same threads.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from rewarduq_exp.downstream.statistics import paired_t_interval

HERE = Path(__file__).resolve().parents[1]
TRAINED = re.compile(r"'seconds_training': ([0-9.eE+-]+)")

METRIC_CALL = r"""
import sys, time
import numpy as np, pandas as pd
from rewarduq_exp.metrics.rewarduq import compute_metrics
n, repeats = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
c, r, u = rng.normal(size=n), rng.normal(size=n), rng.uniform(0.05, 1.0, size=(2, n))
table = pd.DataFrame({"weight": 1.0, "chosen_reward": c, "chosen_lower": c - u[0], "chosen_upper": c + u[0],
                      "rejected_reward": r, "rejected_lower": r - u[1], "rejected_upper": r + u[1]})
compute_metrics(table)
times = []
for _ in range(repeats):
    t = time.perf_counter(); compute_metrics(table); times.append(time.perf_counter() - t)
print(min(times))
"""


def run_once(root: Path, method: str, overrides: list[str], out: Path) -> tuple[float, float]:
    """(wall seconds of the whole process, seconds_training from its log) of one ``train.py`` run in ``root``."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{method}-", dir=out))
    cmd = [sys.executable, str(root / "train.py"), f"method={method}", "progress=false", *overrides,
           f"paths.output_root={out}", f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, PYTHONPATH=str(root))
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"{root}: train.py method={method} failed:\n{proc.stderr[-2000:]}")
    found = TRAINED.search((run_dir / "train.log").read_text())
    return wall, float(found.group(1)) if found else float("nan")


def metric_call(root: Path, pairs: int, repeats: int) -> float:
    proc = subprocess.run([sys.executable, "-c", METRIC_CALL, str(pairs), str(repeats)], cwd=root,
                          env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, check=True)
    return float(proc.stdout.split()[-1])


def summary(values: list[float], unit: str = "s") -> str:
    return f"{statistics.median(values):8.3f} {unit} ({min(values):.3f}-{max(values):.3f})"


def paired_ratio(baseline: list[float], this: list[float]) -> str:
    """The speed-up of each alternating pair (baseline_i / this_i, the two runs next to each other), as their
    geometric mean with the 95 % paired t-interval of the log ratios (the runs of a pair share the machine's state)."""
    found = paired_t_interval(np.log(np.asarray(baseline) / np.asarray(this)))
    if found.n < 2:
        return "paired: too few pairs for an interval"
    return (f"paired: {np.exp(found.mean):.2f}x, 95 % CI {np.exp(found.lo):.2f}-{np.exp(found.hi):.2f}x "
            f"({int(found.n)} pairs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with (default: this one)")
    parser.add_argument("--methods", default="ens_mlp,bay_lin")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--metric-pairs", type=int, default=100_000)
    parser.add_argument("--hidden", type=int, default=1024, help="the tiny Qwen3's hidden size (Qwen3-0.6B: 1024)")
    parser.add_argument("--out", type=Path, help="where runs and caches go (default: a temporary folder)")
    parser.add_argument("--cache-dir", type=Path, help="one feature cache for both sides (paths.cache_dir; default: "
                        "each side its own under --out, since two checkouts may key their caches differently)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the script runs")
    args = parser.parse_args()
    sizes = ["dataset.n_train=8000", "dataset.n_eval=1000", "dataset.n_ood=1000"]
    if args.smoke:
        args.methods, args.repeats, args.metric_pairs, args.hidden = "bay_lin", 1, 500, 256
        sizes = ["dataset.n_train=200", "dataset.n_eval=100", "dataset.n_ood=100", "metric.diagrams=false"]
    overrides = [f"model.hidden_size={args.hidden}", f"model.build.hidden_size={args.hidden}", *sizes]
    if args.cache_dir:
        overrides.append(f"paths.cache_dir={args.cache_dir.resolve()}")
    sides = {"this": HERE, "baseline": (args.baseline or HERE).resolve()}
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-whole-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"this: {sides['this']}\nbaseline: {sides['baseline']}\nruns and caches: {out}")
    for method in args.methods.split(","):
        for name, root in sides.items():   # fill each side's feature cache (not timed; the smoke run skips it)
            (out / name).mkdir(exist_ok=True)
            if not args.smoke:
                run_once(root, method, overrides, out / name)
        wall: dict[str, list[float]] = {"this": [], "baseline": []}
        loop: dict[str, list[float]] = {"this": [], "baseline": []}
        for i in range(args.repeats):
            for name in (("baseline", "this") if i % 2 == 0 else ("this", "baseline")):
                if args.smoke and name == "baseline" and sides["baseline"] == sides["this"]:
                    continue   # the smoke run checks that the script runs: one process for both sides
                w, s = run_once(sides[name], method, overrides, out / name)
                wall[name].append(w)
                loop[name].append(s)
            if not wall["baseline"]:
                wall["baseline"], loop["baseline"] = list(wall["this"]), list(loop["this"])
        print(f"\n{method}, {args.repeats} alternating runs each, median (min-max):")
        for label, times in (("whole process", wall), ("training loop", loop)):
            ratio = statistics.median(times["baseline"]) / statistics.median(times["this"])
            print(f"  {label:14s} this {summary(times['this'])}   baseline {summary(times['baseline'])}   "
                  f"speed-up (baseline / this): {ratio:.2f}x; {paired_ratio(times['baseline'], times['this'])}")
    calls: dict[str, list[float]] = {"this": [], "baseline": []}
    for i in range(args.repeats):
        for name in (("baseline", "this") if i % 2 == 0 else ("this", "baseline")):
            if args.smoke and name == "baseline" and sides["baseline"] == sides["this"]:
                continue
            calls[name].append(metric_call(sides[name], args.metric_pairs, 5) * 1e3)
    calls["baseline"] = calls["baseline"] or list(calls["this"])
    print(f"\nmetric call on {args.metric_pairs} pairs (best of 5 in a process; {args.repeats} processes each):")
    ratio = statistics.median(calls["baseline"]) / statistics.median(calls["this"])
    print(f"  this {summary(calls['this'], 'ms')}   baseline {summary(calls['baseline'], 'ms')}   "
          f"speed-up (baseline / this): {ratio:.2f}x; {paired_ratio(calls['baseline'], calls['this'])}")


if __name__ == "__main__":
    main()
