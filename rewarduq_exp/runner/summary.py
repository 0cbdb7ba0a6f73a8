"""The table printed at the end of a run: one row per evaluated dataset, the paper's headline metrics; under it, one
line per rated eval set where a baseline matches or beats the probe (:mod:`rewarduq_exp.metrics.probe_rivals`)."""

from __future__ import annotations

from rewarduq_exp.metrics.probe_rivals import rival_line

# (metric key, column title); truth/* columns appear only when the data has a ground truth (synthetic world).
COLUMNS = (
    ("n_pairs", "pairs"),
    ("win_rate", "win_rate"),
    ("baseline/longer_wins/win_rate", "longer"),   # "the longer completion wins" (ties 0.5), same pairs
    ("best_of_k_accuracy", "best_of_K"),
    ("rb2_score", "RB2"),
    ("truth/bayes_win_rate", "bayes_win"),
    ("ct_rate", "CT"),
    ("cf_rate", "CF"),
    ("rs_0.2", "RS_0.2"),
    ("ece", "ECE"),
    ("ebce", "EBCE"),
    ("brier", "brier"),
    ("bound_width", "mean_width"),
    ("truth/margin_coverage", "coverage"),
    # ranking calibration (label ranking; top-1 calibration of K-wise reward-model scores)
    ("n_folds", "folds"),
    ("rank/kendall_tau", "tau"),
    ("rank/top1_accuracy", "top1_acc"),
    ("rank/sub_2/ece", "ECE_sub2"),
    ("rank/top_1/ece", "ECE_top1"),
    ("rank/full/sub_2/ece", "kernelECE_sub2"),
    ("rank/full/top_1/ece", "kernelECE_top1"),
    # probes on rated responses (BoRP) and their baselines in the same run
    ("probe/alpha_interval", "alpha"),
    ("probe/pearson", "pearson"),
    ("probe/rmse", "rmse"),
    ("probe/u_abs_error_spearman", "rho(u,|err|)"),
    ("probe/u_rater_std_spearman", "rho(u,rater_sd)"),
    ("probe/coverage", "interval_cov"),
    ("probe/baseline/score_judge/alpha_interval", "alpha_judge"),
    ("probe/baseline/mean_pool_ridge/alpha_interval", "alpha_ridge"),
    ("probe/baseline/length_ridge/alpha_interval", "alpha_len"),
)


# Rows of recalibrated metrics (``recal/<metric>``, rewarduq_exp/recalibration) are printed under their dataset's row.
RECAL = "recal/"
OTHER_RECAL = "recal@"
RECALIBRATED_ROW = "recalibrated"
# Columns recalibration cannot change and that have no recal/ key of their own (counts, baselines).
SAME_AFTER = ("n_pairs", "baseline/longer_wins/win_rate")


def _fmt(value) -> str:
    if isinstance(value, int):
        return str(value)
    if value is None:
        return "-"
    return f"{value:.4f}"


def summary_table(blocks: dict[str, dict]) -> str:
    """Plain-text table of ``{dataset: metrics}``; ``mean_width`` is the mean reward-interval width (upper - lower).
    Under it, ``warning: <dataset>: a baseline matches or beats the probe: ...`` for each probe that a baseline of
    the same run matches (decided from the block's alphas, so an older run's metrics.json says it too)."""
    if not blocks:
        return "(no datasets evaluated)"
    keys = [(k, t) for k, t in COLUMNS if any(k in m for m in blocks.values())]
    header = ["dataset"] + [t for _, t in keys]
    rows = []
    for name, m in blocks.items():
        rows.append([name] + [_fmt(m.get(k)) for k, _ in keys])
        # the same metrics after the run's recalibration, under it; then those of another interval choice
        # (evaluate.py recalibrate_interval=<x>: recal@<x>/<metric>), each on a row that names it
        shown = [(RECAL, RECALIBRATED_ROW)] if any(k.startswith(RECAL) for k in m) else []
        others = sorted({k.split("/", 1)[0] for k in m if k.startswith(OTHER_RECAL) and "/" in k})
        shown += [(f"{p}/", f"{RECALIBRATED_ROW} ({p.removeprefix(OTHER_RECAL)})") for p in others]
        for prefix, label in shown:
            rows.append([f"  {label}"] + [_fmt(m.get(prefix + k, m.get(k) if k in SAME_AFTER else None))
                                          for k, _ in keys])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    sep = "-" * len(line(header))
    rivalled = [f"warning: {text}" for text in (rival_line(name, m) for name, m in blocks.items()) if text]
    return "\n".join([sep, line(header), sep] + [line(r) for r in rows] + [sep] + rivalled)
