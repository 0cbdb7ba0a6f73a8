r"""The calibrated-label-ranking paper's comparison tables and figures from label-ranking run folders.

    python train.py -m dataset=label_ranking/iris,label_ranking/wine \
        method=plackett_luce,mallows,rank_classifier,rpc,pl_rpc
    python scripts/ranking_tables.py outputs/multirun/default --out outputs/ranking_report

Writes ranking_tables.md (Kendall tau, top-1 accuracy, rank-wise and full-rank sub-k / top-k ECE per k: datasets x
learners, fold mean ± std), ranking_metrics.csv (every value) and figures/ece_by_k_<dataset>.png (ECE against k per
learner, rank-wise vs full-rank, sub-k vs top-k) into --out (default: <first folder>/ranking_report), and prints the
Markdown.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rewarduq_exp.analysis.ranking_report import ranking_frame, write_report
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.runner.cli import fail
from rewarduq_exp.runs.run_records import find_runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="sweep folders, run folders, or any folders containing them")
    parser.add_argument("--out", type=Path, help="output folder (default: <first folder>/ranking_report)")
    args = parser.parse_args(argv)
    out = args.out or Path(args.folders[0]) / "ranking_report"
    try:
        markdown = write_report(ranking_frame(find_runs(args.folders)), out)
    except UserError as err:
        fail(str(err), err.exit_code)
    print(markdown)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
