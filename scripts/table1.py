"""Build RewardUQ Table 1 (selected hyperparameters per method and backbone) from sweep folders.

    python scripts/table1.py outputs/multirun/sweep_ens_mlp_* outputs/multirun/sweep_bay_lin_*
    python scripts/table1.py outputs/multirun --out paper/tables

Each (method, backbone) is selected exactly as scripts/select_runs.py does (same options and defaults). Prints the table
as Markdown and writes table1.md and table1.tex into --out (default: <first folder>/selection).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rewarduq_exp.analysis.selection import add_selection_arguments, criteria_from_args, select
from rewarduq_exp.analysis.table1 import table1_latex, table1_markdown
from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.runner.cli import fail
from rewarduq_exp.runs.run_records import find_runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="sweep folders, run folders, or any folders containing them")
    add_selection_arguments(parser)
    parser.add_argument("--out", type=Path, help="where table1.md/.tex go (default: <first folder>/selection)")
    args = parser.parse_args(argv)

    out = args.out or Path(args.folders[0]) / "selection"
    try:
        selections = select(find_runs(args.folders), criteria_from_args(args))
    except UserError as err:
        fail(str(err), err.exit_code)
    markdown = table1_markdown(selections)
    write_atomic(out / "table1.md", markdown)
    write_atomic(out / "table1.tex", table1_latex(selections))
    print(markdown)
    print(f"wrote {out / 'table1.md'} and {out / 'table1.tex'}")


if __name__ == "__main__":
    main()
