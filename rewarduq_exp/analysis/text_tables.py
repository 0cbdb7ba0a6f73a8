"""Plain-text and Markdown tables for the reports (selection, Table 1); no tabulate dependency needed."""

from __future__ import annotations

import math

DASH = "—"  # shown where there is no value (no run passes, metric missing)


def fmt_number(value, digits: int = 4) -> str:
    """A metric value: fixed ``digits`` decimals; ``—`` for None/NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DASH
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def fmt_mean_std(mean, std, n: int, digits: int = 4) -> str:
    """``mean ± std`` over seeds; just the mean for one seed (its std is undefined)."""
    if n > 1 and std is not None and not (isinstance(std, float) and math.isnan(std)):
        return f"{fmt_number(mean, digits)} ± {fmt_number(std, digits)}"
    return fmt_number(mean, digits)


def fmt_setting(value) -> str:
    """A hyperparameter as people write it: 0.1, 0, 1e-3 (small numbers in short scientific form)."""
    if isinstance(value, float):
        if value != 0 and abs(value) < 0.01:
            mantissa, exponent = f"{value:e}".split("e")
            return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
        return f"{value:g}"
    return str(value)


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """Aligned columns for the terminal: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table; ``|`` inside cells is escaped so it cannot break the layout."""

    def cell(value) -> str:
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
