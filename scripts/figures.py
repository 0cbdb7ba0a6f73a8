"""Draw the RewardUQ paper's figures (2, 3, 4 and 5) from run folders.

    python scripts/figures.py outputs/multirun/sweep_*                       # RewardBench if the runs have it
    python scripts/figures.py outputs/multirun --dataset ultrafeedback_test --models qwen3-0.6b qwen3-4b

Each (method, backbone, training dataset) is shown with the configuration the selection rule picks on
--select-dataset (as scripts/select_runs.py), or the best --rank one when none passes (hatched bars, noted in titles).
Writes figure2_rs, figure3_calibration, figure4_ranking_score and figure5_metrics as PNG and PDF into --out (default:
<first folder>/figures); a figure without data is skipped with a note.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed; the figures are files

from rewarduq_exp.analysis.paper_figures import (
    check_dataset,
    check_models,
    default_dataset,
    figure2,
    figure3,
    figure4,
    figure5,
    shown_configurations,
)
from rewarduq_exp.analysis.selection import add_selection_arguments, criteria_from_args, select
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.runner.cli import fail
from rewarduq_exp.runs.run_records import find_runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="sweep folders, run folders, or any folders containing them")
    parser.add_argument("--dataset", help="evaluation dataset to plot (default: reward_bench_filtered when the runs "
                                          "have it, else --select-dataset)")
    parser.add_argument("--models", nargs="+", help="backbones for Figure 3 (default: all)")
    parser.add_argument("--out", type=Path, help="output folder (default: <first folder>/figures)")
    add_selection_arguments(parser, dataset_option="--select-dataset")
    args = parser.parse_args(argv)

    out = args.out or Path(args.folders[0]) / "figures"
    try:
        records = [r for r in find_runs(args.folders) if r.state == "completed"]
        if not records:
            raise UserError("no completed runs in the given folders; figures need metrics.json")
        criteria = criteria_from_args(args)
        dataset = args.dataset or default_dataset(records, criteria.dataset)
        check_dataset(records, dataset)
        shown = shown_configurations(select(records, criteria))
        check_models(shown, args.models)
    except UserError as err:
        fail(str(err), err.exit_code)

    print(f"plotting {dataset}; one configuration per method/backbone, chosen on {criteria.describe()}:")
    for x in shown:
        settings = ", ".join(f"{k}={x.configuration.hyperparameters.get(k)}" for k in x.searched)
        print(f"  {x.method} / {x.model} ({x.train_dataset}): {x.how}, {x.configuration.n_seeds} seed(s)"
              + (f", {settings}" if settings else ""))
    for name, paths in (("Figure 2 (RS_0.2)", figure2(shown, dataset, out)),
                        ("Figure 3 (calibration)", figure3(shown, dataset, out, args.models)),
                        ("Figure 4 (RS_alpha ranges and weights)", figure4(out, shown=shown, dataset=dataset)),
                        ("Figure 5 (metrics)", figure5(shown, dataset, out))):
        if paths is None:
            print(f"{name}: skipped, no data for {dataset}")
        else:
            print(f"{name}: {', '.join(str(p) for p in paths)}")


if __name__ == "__main__":
    main()
