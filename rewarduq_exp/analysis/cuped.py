"""CUPED variance reduction for A/B tests with a pre-period covariate (BoRP section 5.3), in numpy/scipy.

CUPED (Deng et al. 2013) replaces the per-user metric ``Y`` by ``Y_cuped = Y - theta (X - mean(X))`` with a
covariate ``X`` measured before the experiment (here: a user's pre-period BoRP scores), where

    theta = cov(Y, X) / var(X)

minimises the variance of ``Y_cuped``, which becomes ``var(Y) (1 - rho^2)``, ``rho = corr(Y, X)``. ``X`` is not
affected by the treatment, so the adjusted difference in means stays unbiased. ``theta`` is estimated once on all
users (pooled over the arms), the standard choice.

Sample size per arm for a two-sided z-test of a *relative* lift ``l`` of the mean (absolute effect
``delta = l * mean(Y)``), level ``alpha`` and power ``1 - beta``:

    n = 2 (z_{1 - alpha/2} + z_{1 - beta})^2 sigma^2 / delta^2

with ``sigma^2 = var(Y)`` without CUPED and ``var(Y) (1 - rho^2)`` with it; ``n`` is rounded up. The paper's example:
``rho^2 = 0.045`` turns 235k users per arm into 225k.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from rewarduq_exp.core.errors import UserError

TABLE_SUFFIXES = (".csv", ".parquet", ".pq")


def _vectors(y, x) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(y, dtype=float).ravel()
    x = np.asarray(x, dtype=float).ravel()
    if y.shape != x.shape:
        raise UserError(f"CUPED needs one covariate per metric value (got {len(x)} and {len(y)})")
    if len(y) < 3:
        raise UserError(f"CUPED needs at least 3 users with both values (got {len(y)})")
    if not (np.isfinite(y).all() and np.isfinite(x).all()):
        raise UserError("CUPED got NaN/inf in the metric or the covariate; drop or fill those users first")
    return y, x


def cuped_theta(y, x) -> float:
    """theta = cov(Y, X) / var(X) (both with ddof=1)."""
    y, x = _vectors(y, x)
    var_x = np.var(x, ddof=1)
    if var_x == 0:
        raise UserError("the covariate is constant across users, so CUPED cannot use it (var(X) = 0)")
    return float(np.cov(y, x, ddof=1)[0, 1] / var_x)


def cuped_adjust(y, x, theta: float | None = None) -> np.ndarray:
    """Y - theta (X - mean(X)); ``theta`` defaults to :func:`cuped_theta`."""
    y, x = _vectors(y, x)
    theta = cuped_theta(y, x) if theta is None else float(theta)
    return y - theta * (x - x.mean())


def sample_size_per_arm(variance: float, mean: float, lift: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Users per arm for a two-sided z-test to detect a relative ``lift`` of ``mean`` (module docstring)."""
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise UserError(f"alpha={alpha} and power={power} must both lie strictly between 0 and 1")
    delta = abs(float(lift) * float(mean))
    if delta == 0:
        raise UserError(f"the relative lift ({lift}) times the metric mean ({mean}) is 0: no effect to detect; "
                        "give a non-zero --lift (and a metric with a non-zero mean)")
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    return int(np.ceil(2.0 * z**2 * float(variance) / delta**2))


@dataclass
class CupedReport:
    n_users: int
    theta: float
    correlation: float
    variance_reduction: float      # rho^2: the share of var(Y) that CUPED removes
    variance_ratio: float          # 1 - rho^2: var(Y_cuped) / var(Y)
    mean_y: float
    var_y: float
    var_cuped: float
    lift: float
    alpha: float
    power: float
    n_per_arm: int
    n_per_arm_cuped: int
    groups: list[dict] = field(default_factory=list)

    @property
    def users_saved_per_arm(self) -> int:
        return self.n_per_arm - self.n_per_arm_cuped

    def as_dict(self) -> dict:
        return {**asdict(self), "users_saved_per_arm": self.users_saved_per_arm}

    def text(self) -> str:
        lines = [
            f"users: {self.n_users}",
            f"theta = cov(Y, X) / var(X) = {self.theta:.6g}",
            f"corr(Y, X) = {self.correlation:.4f}; variance reduction rho^2 = {self.variance_reduction:.2%}; "
            f"var(Y_cuped) / var(Y) = 1 - rho^2 = {self.variance_ratio:.4f}",
            f"sample size per arm for a {self.lift:.4g} relative lift (alpha {self.alpha}, power {self.power}, "
            f"two-sided z-test): {self.n_per_arm} without CUPED, {self.n_per_arm_cuped} with CUPED "
            f"({self.users_saved_per_arm} fewer)",
        ]
        for g in self.groups:
            line = f"group {g['group']}: n={g['n']}, mean={g['mean']:.6g}, mean_cuped={g['mean_cuped']:.6g}"
            if "diff" in g:
                line += (f", diff vs {g['control']} = {g['diff']:.6g} (se {g['se']:.3g}), "
                         f"cuped diff = {g['diff_cuped']:.6g} (se {g['se_cuped']:.3g})")
            lines.append(line)
        return "\n".join(lines)


