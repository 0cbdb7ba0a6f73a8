"""Does the proxy's uncertainty rise on the best-of-n candidates that exploit a shortcut?

The world's candidates carry features the true reward ignores (``Candidates.features``: length in words, occurrences
of the filler word); the training completions span only part of each feature's range. From one run's scored
candidates on one split this module measures, per feature: Spearman of u (and of the proxy reward r) against the
feature over all candidates, with its p-value; the mean u, normalised by the median u of those candidates (so that
methods whose u differ in scale compare), and the mean r of the candidates inside vs beyond the training range
(beyond: more than the training maximum); and the same means per value of the feature, for the figure.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
from scipy.stats import ConstantInputWarning, spearmanr


def spearman_or_nan(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Spearman's rho and its p-value; NaN when either side is constant (no ranking to correlate)."""
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return np.nan, np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConstantInputWarning)
        result = spearmanr(x, y)
    return float(result.statistic), float(result.pvalue)


def _normalised(reward: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """u over its median (a run's typical uncertainty is 1) and r as a z-score over the candidates."""
    u, reward = np.ravel(u).astype(np.float64), np.ravel(reward).astype(np.float64)
    median = np.median(u)
    u_norm = u / median if median > 0 else np.full_like(u, np.nan)
    std = reward.std()
    r_z = (reward - reward.mean()) / std if std > 0 else np.zeros_like(reward)
    return u_norm, r_z


def shortcut_table(reward, u, gold, features: dict[str, np.ndarray], train_max: dict[str, float]) -> pd.DataFrame:
    """One row per feature of the scored candidates (``reward``, ``u``, ``gold`` and each feature: same shape).

    Columns: ``feature``, ``train_max`` (NaN: unknown, then nothing counts as beyond), ``candidates``, ``beyond``
    (how many exceed the training maximum), ``rho_u``/``p_u`` and ``rho_r``/``p_r`` (Spearman over all candidates),
    ``u_inside``/``u_beyond`` (mean u / median u), ``u_ratio`` (beyond over inside), ``r_inside``/``r_beyond`` (mean
    proxy reward), ``gold_inside``/``gold_beyond`` (mean true reward). Means over an empty side are NaN."""
    u_norm, _ = _normalised(reward, u)
    r, g, raw_u = (np.ravel(a).astype(np.float64) for a in (reward, gold, u))
    rows = []
    for name, values in features.items():
        x = np.ravel(values).astype(np.float64)
        top = float(train_max.get(name, np.nan))
        beyond = x > top  # False throughout when the training maximum is unknown (NaN)
        rho_u, p_u = spearman_or_nan(x, raw_u)
        rho_r, p_r = spearman_or_nan(x, r)

        def side(a: np.ndarray, mask: np.ndarray) -> float:
            return float(a[mask].mean()) if mask.any() else np.nan

        row = {"feature": name, "train_max": top, "candidates": len(x), "beyond": int(beyond.sum()),
               "rho_u": rho_u, "p_u": p_u, "rho_r": rho_r, "p_r": p_r}
        for label, a in (("u", u_norm), ("r", r), ("gold", g)):
            row[f"{label}_inside"], row[f"{label}_beyond"] = side(a, ~beyond), side(a, beyond)
        row["u_ratio"] = row["u_beyond"] / row["u_inside"]
        rows.append(row)
    return pd.DataFrame(rows)


def shortcut_bins(reward, u, gold, features: dict[str, np.ndarray]) -> pd.DataFrame:
    """Per feature and value of it (the features are counts, so each value is a bin): ``count`` of candidates and
    their mean ``u_norm`` (u / median u), ``r_z`` (r as a z-score over all candidates, so methods compare), ``r``
    and ``gold``."""
    u_norm, r_z = _normalised(reward, u)
    parts = []
    for name, values in features.items():
        frame = pd.DataFrame({"value": np.ravel(values), "u_norm": u_norm, "r_z": r_z,
                              "r": np.ravel(reward).astype(np.float64), "gold": np.ravel(gold).astype(np.float64)})
        grouped = frame.groupby("value")
        table = grouped.mean().join(grouped.size().rename("count")).reset_index()
        parts.append(table.assign(feature=name))
    columns = ["feature", "value", "count", "u_norm", "r_z", "r", "gold"]
    return pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)
