"""CUPED (BoRP section 5.3): theta, variance reduction and sample sizes on constructed cases; the script's output and
its one-line errors."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from entry_points import run_entry_point

from rewarduq_exp.analysis.cuped import (
    cuped_adjust,
    cuped_analysis,
    cuped_theta,
    join_user_tables,
    sample_size_per_arm,
)
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.strict_json import strict_loads

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cuped.py"
# y = 2x + e with e orthogonal to x and to the constant: theta = 2, rho^2 = (2 var x)^2 / (var y var x) = 0.8
X = np.array([-1.0, -1.0, 1.0, 1.0])
E = np.array([1.0, -1.0, 1.0, -1.0])
Y = 2 * X + E


def test_theta_and_variance_reduction():
    assert cuped_theta(Y, X) == pytest.approx(2.0)
    np.testing.assert_allclose(cuped_adjust(Y, X), E)  # the x part removed, the mean kept (mean x = 0)
    rep = cuped_analysis(Y + 10, X, lift=0.1)
    assert rep.theta == pytest.approx(2.0)
    assert rep.variance_reduction == pytest.approx(0.8) and rep.variance_ratio == pytest.approx(0.2)
    assert rep.var_cuped == pytest.approx(rep.var_y * 0.2)
    assert rep.mean_y == pytest.approx(10.0)
    # the adjusted mean is unchanged and theta does not depend on shifting x
    assert cuped_adjust(Y, X + 5).mean() == pytest.approx(Y.mean())
    assert cuped_theta(Y, X + 5) == pytest.approx(2.0)


def test_sample_size_formula():
    # 2 (z_0.975 + z_0.8)^2 / 0.1^2 = 1569.8 -> 1570 per arm for a 0.1 SD effect (the textbook value)
    assert sample_size_per_arm(1.0, 1.0, 0.1) == 1570
    assert sample_size_per_arm(1.0, 1.0, 0.1, power=0.9) == 2102
    assert sample_size_per_arm(4.0, 10.0, 0.02) == 1570  # sigma = 2, delta = 0.2
    rep = cuped_analysis(Y + 10, X, lift=0.01)
    assert rep.n_per_arm == sample_size_per_arm(rep.var_y, 10.0, 0.01)
    assert rep.n_per_arm_cuped == sample_size_per_arm(rep.var_y * 0.2, 10.0, 0.01)
    # the paper's example: rho^2 = 0.045 turns 235k per arm into ~225k
    var = 235_000 * (0.002 ** 2) / (2 * 7.848879734349)  # the variance for which n = 235k at a 0.2% lift, mean 1
    assert sample_size_per_arm(var * (1 - 0.045), 1.0, 0.002) == pytest.approx(224_425, abs=2)
    with pytest.raises(UserError, match="no effect to detect"):
        sample_size_per_arm(1.0, 0.0, 0.1)


def test_groups_and_joining():
    rng = np.random.default_rng(0)
    n = 4000
    x = rng.normal(size=n)
    arm = np.where(np.arange(n) % 2 == 0, "control", "treat")
    y = 5 + 0.8 * x + rng.normal(size=n) * 0.6 + 0.1 * (arm == "treat")
    rep = cuped_analysis(y, x, lift=0.01, groups=arm)
    treat = next(g for g in rep.groups if g["group"] == "treat")
    assert treat["control"] == "control" and treat["se_cuped"] < 0.7 * treat["se"]
    assert abs(treat["diff_cuped"] - 0.1) < 3 * treat["se_cuped"]
    assert rep.n_per_arm_cuped < rep.n_per_arm
    metric = pd.DataFrame({"uid": [1, 2, 3, 4, 5], "m": [1.0, 2.0, np.nan, 4.0, 5.0], "arm": list("abab" + "a")})
    cov = pd.DataFrame({"uid": [1, 2, 3, 4], "score": [0.1, 0.2, 0.3, 0.4]})
    frame, dropped = join_user_tables(metric, cov, user_col="uid", metric_col="m", covariate_col="score",
                                      group_col="arm")
    assert frame["user"].tolist() == [1, 2, 4] and dropped == {"unmatched": 1, "missing_values": 1}
    with pytest.raises(UserError, match=r"covariate table: missing column\(s\) borp; found: uid, score"):
        join_user_tables(metric, cov, user_col="uid", metric_col="m", covariate_col="borp")
    with pytest.raises(UserError, match="duplicate user id"):
        join_user_tables(pd.concat([metric, metric]), cov, user_col="uid", metric_col="m", covariate_col="score")


def test_script(tmp_path):
    rng = np.random.default_rng(1)
    n = 500
    users = [f"u{i}" for i in range(n)]
    x = rng.normal(size=n)
    pd.DataFrame({"user_id": users, "retained": 1 + 0.5 * x + rng.normal(size=n), "arm": ["A", "B"] * (n // 2)}
                 ).to_csv(tmp_path / "metric.csv", index=False)
    pd.DataFrame({"user_id": users, "borp": x}).to_parquet(tmp_path / "pre.parquet")
    args = ["--metric", "metric.csv", "--covariate", "pre.parquet", "--metric-col", "retained", "--covariate-col",
            "borp", "--group-col", "arm", "--lift", "0.05", "--json", "out.json"]
    proc = run_entry_point(SCRIPT, args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "theta = cov(Y, X) / var(X)" in proc.stdout and "with CUPED" in proc.stdout and "group B" in proc.stdout
    report = strict_loads((tmp_path / "out.json").read_text())  # strict JSON: no bare NaN / Infinity
    assert report["n_per_arm_cuped"] < report["n_per_arm"] and report["n_users"] == n
    bad = run_entry_point(SCRIPT, [a if a != "borp" else "borp_pre" for a in args], tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("error: pre.parquet: missing column(s) borp_pre; found: user_id, borp")
    assert len(bad.stderr.strip().splitlines()) == 1
