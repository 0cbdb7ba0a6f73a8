"""Every benchmark script runs (tiny sizes): a broken script (scripts/bench_mcd.py once died with a NameError) cannot
land again. The numbers are not checked here (tests never assert timings); each script prints its ratio against the
naive way measured in the same run, and the smoke run checks that line is there."""

from pathlib import Path

import pytest
from entry_points import run_entry_point

ROOT = Path(__file__).resolve().parents[1]
# script -> (arguments for a tiny run, a phrase of the ratio line it prints)
SMOKE = {
    "bench_checkpoint.py": (["--smoke"], "ratio: one checkpoint save / one training step"),
    "bench_data.py": (["--pairs", "40"], "faster than naive"),
    "bench_downstream.py": (["--prompts", "2", "--n-max", "16"], "speed-up"),
    "bench_feature_cache.py": (["--smoke"], "speed-up"),
    "bench_gpu.py": (["--smoke"], "sequential passes / batched multi-LoRA"),
    "bench_heads.py": (["--pairs", "128", "--dim", "16", "--heads", "3", "--repeats", "1"], "speed-up"),
    "bench_lora.py": (["--members", "2", "--texts", "4", "--repeats", "1", "--train-pairs", "4"], "training speed-up"),
    "bench_mcd.py": (["--samples", "2", "--batch", "2", "--length", "12", "--repeats", "1"], "ratio"),
    "bench_metrics_and_heads.py": (["--smoke"], "training speed-up"),
    "bench_probe.py": (["--smoke"], "fraction of ideal"),
    "bench_ranking.py": (["--smoke"], "speed-up"),
    "bench_rl.py": (["--smoke"], "ratio: per-step scoring / one-batch scoring"),
    "bench_serve.py": (["--smoke", "--cache-dir", "{cache}"], "served / in-process one call: median"),
    "bench_shared_prefix.py": (["--smoke"], "speed-up"),
    "bench_whole_process.py": (["--smoke", "--cache-dir", "{cache}"], "speed-up (baseline / this)"),
}


def test_every_benchmark_script_has_a_smoke_run():
    assert sorted(p.name for p in (ROOT / "scripts").glob("bench*.py")) == sorted(SMOKE)


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_script_runs(script, tmp_path, request):
    args, phrase = SMOKE[script]
    if "{cache}" in args:   # the tiny model built once for the test session, not again in this run's own cache
        args = [str(request.getfixturevalue("shared_cache")) if a == "{cache}" else a for a in args]
    # as `python scripts/<script>`; the serving benchmark starts its server as a spawned process, which imports the
    # script as a module of its own: a process of its own here too
    proc = run_entry_point(ROOT / "scripts" / script, args, tmp_path, fresh_process=script == "bench_serve.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert phrase in proc.stdout, proc.stdout[-2000:]
