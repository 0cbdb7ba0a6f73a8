"""What ``scripts/select_runs.py`` writes: ``selection.csv``, ``selection.md``, the winners' tuned configs, a
stdout table.

Every report says which metrics the rule filtered and ranked on, and per group how many configurations pass each
threshold on the raw and on the recalibrated metrics, whichever it filtered on: a threshold every configuration
passes filters nothing, and the pick is then the ranking's alone.

The tuned config has the layout of ``conf/tuned/<method>/<model>.yaml`` and sets exactly the searched keys (those
that vary across the group's runs), so copying it into ``conf/tuned/`` changes nothing else about the method.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd
import yaml

from rewarduq_exp.analysis.selection import SOURCES, THRESHOLDED, Configuration, Criteria, Selection, source_key
from rewarduq_exp.analysis.text_tables import fmt_mean_std, fmt_number, fmt_setting, markdown_table, text_table
from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.runs.run_records import STATES, RunRecord

STDOUT_ROWS = 10  # the terminal shows the top of each ranking; selection.md has all of it


def write_selection(selections: list[Selection], out_dir: Path, tuned_dir: Path, sources: list[str]) -> dict:
    """Write every report file; return ``{(method, model, dataset): tuned file}`` for the groups with a winner."""
    out_dir = Path(out_dir)
    tuned_files = {}
    for s in selections:
        text = tuned_yaml(s, sources)
        if text is not None:
            path = tuned_path(Path(tuned_dir), s, selections)
            write_atomic(path, text)
            tuned_files[(s.method, s.model, s.dataset)] = path
    write_atomic(out_dir / "selection.csv", selection_csv(selections))
    write_atomic(out_dir / "selection.md", selection_markdown(selections, sources, tuned_files))
    return tuned_files


# ---------------------------------------------------------------------------------------------------- tuned config
def tuned_path(tuned_dir: Path, selection: Selection, selections: list[Selection]) -> Path:
    """``<tuned_dir>/<method>/<model>.yaml``, the name Hydra applies automatically.

    If the folders hold the same method and backbone trained on several datasets, each winner gets
    ``<model>_<dataset>.yaml`` instead, so no winner overwrites another; rename the one to apply.
    """
    same = [s for s in selections if (s.method, s.model) == (selection.method, selection.model)]
    stem = selection.model if len(same) == 1 else f"{selection.model}_{selection.dataset}"
    return tuned_dir / selection.method / f"{stem}.yaml"


def tuned_yaml(selection: Selection, sources: list[str]) -> str | None:
    """The winner as a ``# @package _global_`` config, or None when no configuration passes."""
    winner = selection.winner
    if winner is None:
        return None
    c = selection.criteria
    seeds = f"{winner.n_seeds} seed{'s' if winner.n_seeds != 1 else ''}"
    lines = [
        "# @package _global_",
        (f"# Selected by scripts/select_runs.py from {', '.join(sources)}: {c.dataset}, ECE <= {c.ece:g}, "
         f"EBCE <= {c.ebce:g}, best {c.key(c.rank)} = {winner.score:.4f} ({seeds}); {c.describe_sources()}."),
    ]
    keys = [k for k in selection.searched if k in winner.hyperparameters]
    if not keys:
        lines.append("method: {}")
    else:
        lines.append("method:")
        lines += [f"  {k}: {_yaml_scalar(winner.hyperparameters[k])}" for k in keys]
    return "\n".join(lines) + "\n"


def _yaml_scalar(value) -> str:
    # safe_dump writes floats so that YAML reads them back as floats (1.0e-05, not 1e-05, which YAML 1.1 reads as a
    # string) and quotes strings that would otherwise read as numbers or booleans.
    return yaml.safe_dump(value, default_flow_style=True).splitlines()[0]


# ---------------------------------------------------------------------------------------------------- counts
TESTS = (*THRESHOLDED, "both")


def shown_sources(s: Selection) -> list[str]:
    """The sources to count passes on: the one the rule filters on, and every one some configuration has."""
    n = len(s.configurations)
    return [on for on in SOURCES if on == s.criteria.filter_on or s.without(on) < n]


def _test_label(c: Criteria, test: str) -> str:
    return "both" if test == "both" else f"{test.upper()} <= {c.threshold(test):g}"


