"""RewardUQ Table 1: the selected hyperparameters per method and backbone, with the winner's scores.

Rows are backbones; each method gets a column group with its searched hyperparameters (eta, lambda, gamma, ...)
and the winner's rank metric, ECE and EBCE (means over seeds on the selection dataset). The selection is
:mod:`rewarduq_exp.analysis.selection`, the same as ``scripts/select_runs.py``; "—" marks a backbone where no
configuration passes the thresholds (or that was not run with that method).
"""

from __future__ import annotations

import re

import pandas as pd

from rewarduq_exp.analysis.selection import Selection
from rewarduq_exp.analysis.text_tables import DASH, fmt_number, fmt_setting, markdown_table

METHOD_NAMES = {"ens_mlp": "ENS-MLP", "ens_lora": "ENS-LoRA", "mcd_dpo": "MCD-DPO", "bay_lin": "BAY-LIN"}
# (plain text, LaTeX) header of each hyperparameter: the paper's symbols.
SYMBOLS = {
    "learning_rate": ("η", r"$\eta$"),
    "reg_lambda": ("λ", r"$\lambda$"),
    "center_gamma": ("γ", r"$\gamma$"),
    "beta": ("β", r"$\beta$"),
    "dropout": ("p", r"$p$"),
    "num_heads": ("K", r"$K$"),
}
METRIC_HEADERS = {"rs_0.2": ("RS_0.2", r"RS$_{0.2}$"), "ece": ("ECE", "ECE"), "ebce": ("EBCE", "EBCE")}


def method_name(method: str) -> str:
    return METHOD_NAMES.get(method, method)


def method_order(method: str) -> tuple:
    # The paper's order first, then any other method alphabetically.
    names = list(METHOD_NAMES)
    return (names.index(method) if method in names else len(names), method)


def model_order(model: str) -> list:
    """Natural order: qwen3-0.6b < qwen3-1.7b < qwen3-14b (numbers compared as numbers), families alphabetically."""
    return [(0, float(p), "") if re.fullmatch(r"\d+(\.\d+)?", p) else (1, 0.0, p)
            for p in re.split(r"(\d+(?:\.\d+)?)", model) if p]


def table1_frame(selections: list[Selection], latex: bool = False) -> pd.DataFrame:
    """One row per backbone, columns ``(method, header)``; cells are formatted strings."""
    if not selections:
        return pd.DataFrame()
    rank = selections[0].criteria.rank
    datasets = sorted({s.dataset for s in selections})
    models = sorted({(s.model, s.dataset) for s in selections}, key=lambda md: (model_order(md[0]), md[1]))
    by_key = {(s.method, s.model, s.dataset): s for s in selections}
    pick = 1 if latex else 0

    columns, data = [], {}
    for method in sorted({s.method for s in selections}, key=method_order):
        keys = list(dict.fromkeys(k for s in selections if s.method == method for k in s.searched))
        metrics = [rank, "ece", "ebce"] if rank not in ("ece", "ebce") else ["ece", "ebce"]
        for key in keys:
            columns.append((method, key, SYMBOLS.get(key, (key, _latex_escape(key)))[pick]))
        for metric in metrics:
            columns.append((method, metric, METRIC_HEADERS.get(metric, (metric, _latex_escape(metric)))[pick]))
        for model, dataset in models:
            s = by_key.get((method, model, dataset))
            winner = s.winner if s is not None else None
            for key in keys:
                value = fmt_setting(winner.hyperparameters[key]) if winner and key in winner.hyperparameters else DASH
                data[(model, dataset, method, key)] = value
            for metric in metrics:
                data[(model, dataset, method, metric)] = fmt_number(winner.mean.get(metric), 4) if winner else DASH

    rows = []
    for model, dataset in models:
        rows.append([data[(model, dataset, m, key)] for m, key, _ in columns])
    # The training dataset joins the row label only when the folders hold several.
    index = [model if len(datasets) == 1 else f"{model} ({dataset})" for model, dataset in models]
    if latex:
        index = [_latex_escape(i) for i in index]
        rows = [[cell.replace(DASH, "---") for cell in row] for row in rows]
    header = pd.MultiIndex.from_tuples([(method_name(m), h) for m, _, h in columns])
    if latex:
        # The label on the columns' second level lands in the header row of the index, not on a row of its own.
        header = header.set_names([None, "Backbone"])
        return pd.DataFrame(rows, index=pd.Index(index), columns=header)
    return pd.DataFrame(rows, index=pd.Index(index, name="backbone"), columns=header)


def table1_markdown(selections: list[Selection]) -> str:
    frame = table1_frame(selections)
    if frame.empty:
        return "(no runs)\n"
    c = selections[0].criteria
    header = ["backbone", *(f"{m} {h}" for m, h in frame.columns)]
    rows = [[idx, *row] for idx, row in zip(frame.index, frame.itertuples(index=False))]
    lines = [
        "# Table 1: selected hyperparameters per method and backbone",
        "",
        (f"Selected on `{c.dataset}`: mean over seeds with ECE <= {c.ece:g} and EBCE <= {c.ebce:g}, best `{c.rank}` "
         f"(RewardUQ section 5.1); {c.describe_sources()}. Scores are the winner's means on that dataset, ECE and "
         "EBCE as filtered, the rank metric as ranked; — = no configuration passes."),
        "",
        markdown_table(header, rows),
    ]
    lines += _notes(selections)
    return "\n".join(lines) + "\n"


def table1_latex(selections: list[Selection]) -> str:
    frame = table1_frame(selections, latex=True)
    if frame.empty:
        return "% no runs\n"
    c = selections[0].criteria
    body = frame.to_latex(escape=False, multicolumn=True, multicolumn_format="c",
                          column_format="l" + "c" * len(frame.columns))
    caption = (f"% Selected on {c.dataset}: ECE <= {c.ece:g}, EBCE <= {c.ebce:g}, best {c.rank} (mean over seeds); "
               f"{c.describe_sources()}; --- = no configuration passes; needs \\usepackage{{booktabs}}.\n")
    return caption + body


def _notes(selections: list[Selection]) -> list[str]:
    notes = []
    for s in selections:
        if s.winner is None:
            n = len(s.configurations)
            why = f"none of {n} configurations passes" if n else "no completed run with metrics for the dataset"
            notes.append(f"- {method_name(s.method)} / {s.model} (trained on {s.dataset}): {why}.")
        elif s.winner.n_seeds > 1:
            notes.append(f"- {method_name(s.method)} / {s.model}: mean of {s.winner.n_seeds} seeds.")
    return ["", "Notes:", "", *notes] if notes else []


def _latex_escape(text: str) -> str:
    return re.sub(r"([_&%#$])", r"\\\1", str(text))
