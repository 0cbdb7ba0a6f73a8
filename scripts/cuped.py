"""CUPED for an A/B test with a pre-period covariate such as BoRP scores (BoRP section 5.3).

    python scripts/cuped.py --metric users.csv --metric-col retained --covariate pre.parquet --covariate-col borp
    python scripts/cuped.py --metric users.csv --metric-col retained --covariate-col borp_pre --group-col arm \\
        --lift 0.002 --json cuped.json

Prints theta = cov(Y, X) / var(X), the variance reduction rho^2 (var(Y_cuped) / var(Y) = 1 - rho^2) and the users per
arm a two-sided z-test needs to detect the given relative lift (alpha 0.05, power 0.8 by default) without and with
CUPED; with --group-col also each arm's difference to the control arm, raw and CUPED-adjusted. Tables are CSV or
parquet with one row per user; without --covariate, the covariate column is read from the metric table. The
computation is rewarduq_exp.analysis.cuped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rewarduq_exp.analysis.cuped import cuped_analysis, join_user_tables, read_table
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.strict_json import write_json
from rewarduq_exp.runner.cli import fail


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metric", type=Path, required=True, help="per-user table with the metric (CSV/parquet)")
    parser.add_argument("--covariate", type=Path, help="per-user table with the covariate (default: --metric)")
    parser.add_argument("--user-col", default="user_id", help="user id column in both tables (default user_id)")
    parser.add_argument("--metric-col", required=True, help="the experiment metric Y")
    parser.add_argument("--covariate-col", required=True, help="the pre-period covariate X (e.g. BoRP scores)")
    parser.add_argument("--group-col", help="treatment / arm column of the metric table (optional)")
    parser.add_argument("--control", help="the control arm's value of --group-col (default: first in sorted order)")
    parser.add_argument("--lift", type=float, default=0.002, help="relative lift to detect (default 0.002 = 0.2%%)")
    parser.add_argument("--alpha", type=float, default=0.05, help="two-sided significance level (default 0.05)")
    parser.add_argument("--power", type=float, default=0.8, help="power (default 0.8)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = parser.parse_args(argv)

    try:
        metric = read_table(args.metric)
        covariate = read_table(args.covariate) if args.covariate else None
        frame, dropped = join_user_tables(
            metric, covariate, user_col=args.user_col, metric_col=args.metric_col, covariate_col=args.covariate_col,
            group_col=args.group_col, metric_source=str(args.metric),
            covariate_source=str(args.covariate or args.metric))
        report = cuped_analysis(frame["y"], frame["x"], lift=args.lift, alpha=args.alpha, power=args.power,
                                groups=frame["group"] if args.group_col else None, control=args.control)
    except UserError as err:
        fail(str(err), err.exit_code)
    if dropped["unmatched"] or dropped["missing_values"]:
        print(f"dropped {dropped['unmatched']} users without a covariate row and {dropped['missing_values']} with "
              "missing values")
    print(report.text())
    if args.json:
        write_json(args.json, {**report.as_dict(), "dropped": dropped})  # undefined numbers as null
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