def _count(s: Selection, counts: dict, test: str) -> str:
    n, runs = counts[test]
    text = f"{n} of {len(s.configurations)}"
    # Runs are worth showing only when some configuration holds several seeds; otherwise they equal the count.
    return text + (f" ({runs} of {s.n_runs} runs)" if s.n_runs != len(s.configurations) else "")


def passing_line(s: Selection) -> str:
    """Configurations passing each threshold and both, on raw and recalibrated metrics, and what filtered."""
    c = s.criteria
    sources = shown_sources(s)
    counts = {on: s.passing_counts(on) for on in sources}
    parts = [f"{_test_label(c, t)}: " + ", ".join(f"{on} {_count(s, counts[on], t)}" for on in sources)
             for t in TESTS]
    note = _missing_note(s)
    return f"configurations passing {'; '.join(parts)}; {c.describe_filter()}" + (f"; {note}" if note else "")


def _missing_note(s: Selection) -> str | None:
    missing = s.without("recalibrated")
    if "recalibrated" not in shown_sources(s):
        return "the runs have no recalibrated metrics"
    if missing:
        return f"{missing} of {len(s.configurations)} without recalibrated ECE / EBCE (never pass on those)"
    return None


def filters_nothing_line(s: Selection) -> str | None:
    c = s.criteria
    if not s.filters_nothing:
        return None
    return (f"every configuration passes the {c.filter_on} thresholds: they filter nothing here, the pick is the "
            f"best {c.key(c.rank)} alone")


# ---------------------------------------------------------------------------------------------------- CSV
def selection_csv(selections: list[Selection]) -> str:
    rows = []
    for s in selections:
        winner = s.winner
        for c in s.configurations:
            row = {"method": s.method, "model": s.model, "train_dataset": s.dataset, "eval_dataset": c.criteria.dataset,
                   "rank": c.rank, "winner": c is winner}
            row.update(c.hyperparameters)
            row.update({"searched": " ".join(s.searched), "n_seeds": c.n_seeds,
                        "seeds": " ".join(str(x) for x in c.seeds)})
            for m in c.criteria.metrics:
                row[f"{m}_mean"] = c.mean[m]
                row[f"{m}_std"] = c.std[m]
            for m in THRESHOLDED:
                row[f"pass_{m}"] = c.passes(m)
                row[f"{m}_excess"] = c.excess(m)
            row["passes"] = c.passes_all
            row["miss"] = c.miss
            # The rule's own columns above read what it filtered on; these read both, whichever that was.
            row["filter_on"], row["rank_on"] = c.criteria.filter_on, c.criteria.rank_on
            for on, tag in zip(SOURCES, ("raw", "recal")):
                for m in THRESHOLDED:
                    row[f"{m}_{tag}_mean"] = c.threshold_means.get(source_key(m, on), math.nan)
                    row[f"pass_{m}_{tag}"] = c.passes(m, on)
                row[f"passes_{tag}"] = c.passes_both(on)
            row["runs"] = " ".join(str(r.path) for r in c.runs)
            rows.append(row)
    frame = pd.DataFrame(rows)
    if "rank" in frame:
        frame["rank"] = frame["rank"].astype("Int64")  # 1, 2, ... and empty for failing ones, not 1.0
    # Settings right after the identity columns, in the methods' config order, whichever group showed them first.
    settings = list(dict.fromkeys(k for s in selections for c in s.configurations for k in c.hyperparameters))
    first = ["method", "model", "train_dataset", "eval_dataset", "rank", "winner", *settings]
    frame = frame[[*first, *(col for col in frame.columns if col not in first)]] if rows else frame
    buf = io.StringIO()
    frame.to_csv(buf, index=False)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------- Markdown
def selection_markdown(selections: list[Selection], sources: list[str], tuned_files: dict) -> str:
    c = selections[0].criteria if selections else Criteria()
    records = [r for s in selections for r in s.records]
    counts = ", ".join(f"{n} {state}" for state in STATES if (n := sum(r.state == state for r in records)))
    out = [
        "# Hyperparameter selection",
        "",
        (f"Rule (RewardUQ section 5.1): keep configurations whose mean over seeds has ECE <= {c.ece:g} and "
         f"EBCE <= {c.ebce:g} on `{c.dataset}`, then rank by mean `{c.rank}` (higher is better); "
         f"{c.describe_sources()}."),
        "",
        f"Folders: {', '.join(f'`{p}`' for p in sources)}. Runs: {len(records)} ({counts or 'none'}).",
    ]
    for s in selections:
        out += ["", *_group_markdown(s, tuned_files.get((s.method, s.model, s.dataset)))]
    return "\n".join(out) + "\n"


