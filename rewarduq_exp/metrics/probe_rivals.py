"""Does a baseline of the same run match or beat the probe? One line per rated eval set that says so.

A BoRP run scores cheap baselines on the same rows as the probe (``probe/baseline/<name>/...``: the length ridge,
the mean-pooled ridge, the score-only judge). Where one of them reaches the probe's agreement with the ratings, the
probe's headline number says little about what the probe knows; on real summaries rated for informativeness the
length ridge alone beat the probe. This module decides that from a dataset's metrics and words it, so the log line
written at evaluation, the line printed under the summary table and the figure's note say the same thing.

* The metric is the interval Krippendorff's alpha (``alpha_interval``), the paper's headline and the ``alpha`` /
  ``alpha_<baseline>`` columns of the summary table: unlike Pearson it also counts a baseline's bias and scale, so a
  baseline matches only where its scores agree with the ratings as well as the probe's do.
* A baseline *matches* when its alpha is at least the probe's minus :data:`MATCH_MARGIN`, and *beats* the probe when
  its alpha is higher. Both need the two alphas (a constant baseline has none: it neither matches nor beats).
* Recorded per dataset: ``probe/baseline/<name>/matches_probe`` (bool, also true when it beats the probe),
  ``probe/matched_by_baseline`` (bool: any baseline does) and ``probe/baseline_match_margin``; numbers and booleans
  only, as every reader of ``metrics.json`` expects. The line also gives the probe's partial correlation with the
  ratings given length (``probe/partial_pearson_given_length``): what the probe knows beyond length.

Nothing here imports matplotlib or scipy: the summary table at the end of a run imports it.
"""

from __future__ import annotations

import math

# The sampling error of an agreement coefficient on the few hundred rated texts of an eval set is several
# hundredths (a Pearson r of 0.7 on 300 texts has a standard error of (1 - r^2) / sqrt(n) = 0.03), so a probe that
# is less than 0.02 of alpha ahead of a baseline has not shown that it knows more than that baseline.
MATCH_MARGIN = 0.02
METRIC = "alpha_interval"
PARTIAL = "probe/partial_pearson_given_length"
BASELINE_PREFIX = "probe/baseline/"


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return float("nan")
    return float(value)


def baseline_alphas(metrics: dict) -> dict[str, float]:
    """``{baseline: alpha}`` of every baseline in a dataset's metrics, NaN where it has none (a constant answer)."""
    names = sorted({k.split("/")[2] for k in metrics if k.startswith(BASELINE_PREFIX) and k.count("/") >= 3})
    return {name: _number(metrics.get(f"{BASELINE_PREFIX}{name}/{METRIC}")) for name in names}


def rivals(probe_alpha: float, alphas: dict[str, float], margin: float = MATCH_MARGIN) -> dict[str, float]:
    """The baselines of ``alphas`` whose alpha is at least ``probe_alpha - margin``, best first."""
    if not math.isfinite(probe_alpha):
        return {}
    found = {n: a for n, a in alphas.items() if math.isfinite(a) and a >= probe_alpha - margin}
    return dict(sorted(found.items(), key=lambda item: -item[1]))


def rival_flags(metrics: dict) -> dict:
    """The keys recorded in ``metrics.json`` (module docstring) for a dataset's probe metrics."""
    alphas = baseline_alphas(metrics)
    found = rivals(_number(metrics.get(f"probe/{METRIC}")), alphas)
    flags = {f"{BASELINE_PREFIX}{name}/matches_probe": name in found for name in alphas}
    return {**flags, "probe/matched_by_baseline": bool(found), "probe/baseline_match_margin": MATCH_MARGIN}


def _fmt(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "n/a"


def rival_note(probe_alpha: float, alphas: dict[str, float], partial: float) -> str | None:
    """What :func:`rival_line` says, without the dataset's name; None when the probe is ahead of every baseline by
    more than the margin (or has no alpha)."""
    found = rivals(probe_alpha, alphas)
    if not found:
        return None
    said = ", ".join(f"{name} {'beats' if alpha > probe_alpha else 'matches'} it (alpha {_fmt(alpha)})"
                     for name, alpha in found.items())
    return (f"a baseline matches or beats the probe: {said} vs the probe's alpha {_fmt(probe_alpha)} "
            f"(interval K-alpha; within {MATCH_MARGIN} counts as a match); the probe's partial correlation with the "
            f"ratings given length is {_fmt(partial)}")


def rival_line(name: str, metrics: dict) -> str | None:
    """One line naming every baseline that matches or beats the probe on dataset ``name``, both alphas and the
    probe's partial correlation given length; None when there is none (or the block holds no probe metrics)."""
    note = rival_note(_number(metrics.get(f"probe/{METRIC}")), baseline_alphas(metrics),
                      _number(metrics.get(PARTIAL)))
    return f"{name}: {note}" if note else None
