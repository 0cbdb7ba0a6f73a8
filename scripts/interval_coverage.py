"""The coverage of the downstream intervals with known truth: every case of the grid simulated ``--studies`` times,
the interval of rewarduq_exp/downstream/statistics.py against the value it should cover, beside the intervals the
project used before on the same studies (rewarduq_exp/downstream/interval_coverage.py says what each case is).

    python scripts/interval_coverage.py                          # the whole grid: 2000 studies a case
    python scripts/interval_coverage.py --studies 200 --only flat  # the cases whose name holds "flat"

Prints the Markdown table docs/downstream.md shows; exits 1 when a case misses its target.
"""

import argparse
import sys
import time

from rewarduq_exp.downstream.interval_coverage import GRID_DRAWS, GRID_STUDIES, cases, coverage_table, measure


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--studies", type=int, default=GRID_STUDIES, help=f"studies a case (default {GRID_STUDIES})")
    parser.add_argument("--draws", type=int, default=GRID_DRAWS, help=f"bootstrap draws (default {GRID_DRAWS})")
    parser.add_argument("--only", default="", help="only the cases whose name contains this text")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.studies < 1 or args.draws < 100:
        parser.error(f"--studies must be >= 1 and --draws >= 100 (got {args.studies}, {args.draws})")
    chosen = [c for c in cases() if args.only in c.name]
    if not chosen:
        parser.error(f"--only {args.only!r} matches no case; the cases: " + "; ".join(c.name for c in cases()))
    start, results = time.perf_counter(), []
    for case in chosen:
        results.append(measure(case, args.studies, args.draws, args.seed))
        print(f"{case.name}: {results[-1].coverage:.3f}", file=sys.stderr, flush=True)
    print(coverage_table(results))
    print(f"\n{len(results)} cases, {args.studies} studies each, {args.draws} draws: "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