def _group_markdown(s: Selection, tuned_file: Path | None) -> list[str]:
    c = s.criteria
    out = [f"## {s.method} / {s.model} (trained on {s.dataset})", ""]
    if not s.configurations:
        out.append(f"**No configuration to rank:** no completed run of this group has metrics for `{c.dataset}`.")
    elif s.winner is not None:
        w = s.winner
        out.append(f"**Winner:** {_settings(w, s.searched) or '(single configuration)'}: {c.key(c.rank)} = "
                   f"{fmt_mean_std(w.score, w.std.get(c.rank), w.n_seeds)} over {_seeds(w)}, "
                   f"{c.key('ece')} {fmt_number(w.mean['ece'])}, {c.key('ebce')} {fmt_number(w.mean['ebce'])}. "
                   f"{len(s.passing)} of {len(s.configurations)} configurations pass.")
        if tuned_file is not None:
            out.append(f"Tuned config: `{tuned_file}`.")
    else:
        out.append(f"**No configuration passes** ECE <= {c.ece:g} and EBCE <= {c.ebce:g} "
                   f"(0 of {len(s.configurations)}); no tuned config was written.")
    if s.configurations:
        out += ["", *_passing_markdown(s)]
    if s.configurations and s.winner is None:
        out += ["", f"Closest {len(s.closest())} by total excess over the thresholds:", "",
                _failing_table(s, s.closest())]

    if s.passing:
        header = ["rank", *s.searched, "seeds", *(c.key(m) for m in c.metrics)]
        rows = [[str(x.rank), *_values(x, s.searched), str(x.n_seeds),
                 *(fmt_mean_std(x.mean[m], x.std[m], x.n_seeds) for m in c.metrics)] for x in s.passing]
        out += ["", f"### Passing both thresholds ({len(s.passing)})", "", markdown_table(header, rows)]
    # With no winner the closest ones are shown above; repeat the full list only when it is longer.
    if s.failing and (s.winner is not None or len(s.failing) > len(s.closest())):
        out += ["", f"### Failing a threshold ({len(s.failing)}; excess > 0 is the miss)", "",
                _failing_table(s, s.failing)]

    keys = s.searched
    out += _run_list("Failed runs", s.by_state("failed"), keys)
    out += _run_list("Invalid settings (failed validation; nothing ran)", s.by_state("invalid"), [])
    out += _run_list("Missing runs (never started or killed)", s.by_state("missing"), keys)
    out += _run_list("Unfinished runs (still running)", s.by_state("running"), keys)
    out += _run_list("Interrupted runs (status running, but their process is gone: rerun by a relaunch)",
                     s.by_state("interrupted"), keys)
    out += _run_list("Damaged runs (completed, but a result file is missing or corrupt; left out)",
                     s.by_state("corrupt"), keys)
    out += _run_list(f"Completed runs without metrics for `{c.dataset}`", s.without_block(), keys)
    out += _run_list("Duplicate runs (same configuration and seed; the latest one is used)", s.duplicates, keys)
    return out


def _passing_markdown(s: Selection) -> list[str]:
    c = s.criteria
    sources = shown_sources(s)
    counts = {on: s.passing_counts(on) for on in sources}
    header = [f"configurations passing (of {len(s.configurations)})", *sources]
    rows = [[_test_label(c, t), *(_count(s, counts[on], t) for on in sources)] for t in TESTS]
    note = _missing_note(s)
    out = [markdown_table(header, rows), "", f"The rule: {c.describe_sources()}."
           + (f" Note: {note}." if note else "")]
    if (nothing := filters_nothing_line(s)) is not None:
        out[-1] += f" **{nothing[0].upper()}{nothing[1:]}.**"
    return out


def _failing_table(s: Selection, configs: list[Configuration]) -> str:
    c = s.criteria
    ece, ebce = c.key("ece"), c.key("ebce")
    header = [*s.searched, "seeds", c.key(c.rank), ece, f"{ece} - {c.ece:g}", ebce, f"{ebce} - {c.ebce:g}",
              "total miss"]
    rows = [[*_values(x, s.searched), str(x.n_seeds), fmt_mean_std(x.score, x.std[c.rank], x.n_seeds),
             fmt_mean_std(x.mean["ece"], x.std["ece"], x.n_seeds), _signed(x.excess("ece")),
             fmt_mean_std(x.mean["ebce"], x.std["ebce"], x.n_seeds), _signed(x.excess("ebce")), fmt_number(x.miss)]
            for x in configs]
    return markdown_table(header, rows)


