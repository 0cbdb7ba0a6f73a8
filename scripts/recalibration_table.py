"""Recalibration before and after, over run folders: ECE, EBCE, RS_0.2, CT, CF raw -> recalibrated per method and
evaluated set (means over seeds, range in brackets), the fitted temperature T and the applied interval scale s with
which one it is (the interval column: rule, conformal or none; an evaluation's recal@<interval>/ metrics get rows of
their own), the conformal scale and its realised CF share against alpha; for rated responses (BoRP) coverage and
width.

    python scripts/recalibration_table.py outputs/multirun/<sweep> [more folders] [--csv rows.csv] [--intervals]

--intervals adds a second table: recalibrated minus raw with 95 % intervals from a paired bootstrap over the evaluated
pairs and the row's runs (rewarduq_exp/analysis/recalibration_intervals.py; about 10 ms per run and draw).
"""

import argparse
from pathlib import Path

from rewarduq_exp.analysis.recalibration_report import recalibration_rows, recalibration_table
from rewarduq_exp.runs.run_records import find_runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="sweep folders, run folders, or folders containing them")
    parser.add_argument("--csv", type=Path, help="also write one row per run and evaluated set here")
    parser.add_argument("--intervals", action="store_true", help="also the differences with 95 %% intervals")
    parser.add_argument("--draws", type=int, default=1000, help="bootstrap draws of --intervals (default 1000)")
    args = parser.parse_args(argv)
    rows = recalibration_rows(find_runs(args.folders))
    if args.csv:
        rows.to_csv(args.csv, index=False)
    print(recalibration_table(rows))
    if args.intervals:
        from rewarduq_exp.analysis.recalibration_intervals import interval_rows, interval_table

        print("\nrecalibrated − raw, mean over the runs [95 % interval, paired bootstrap over pairs and runs]:")
        print(interval_table(interval_rows(rows, draws=args.draws)))


if __name__ == "__main__":
    main()
