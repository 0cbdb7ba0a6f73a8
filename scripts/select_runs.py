"""Pick the best configuration of a sweep by the RewardUQ selection rule (paper section 5.1).

    python scripts/select_runs.py outputs/multirun/<sweep>                   # ECE <= 0.05, EBCE <= 0.01, best rs_0.2
    python scripts/select_runs.py outputs/multirun/part1 outputs/multirun/part2  # a sweep launched in several parts
    python scripts/select_runs.py outputs/multirun/<sweep> --tuned-dir conf/tuned  # install the winners as Table 1

Runs that differ only by seed are one configuration; the thresholds and the ranking use the mean over seeds.
Writes ``selection.csv``, ``selection.md`` and, per method and backbone with a passing configuration, the tuned
config ``<method>/<model>.yaml`` (into --tuned-dir, default --out). When nothing passes, it says so, lists the
closest configurations and exits 0: that is a result, not an error.
"""


import argparse
from pathlib import Path

from rewarduq_exp.analysis.selection import add_selection_arguments, criteria_from_args, select
from rewarduq_exp.analysis.selection_report import stdout_summary, write_selection
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.runner.cli import fail
from rewarduq_exp.runs.run_records import find_runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="sweep folders, run folders, or any folders containing them")
    add_selection_arguments(parser)
    parser.add_argument("--out", type=Path, help="where selection.csv/.md go (default: <first folder>/selection)")
    parser.add_argument("--tuned-dir", type=Path, help="where <method>/<model>.yaml go (default: --out)")
    args = parser.parse_args(argv)

    out = args.out or Path(args.folders[0]) / "selection"
    try:
        selections = select(find_runs(args.folders), criteria_from_args(args))
        tuned = write_selection(selections, out, args.tuned_dir or out, args.folders)
    except UserError as err:
        fail(str(err), err.exit_code)
    print(stdout_summary(selections, tuned))
    print(f"\nwrote {out / 'selection.md'} and {out / 'selection.csv'}")


if __name__ == "__main__":
    main()
