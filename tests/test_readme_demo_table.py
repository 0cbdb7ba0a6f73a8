"""The README's demo table is the demo's own output (scripts/readme_demo_table.py).

``make demo-check`` (run by CI on a fresh clone) runs the demo and compares; here, without running it: the README
holds one marked block in the shape the demo prints, and the comparison finds a changed value. The slow acceptance
test (tests/test_acceptance.py, full size) compares a real default run with the README too.
"""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("readme_demo_table", ROOT / "scripts" / "readme_demo_table.py")
readme_demo_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_demo_table)

PRINTED = """some log line
------------------------------
dataset         pairs  win_rate
------------------------------
synthetic_eval   1000    0.7820
synthetic_ood    1000    0.5200
------------------------------
mean uncertainty (reward-interval width): synthetic_eval 0.6518, synthetic_ood 1.4760
backbone forward passes: 78
"""


def test_the_printed_table_is_read_without_rules_or_the_lines_around_it():
    assert readme_demo_table.printed_table(PRINTED) == [
        "dataset         pairs  win_rate", "synthetic_eval   1000    0.7820", "synthetic_ood    1000    0.5200",
        "mean uncertainty (reward-interval width): synthetic_eval 0.6518, synthetic_ood 1.4760"]


def test_the_readme_block_has_the_demo_shape_and_a_changed_value_is_a_difference():
    readme = readme_demo_table.README.read_text()
    first, end = readme_demo_table.readme_block(readme)
    block = readme.splitlines()[first:end]
    assert block[0].split()[:3] == ["dataset", "pairs", "win_rate"]
    # each dataset's row, with its recalibrated row under it (rewarduq_exp/recalibration)
    assert [line.split()[0] for line in block[1:-1]] == ["synthetic_eval", "recalibrated", "synthetic_ood",
                                                         "recalibrated"]
    assert block[-1].startswith("mean uncertainty")
    assert readme_demo_table.compare(block, readme) == []
    changed = [block[0], block[1].replace("1000", "1001", 1), *block[2:]]
    diff = readme_demo_table.compare(changed, readme)
    assert any(line.startswith("+synthetic_eval   1001") for line in diff)
    # another CPU's last digits (AVX2 against the README's machine, measured) pass; a real change does not
    cells = block[1].split()
    noisy = block[1].replace(cells[5], f"{float(cells[5]) + 0.002:.4f}", 1)
    assert readme_demo_table.compare([block[0], noisy, *block[2:]], readme) == []
    moved = block[1].replace(cells[5], f"{float(cells[5]) + 0.02:.4f}", 1)
    assert readme_demo_table.compare([block[0], moved, *block[2:]], readme) != []