def _run_list(title: str, runs: list[RunRecord], keys: list[str]) -> list[str]:
    if not runs:
        return []
    out = ["", f"### {title} ({len(runs)})", ""]
    for r in runs:
        settings = "".join(f", {k}={fmt_setting(r.hyperparameters.get(k, '—'))}" for k in keys)
        reason = f": {r.error}" if r.error else ""
        out.append(f"- `{r.path}` (seed {r.seed}{settings}){reason}")
    return out


def _settings(c: Configuration, keys: list[str]) -> str:
    return ", ".join(f"{k}={fmt_setting(c.hyperparameters.get(k))}" for k in keys)


def _values(c: Configuration, keys: list[str]) -> list[str]:
    return [fmt_setting(c.hyperparameters.get(k, "—")) for k in keys]


def _seeds(c: Configuration) -> str:
    return f"{c.n_seeds} seed{'s' if c.n_seeds != 1 else ''} ({', '.join(str(x) for x in c.seeds)})"


def _signed(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:+.4f}"


# ---------------------------------------------------------------------------------------------------- stdout
def stdout_summary(selections: list[Selection], tuned_files: dict) -> str:
    """The rule in words, then for each group: the outcome, the passing counts, then the top of the ranking."""
    blocks = [f"rule: {selections[0].criteria.describe()}"] if selections else []
    for s in selections:
        c = s.criteria
        head = f"{s.method} / {s.model} (trained on {s.dataset}): "
        if not s.configurations:
            head += f"no completed run has metrics for {c.dataset}"
        elif s.winner is not None:
            w = s.winner
            head += (f"winner {_settings(w, s.searched) or '(single configuration)'} -> "
                     f"{c.key(c.rank)} = {w.score:.4f} "
                     f"({w.n_seeds} seed{'s' if w.n_seeds != 1 else ''}); "
                     f"{len(s.passing)} of {len(s.configurations)} configurations pass")
            tuned = tuned_files.get((s.method, s.model, s.dataset))
            if tuned is not None:
                head += f"\n  tuned config: {tuned}"
        else:
            head += (f"NO configuration passes ECE <= {c.ece:g} and EBCE <= {c.ebce:g} on {c.dataset} "
                     f"(0 of {len(s.configurations)}); no tuned config written; closest {len(s.closest())} below")
        if s.configurations:
            head += f"\n  {passing_line(s)}"
            if (nothing := filters_nothing_line(s)) is not None:
                head += f"\n  {nothing}"
        problems = {state: len(s.by_state(state)) for state in STATES if state != "completed"}
        if any(problems.values()):
            head += "\n  not used: " + ", ".join(f"{n} {state}" for state, n in problems.items() if n)
        left_out = [r for state in ("corrupt", "interrupted", "missing") for r in s.by_state(state)]
        head += "".join(f"\n    {r.state}: {r.path}: {r.error}" for r in left_out[:STDOUT_ROWS])
        if len(left_out) > STDOUT_ROWS:
            head += f"\n    ({len(left_out) - STDOUT_ROWS} more in selection.md)"
        blocks.append(head)
        if s.configurations:
            blocks.append(_stdout_table(s))
    return "\n\n".join(blocks)


def _stdout_table(s: Selection) -> str:
    c = s.criteria
    shown = s.configurations if s.winner is not None else s.closest()
    shown = shown[:STDOUT_ROWS]
    header = ["rank", *s.searched, "seeds", c.key(c.rank), c.key("ece"), c.key("ebce"), "misses"]
    rows = []
    for x in shown:
        misses = ",".join(m.upper() for m in ("ece", "ebce") if not x.passes(m)) or "-"
        rows.append([str(x.rank) if x.rank else "-", *_values(x, s.searched), str(x.n_seeds),
                     fmt_number(x.score), fmt_number(x.mean["ece"]), fmt_number(x.mean["ebce"]), misses])
    table = text_table(header, rows)
    hidden = len(s.configurations) - len(shown)
    return table + (f"\n({hidden} more in selection.md)" if hidden > 0 else "")
