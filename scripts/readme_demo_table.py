"""The README's demo table, produced by the demo itself.

Runs what ``make demo`` runs (``python train.py``, the default experiment; its run folder goes to a temporary
directory, which changes no number) and compares the table it prints with the block under the README's
``<!-- demo table -->`` marker: exit 0 when they are equal up to the float noise between CPUs (below), else a diff
and exit 1. ``--write`` puts the printed table
into the README instead. ``make demo-check`` runs the comparison, and CI runs it on a fresh clone, so the README shows
what a new user's ``make demo`` prints.

    python scripts/readme_demo_table.py [--write] [--output <file with a run's stdout>]
"""

from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = "<!-- demo table: scripts/readme_demo_table.py writes and checks the block below -->"


def printed_table(stdout: str) -> list[str]:
    """The summary table a run printed: from its header (``dataset ...``) to the ``mean uncertainty`` line, without
    the dashed rules."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("dataset ")), None)
    if start is None:
        raise SystemExit("the run printed no summary table (no line starting with 'dataset ')")
    table = []
    for line in lines[start:]:
        if set(line.strip()) <= {"-"}:
            continue
        table.append(line.rstrip())
        if line.startswith("mean uncertainty"):
            return table
    raise SystemExit("the run's summary table has no 'mean uncertainty' line")


def readme_block(text: str) -> tuple[int, int]:
    """(first, end) line indices of the code block's content under the marker."""
    lines = text.splitlines()
    if lines.count(MARKER) != 1:
        raise SystemExit(f"{README} must hold the marker exactly once: {MARKER}")
    fence = lines.index(MARKER) + 1
    if not lines[fence].startswith("```"):
        raise SystemExit(f"{README}: the line after the demo-table marker must open a code block")
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    return fence + 1, end


def run_demo() -> str:
    with tempfile.TemporaryDirectory(prefix="readme-demo-") as tmp:
        proc = subprocess.run([sys.executable, "train.py", f"hydra.run.dir={tmp}/run", "progress=false"], cwd=ROOT,
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the demo failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


# The same seed gives other last digits on another CPU: torch picks its kernels by instruction set (AVX-512, AVX2,
# scalar), whose float sums round differently, and the demo trains on them. Measured on 2026-11-27 against the
# README's table: an AVX2 machine (AMD EPYC) and ATEN_CPU_CAPABILITY=default moved rates by up to 0.002 (2 of 1000
# pairs), ECE by 0.003, the mean width by 0.7 %. A number counts as equal within ABS_TOL + REL_TOL x its size; words and
# whole numbers (the pair counts) must be equal.
ABS_TOL, REL_TOL = 0.005, 0.01


def _same(shown: str, printed: str) -> bool:
    """Two lines of the table, equal word for word, numbers with a decimal point within the tolerance."""
    a, b = shown.replace(",", " ").split(), printed.replace(",", " ").split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        if "." not in x or "." not in y:
            return False
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if abs(fx - fy) > ABS_TOL + REL_TOL * abs(fx):
            return False
    return True


def compare(table: list[str], readme: str) -> list[str]:
    """The unified diff of the README's block against ``table``; empty when they are equal up to the float noise
    between CPUs (``_same``)."""
    first, end = readme_block(readme)
    shown = readme.splitlines()[first:end]
    if len(shown) == len(table) and all(_same(a, b) for a, b in zip(shown, table)):
        return []
    return list(difflib.unified_diff(shown, table, "README.md (demo table)", "make demo", lineterm=""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the printed table into the README")
    parser.add_argument("--output", type=Path, help="a demo run's stdout, instead of running the demo")
    args = parser.parse_args(argv)
    table = printed_table(args.output.read_text() if args.output else run_demo())
    readme = README.read_text()
    if args.write:
        first, end = readme_block(readme)
        lines = readme.splitlines()
        README.write_text("\n".join(lines[:first] + table + lines[end:]) + "\n")
        print(f"wrote the demo table into {README}")
        return 0
    diff = compare(table, readme)
    if diff:
        print("\n".join(diff))
        print("the README's demo table differs from what make demo prints: run python scripts/readme_demo_table.py "
              "--write (and say why the numbers moved in the commit)")
        return 1
    first, end = readme_block(readme)
    if readme.splitlines()[first:end] != table:
        print("the README's demo table is what make demo prints, up to float noise between CPUs (kernels by "
              f"instruction set; tolerance {ABS_TOL} + {REL_TOL:.0%}); this machine prints:\n" + "\n".join(table))
        return 0
    print("the README's demo table is what make demo prints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
