"""scripts/select.py, table1.py and figures.py end to end on fake run folders, plus Table 1 and figure units."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_runs import block, make_run
from omegaconf import OmegaConf

from rewarduq_exp.paper_figures import figure3, shown_configurations
from rewarduq_exp.run_records import find_runs
from rewarduq_exp.selection import select
from rewarduq_exp.table1 import model_order, table1_frame, table1_latex, table1_markdown

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """Two methods x two backbones x two learning rates x two seeds, in two parts; BAY-LIN on 4B never passes."""
    root = tmp_path_factory.mktemp("multirun")
    for method in ("ens_mlp", "bay_lin"):
        for model in ("qwen3-4b", "qwen3-0.6b"):
            for lr, gain in ((1e-3, 0.1), (1e-2, 0.0)):
                for seed in (0, 1):
                    ece = 0.08 if (method, model) == ("bay_lin", "qwen3-4b") else 0.03
                    rs = 0.2 + gain + 0.01 * seed
                    metrics = {"ultrafeedback_test": block(rs=rs, ece=ece),
                               "reward_bench_filtered": block(rs=rs - 0.05, ece=ece + 0.01)}
                    make_run(root / f"part{seed}", f"{method}-{model}-{lr}-{seed}", method=method, model=model,
                             hp={"learning_rate": lr}, seed=seed, metrics=metrics, with_predictions=True)
    make_run(root / "part0", "crashed", hp={"learning_rate": 1e-4}, state="failed")
    return root


def run_script(name: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_select_script(sweep, tmp_path):
    out = tmp_path / "sel"
    proc = run_script("select.py", sweep / "part0", sweep / "part1", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert (out / "selection.csv").is_file() and (out / "selection.md").is_file()
    # The winner comes first in each group's table, and the group without a passing configuration says so.
    assert "ens_mlp / qwen3-0.6b (trained on ultrafeedback): winner learning_rate=1e-3" in proc.stdout
    assert "bay_lin / qwen3-4b (trained on ultrafeedback): NO configuration passes" in proc.stdout
    assert "not used: 1 failed" in proc.stdout
    tuned = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.yaml"))
    assert tuned == ["bay_lin/qwen3-0.6b.yaml", "ens_mlp/qwen3-0.6b.yaml", "ens_mlp/qwen3-4b.yaml"]
    assert OmegaConf.load(out / "ens_mlp" / "qwen3-4b.yaml").method == {"learning_rate": 1e-3}


def test_select_script_bad_dataset_is_one_line(sweep, tmp_path):
    proc = run_script("select.py", sweep, "--dataset", "nope", "--out", tmp_path / "sel")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "'nope'" in lines[0] and "reward_bench_filtered, ultrafeedback_test" in lines[0]
    assert not (tmp_path / "sel").exists()


def test_table1_script(sweep, tmp_path):
    proc = run_script("table1.py", sweep, "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "table1.md").read_text()
    tex = (tmp_path / "table1.tex").read_text()
    assert "| backbone | ENS-MLP η | ENS-MLP RS_0.2 | ENS-MLP ECE | ENS-MLP EBCE | BAY-LIN η |" in md
    assert "| qwen3-4b | 1e-3 | 0.3050 | 0.0300 | 0.0050 | — | — | — | — |" in md
    assert md.index("| qwen3-0.6b |") < md.index("| qwen3-4b |")  # backbones by size
    assert r"\multicolumn{4}{c}{ENS-MLP}" in tex and r"$\eta$" in tex and "---" in tex
    assert md in proc.stdout


def test_figures_script(sweep, tmp_path):
    proc = run_script("figures.py", sweep, "--out", tmp_path, "--models", "qwen3-4b")
    assert proc.returncode == 0, proc.stderr
    assert "plotting reward_bench_filtered" in proc.stdout
    assert "bay_lin / qwen3-4b (ultrafeedback): best rs_0.2, none passes" in proc.stdout
    for stem in ("figure2_rs", "figure3_calibration", "figure5_metrics"):
        png = (tmp_path / f"{stem}.png").read_bytes()
        assert png[:8] == PNG_MAGIC and len(png) > 10_000
        assert (tmp_path / f"{stem}.pdf").stat().st_size > 1_000
    bad = run_script("figures.py", sweep, "--out", tmp_path, "--models", "gpt-5")
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown model(s) gpt-5")


def test_table1_frame_and_latex(sweep):
    selections = select(find_runs([sweep]))
    frame = table1_frame(selections)
    assert list(frame.index) == ["qwen3-0.6b", "qwen3-4b"]
    assert frame.loc["qwen3-4b", ("BAY-LIN", "η")] == "—"
    assert frame.loc["qwen3-0.6b", ("BAY-LIN", "RS_0.2")] == "0.3050"
    assert "none of 2 configurations passes" in table1_markdown(selections)
    assert table1_latex(selections).count(r"\\") == 2 + 2  # two header rows, two backbones
    assert sorted(["qwen3-14b", "skywork-qwen3-0.6b", "qwen3-1.7b", "qwen3-0.6b"], key=model_order) == [
        "qwen3-0.6b", "qwen3-1.7b", "qwen3-14b", "skywork-qwen3-0.6b"]


def test_figure3_skipped_without_predictions(tmp_path):
    make_run(tmp_path, "run", metrics={"ultrafeedback_test": block()})
    shown = shown_configurations(select(find_runs([tmp_path])))
    assert figure3(shown, "ultrafeedback_test", tmp_path / "figs") is None
    assert not (tmp_path / "figs").exists()
