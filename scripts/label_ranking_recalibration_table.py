r"""Label ranking before and after temperature recalibration, from run folders (``metric.ranking.recalibrate=true``).

    for d in iris wine glass; do for m in plackett_luce mallows rank_classifier rpc pl_rpc; do
        python train.py dataset=label_ranking/$d method=$m progress=false paths.output_root=/tmp/lr_runs
    done; done
    python scripts/label_ranking_recalibration_table.py /tmp/lr_runs [--csv table.csv]

One row per (dataset, learner), fold means, each cell "raw → recalibrated": rank-wise sub-2 and top-1 ECE, the
full-rank kernel calibration error of the whole ranking (``rank/full/top_<m-1>/ece``), the rank-wise ECE, KL and
Jeffreys values at the largest k the run has (the whole ranking, top-(m-1); RPC, which has pairs only: sub-2), the
fitted temperature (mean ± sd over folds, and how many folds ended at a bound of the search), Kendall tau and the
run's wall time. Where several runs share (dataset, learner), the last one to finish is shown. Runs without
recalibration show their raw values and a dash for the rest. Prints Markdown; ``--csv`` also writes every value.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
from pathlib import Path

from rewarduq_exp.analysis.ranking_report import ABBREVIATIONS, LEARNER_ORDER
from rewarduq_exp.analysis.text_tables import DASH, markdown_table
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.runner.cli import fail
from rewarduq_exp.runs.run_identity import read_status
from rewarduq_exp.runs.run_records import find_runs

_TOP = re.compile(r"^rank/top_(\d+)/ece$")
_SUB = re.compile(r"^rank/sub_(\d+)/ece$")


def largest_k(block: dict) -> str | None:
    """The rank-wise key prefix of the largest k: ``rank/top_<k>`` (the whole ranking when present), else the largest
    ``rank/sub_<k>`` (RPC), else None."""
    for pattern, kind in ((_TOP, "top"), (_SUB, "sub")):
        ks = [int(m.group(1)) for key in block if (m := pattern.match(key))]
        if ks:
            return f"rank/{kind}_{max(ks)}"
    return None


def collect(records) -> list[dict]:
    """One dict per (dataset, learner): the values of the table (NaN where a metric is absent)."""
    latest: dict[tuple[str, str], tuple[str, dict, dict]] = {}
    for rec in records:
        if rec.state != "completed":
            continue
        for dataset, block in rec.metrics.items():
            if "n_folds" not in block or "rank/kendall_tau" not in block:
                continue  # not a label-ranking block
            key = (dataset, rec.method)
            if key not in latest or rec.finished_at >= latest[key][0]:
                latest[key] = (rec.finished_at, block, read_status(rec.path))
    rows = []
    for (dataset, learner), (_, block, status) in latest.items():
        m = int(block.get("n_items", 0))

        def get(key, recal=False):
            value = block.get(f"recal/{key}" if recal else key)
            return float(value) if isinstance(value, (int, float)) else math.nan

        big = largest_k(block)
        folds = (status.get("recalibration") or {}).get("folds") or []
        row = {"dataset": dataset, "m": m, "learner": learner, "largest_k": big.split("/")[1] if big else "",
               "temperature": get("recal/temperature"), "temperature_std": get("recal/temperature_std"),
               "folds_at_bound": sum(bool(f.get("at_bound")) for f in folds),
               "kendall_tau": get("rank/kendall_tau"), "seconds": status.get("seconds_total", math.nan)}
        for name, key in (("sub2_ece", "rank/sub_2/ece"), ("top1_ece", "rank/top_1/ece"),
                          ("full_kernel", f"rank/full/top_{m - 1}/ece"),
                          ("big_ece", f"{big}/ece"), ("big_kl", f"{big}/kl"), ("big_jeff", f"{big}/jeff")):
            row[f"{name}_raw"], row[f"{name}_recal"] = get(key), get(key, recal=True)
        rows.append(row)
    if not rows:
        raise UserError("no completed label-ranking runs found (train some with dataset=label_ranking/<name>)")
    order = {name: i for i, name in enumerate(LEARNER_ORDER)}
    return sorted(rows, key=lambda r: (r["m"], r["dataset"], order.get(r["learner"], len(order)), r["learner"]))


def _num(value: float, digits: int = 3) -> str:
    if value is None or math.isnan(value):
        return DASH
    if value != 0 and (abs(value) >= 1000 or abs(value) < 10 ** -digits):
        return f"{value:.2g}"
    return f"{value:.{digits}f}"


def _pair(row: dict, name: str) -> str:
    raw, recal = row[f"{name}_raw"], row[f"{name}_recal"]
    if math.isnan(raw) and math.isnan(recal):
        return DASH
    return f"{_num(raw)} → {_num(recal)}"


def markdown(rows: list[dict]) -> str:
    header = ["dataset", "m", "learner", "T (folds at bound)", "sub-2 ECE", "top-1 ECE", "full-rank kernel",
              "k*", "ECE at k*", "KL at k*", "Jeffreys at k*", "τ", "s"]
    body = []
    for r in rows:
        t = DASH if math.isnan(r["temperature"]) else (
            f"{_num(r['temperature'], 2)} ± {_num(r['temperature_std'], 2)}"
            + (f" ({r['folds_at_bound']})" if r["folds_at_bound"] else ""))
        body.append([r["dataset"], str(r["m"]), ABBREVIATIONS.get(r["learner"], r["learner"]), t,
                     _pair(r, "sub2_ece"), _pair(r, "top1_ece"), _pair(r, "full_kernel"),
                     r["largest_k"].replace("_", "-") or DASH, _pair(r, "big_ece"), _pair(r, "big_kl"),
                     _pair(r, "big_jeff"), _num(r["kendall_tau"]),
                     DASH if not isinstance(r["seconds"], (int, float)) or math.isnan(r["seconds"])
                     else f"{r['seconds']:.0f}"])
    return markdown_table(header, body)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="run folders, sweep folders, or any folders containing them")
    parser.add_argument("--csv", type=Path, help="also write every value of the table to this CSV file")
    args = parser.parse_args(argv)
    try:
        rows = collect(find_runs(args.folders))
    except UserError as err:
        fail(str(err), err.exit_code)
    print(markdown(rows))
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"written to {args.csv}")


if __name__ == "__main__":
    main()
