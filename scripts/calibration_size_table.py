"""Recalibration's probability map by calibration size: eval ECE after the map minus the raw eval ECE, for
calibration subsets of 20 to 2000 pairs drawn from each run's calibration split, before the temperature's guards
(maximum-likelihood T) and with them (the defaults), with 95 % intervals over the runs and the share of draws that
made the ECE worse (rewarduq_exp/analysis/calibration_size.py says how the intervals are made and why).

    python scripts/calibration_size_table.py <folders> [--draws 50] [--sizes 20 50 100 ...] [--csv draws.csv]

Each folder is a sweep (or a run, or a parent of them): its runs are grouped by folder and method. Every run needs
the raw scores of a large calibration split and of an eval split in predictions/ (--cal, --eval; the default names
are the synthetic world's). Made for the table in docs/recalibration.md by

    python train.py -m method=ens_mlp,bay_lin seed=0,1,2,3,4,5,6,7 dataset.n_cal=4000 dataset.n_eval=2000 \\
        recalibrate.enabled=false 'eval_datasets=[synthetic_eval,synthetic_cal]' progress=false \\
        hydra.sweep.dir=outputs/calsize/default

(recalibrate.enabled=false lets the calibration split be evaluated; for a run that is already trained,
python evaluate.py run=<run> 'eval_datasets=[synthetic_cal]' recalibrated=false scores it.)
"""

import argparse
from pathlib import Path

import pandas as pd

from rewarduq_exp.analysis.calibration_size import SIZES, run_differences, size_summary, size_table
from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.runner.cli import fail
from rewarduq_exp.runs.run_records import find_runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="sweep folders, run folders, or folders holding them")
    parser.add_argument("--cal", default="synthetic_cal", help="the calibration split's predictions (default "
                        "synthetic_cal)")
    parser.add_argument("--eval", default="synthetic_eval", dest="evaluated",
                        help="the evaluated split's predictions (default synthetic_eval)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="calibration sizes (pairs)")
    parser.add_argument("--draws", type=int, default=50, help="subsets per size and run (default 50; the docs' "
                        "table used 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", type=Path, help="also write every draw's difference here")
    args = parser.parse_args(argv)
    try:
        if args.draws < 2:
            raise UserError(f"--draws={args.draws} is invalid: must be an integer >= 2")
        frames = []
        for folder in args.folders:
            runs = [r for r in find_runs([folder]) if r.state == "completed"]
            if not runs:
                raise UserError(f"{folder}: no completed run folder at or below it")
            for i, record in enumerate(runs):
                found = run_differences(record.path, args.cal, args.evaluated, sizes=args.sizes, draws=args.draws,
                                        seed=args.seed + i)
                frames.append(found.assign(group=f"{folder.name} {record.method}", run=record.path.name))
    except UserError as err:
        fail(str(err), err.exit_code)
    per_draw = pd.concat(frames, ignore_index=True)
    if args.csv:   # whole or not at all: a temporary name, then renamed
        write_atomic(args.csv, per_draw.to_csv(index=False))
    print("eval ECE after the probability map minus raw, mean over runs [95 % t-interval over runs]; worse: share of "
          "draws with a higher ECE than raw")
    print(size_table(size_summary(per_draw)))


if __name__ == "__main__":
    main()