def group_effects(y, y_cuped, groups, control=None) -> list[dict]:
    """Per-arm means and, for every arm but ``control`` (default: the first in sorted order), the difference in
    means against it with its standard error (Welch), raw and CUPED-adjusted."""
    y, y_cuped = np.asarray(y, float), np.asarray(y_cuped, float)
    groups = np.asarray(groups).astype(str)
    names = sorted(set(groups))
    control = names[0] if control is None else str(control)
    if control not in names:
        raise UserError(f"control group {control!r} not found; groups: {', '.join(names)}")
    out = []
    ctrl = groups == control
    for name in names:
        sel = groups == name
        row = {"group": name, "n": int(sel.sum()), "mean": float(y[sel].mean()),
               "mean_cuped": float(y_cuped[sel].mean())}
        if name != control:
            for suffix, v in (("", y), ("_cuped", y_cuped)):
                row["diff" + suffix] = float(v[sel].mean() - v[ctrl].mean())
                row["se" + suffix] = float(np.sqrt(np.var(v[sel], ddof=1) / sel.sum() + np.var(v[ctrl], ddof=1)
                                                   / ctrl.sum())) if min(sel.sum(), ctrl.sum()) > 1 else float("nan")
            row["control"] = control
        out.append(row)
    return out


def cuped_analysis(y, x, *, lift: float, alpha: float = 0.05, power: float = 0.8, groups=None,
                   control=None) -> CupedReport:
    """theta, the variance reduction and the sample sizes per arm with and without CUPED (module docstring)."""
    y, x = _vectors(y, x)
    theta = cuped_theta(y, x)
    if np.var(y, ddof=1) == 0:
        raise UserError("the metric is constant across users (var(Y) = 0); nothing to test")
    rho = float(np.corrcoef(y, x)[0, 1])
    y_cuped = y - theta * (x - x.mean())
    var_y = float(np.var(y, ddof=1))
    var_c = float(np.var(y_cuped, ddof=1))
    report = CupedReport(
        n_users=len(y), theta=theta, correlation=rho, variance_reduction=rho**2, variance_ratio=1 - rho**2,
        mean_y=float(y.mean()), var_y=var_y, var_cuped=var_c, lift=float(lift), alpha=float(alpha),
        power=float(power), n_per_arm=sample_size_per_arm(var_y, y.mean(), lift, alpha, power),
        n_per_arm_cuped=sample_size_per_arm(var_c, y.mean(), lift, alpha, power))
    if groups is not None:
        report.groups = group_effects(y, y_cuped, groups, control)
    return report


# ---------------------------------------------------------------------------------------------------- tables
def read_table(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    if path.suffix.lower() not in TABLE_SUFFIXES:
        raise UserError(f"{path}: unknown table format '{path.suffix}'; allowed: {', '.join(TABLE_SUFFIXES)}")
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    return pd.read_csv(path) if path.suffix.lower() == ".csv" else pd.read_parquet(path)


def _require(frame: pd.DataFrame, columns: list[str], source: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        found = ", ".join(map(str, frame.columns))
        raise UserError(f"{source}: missing column(s) {', '.join(missing)}; found: {found}")


def join_user_tables(metric: pd.DataFrame, covariate: pd.DataFrame | None, *, user_col: str, metric_col: str,
                     covariate_col: str, group_col: str | None = None, metric_source: str = "metric table",
                     covariate_source: str = "covariate table") -> tuple[pd.DataFrame, dict]:
    """One row per user with columns ``user``, ``y`` (the metric), ``x`` (the covariate) and, with ``group_col``,
    ``group``: the inner join of the two tables on ``user_col`` (``covariate=None``: both columns are in ``metric``).
    Returns the frame and the counts of users dropped (``unmatched``: no covariate row; ``missing_values``: NaN or
    non-numeric metric or covariate)."""
    _require(metric, [user_col, metric_col] + ([group_col] if group_col else []), metric_source)
    if covariate is None:
        _require(metric, [covariate_col], metric_source)
        covariate = metric
        covariate_source = metric_source
    else:
        _require(covariate, [user_col, covariate_col], covariate_source)
    for name, table in ((metric_source, metric), (covariate_source, covariate)):
        dup = int(table[user_col].duplicated().sum())
        if dup:
            raise UserError(f"{name}: {dup} duplicate user id(s) in column '{user_col}'; aggregate to one row per "
                            "user first")
    left = pd.DataFrame({"user": metric[user_col].to_numpy(), "y": metric[metric_col].to_numpy()})
    if group_col:
        left["group"] = metric[group_col].astype(str).to_numpy()
    right = pd.DataFrame({"user": covariate[user_col].to_numpy(), "x": covariate[covariate_col].to_numpy()})
    frame = left.merge(right, on="user", how="inner")
    unmatched = len(left) - len(frame)
    frame["y"] = pd.to_numeric(frame["y"], errors="coerce")
    frame["x"] = pd.to_numeric(frame["x"], errors="coerce")
    ok = np.isfinite(frame[["y", "x"]].to_numpy(dtype=float)).all(1)
    return frame[ok].reset_index(drop=True), {"unmatched": int(unmatched), "missing_values": int((~ok).sum())}
