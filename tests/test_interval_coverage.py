"""The coverage of the downstream intervals with known truth (rewarduq_exp/downstream/interval_coverage.py): a few
cases with fewer studies in the default run, the whole grid that docs/downstream.md reports under the ``coverage``
marker (``make test-coverage``, which .ci/run runs)."""

import numpy as np
import pytest

# The coverage suite (rewarduq_exp/downstream/interval_coverage.py): a few cases with fewer studies here, the whole
# grid (2000 studies a case, as docs/downstream.md reports it) under the coverage marker (make test-coverage).
FAST = {"one run, 32 skewed prompts": 0.93, "3 runs x 32 prompts, normal": 0.92,
        "flat curve, 1 run x 16 prompts: false alarms": 0.05,
        "5 worlds (5 runs x 32 prompts each), normal world effects": 0.92}


@pytest.mark.parametrize("name", sorted(FAST))
def test_coverage_with_known_truth_fast_cases(name):
    from rewarduq_exp.downstream.interval_coverage import cases, measure

    (case,) = [c for c in cases() if c.name == name]
    found = measure(case, studies=300, draws=500, seed=1)
    if case.kind == "drop":
        assert found.coverage <= FAST[name], found
    else:
        # 300 studies: a standard error of about 1.3 points, so the fast bound sits below the grid's 0.93
        assert found.coverage >= FAST[name], found
        if not np.isnan(found.former):
            assert found.former < found.coverage   # the former interval covered less on the same studies


@pytest.mark.coverage
@pytest.mark.parametrize("index", range(16))
def test_coverage_with_known_truth_full_grid(index):
    from rewarduq_exp.downstream.interval_coverage import GRID_DRAWS, GRID_STUDIES, cases, measure

    grid = cases()
    assert len(grid) == 16
    found = measure(grid[index], studies=GRID_STUDIES, draws=GRID_DRAWS)
    assert found.passed, (grid[index].name, found.coverage)


def test_the_script_prints_the_table_and_refuses_a_case_it_does_not_have(tmp_path):
    from pathlib import Path

    from entry_points import run_entry_point

    script = Path(__file__).resolve().parents[1] / "scripts" / "interval_coverage.py"
    proc = run_entry_point(script, ["--studies", "30", "--draws", "200", "--only", "worlds"], tmp_path)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert "| 5 worlds (5 runs x 32 prompts each), normal world effects | 30 |" in proc.stdout
    assert "4 cases, 30 studies each" in proc.stdout
    bad = run_entry_point(script, ["--only", "nothing like it"], tmp_path)
    assert bad.returncode == 2 and "matches no case" in bad.stderr
