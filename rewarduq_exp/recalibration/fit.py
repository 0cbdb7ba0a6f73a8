"""Fitting a run's recalibration on its calibration split, and the recalibrated metrics of an evaluated set.

``recalibrate`` settings (conf/train.yaml):

* ``probability``: auto (temperature, then isotonic where the calibration split supports it) | temperature | isotonic;
* ``interval``: which scale of u the recalibrated bounds use: rule (the paper's selection rule applied to s: the best
  RS_``rank_alpha`` on the calibration split among the s with EBCE <= ``ebce_target``) | conformal (the risk guarantee
  below) | none (s = 1);
* ``alpha``, ``guarantee`` (high_probability | expectation), ``delta``: the conformal guarantee on CF / N for pairs;
  ``pointwise_alpha`` the miscoverage bound for rated responses (BoRP);
* ``isotonic_min_pairs``: fewer calibration pairs never get the isotonic map.

The conformal guarantee treats calibration pairs as exchangeable and equally weighted, so pair weights are ignored
there (calibration splits come from training data, where every weight is 1); temperature and EBCE use the weights.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.special import expit

from rewarduq_exp.core.checks import check_choice, check_integer
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.calibration import calibration_metrics
from rewarduq_exp.metrics.preference import pairs_from_table
from rewarduq_exp.recalibration.calibration_file import INTERVALS, Calibration
from rewarduq_exp.recalibration.conformal import (
    GUARANTEES,
    conformal_scale,
    coverage_thresholds,
    pair_thresholds,
    risk_at,
)
from rewarduq_exp.recalibration.interval_scale import SCALE_GRID, bound_margins, metrics_by_scale, scale_by_rule
from rewarduq_exp.recalibration.probability import cross_fitted_brier, fit_isotonic, fit_temperature

PROBABILITY_CHOICES = ("auto", "temperature", "isotonic")
DEFAULTS = {"enabled": True, "probability": "auto", "interval": "rule", "ebce_target": 0.01, "rank_alpha": 0.2,
            "alpha": 0.05,
            "guarantee": "high_probability", "delta": 0.1, "pointwise_alpha": 0.1, "isotonic_min_pairs": 500}
PREFIX = "recal/"


def recalibrate_settings(node) -> dict:
    """The ``recalibrate`` block with defaults filled in, checked (one line per bad value, naming the allowed ones)."""
    values = dict(DEFAULTS)
    if node is not None:
        given = dict(node)
        unknown = sorted(set(given) - set(DEFAULTS))
        if unknown:
            raise UserError(f"recalibrate.{unknown[0]} is not a setting; allowed: "
                            f"{', '.join('recalibrate.' + k for k in DEFAULTS)}")
        values.update(given)
    if not isinstance(values["enabled"], bool):
        raise UserError(f"recalibrate.enabled={values['enabled']!r} is invalid: must be true or false")
    check_choice("recalibrate.probability", values["probability"], PROBABILITY_CHOICES)
    check_choice("recalibrate.interval", values["interval"], INTERVALS)
    check_choice("recalibrate.guarantee", values["guarantee"], GUARANTEES)
    for key in ("alpha", "delta", "pointwise_alpha", "ebce_target"):
        _check_open_unit(key, values[key])
    value = values["rank_alpha"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise UserError(f"recalibrate.rank_alpha={value!r} is invalid: must be a number in [0, 1]")
    values["isotonic_min_pairs"] = check_integer("recalibrate.isotonic_min_pairs", values["isotonic_min_pairs"],
                                                 minimum=10, maximum=10**8)
    return values


def _check_open_unit(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise UserError(f"recalibrate.{key}={value!r} is invalid: must be a number in (0, 1)")


def fit_calibration(predictions: pd.DataFrame, settings: dict, split: str, n_bins: int = 20) -> Calibration:
    """Fit on the calibration split's predictions table (pairwise, or rated responses with ``score``)."""
    settings = recalibrate_settings(settings)
    fitted_on = {"split": split, "n": int(len(predictions))}
    if "id" in predictions.columns:   # a record of the rows it was fitted on (the runner refuses overlaps by id)
        from rewarduq_exp.core.hashing import stable_hash

        fitted_on["ids_hash"] = stable_hash(sorted(predictions["id"].astype(str)), n=16)
    if "score" in predictions.columns and "prediction" in predictions.columns:
        return _fit_pointwise(predictions, settings, fitted_on)
    if "chosen_reward" not in predictions.columns:
        raise UserError(f"recalibration: the calibration split {split} must be pairwise or rated responses")
    chosen, rejected, weight = pairs_from_table(predictions)
    margin = chosen[:, 0] - rejected[:, 0]
    temperature = fit_temperature(margin, weight)
    details = {"n_bins": int(n_bins), "ebce_target": float(settings["ebce_target"]),
               "rank_alpha": float(settings["rank_alpha"])}
    use_isotonic = settings["probability"] == "isotonic"
    if settings["probability"] == "auto":
        if len(margin) >= settings["isotonic_min_pairs"]:
            brier = cross_fitted_brier(margin, weight)
            details["cross_fitted_brier"] = brier
            use_isotonic = brier["isotonic"] < brier["temperature"]
            details["probability_choice"] = ("isotonic: its cross-fitted Brier score is lower" if use_isotonic else
                                             "temperature: isotonic's cross-fitted Brier score is not lower")
        else:
            details["probability_choice"] = (f"temperature: {len(margin)} calibration pairs, fewer than "
                                             f"isotonic_min_pairs={settings['isotonic_min_pairs']}")
    isotonic = fit_isotonic(expit(margin / temperature), np.ones(len(margin)), weight) if use_isotonic else None
    by_scale = metrics_by_scale(chosen, rejected, weight, temperature, isotonic, n_bins=n_bins,
                                rank_alpha=settings["rank_alpha"])
    s_rule, met = scale_by_rule(by_scale["ebce"], by_scale["rs"], settings["ebce_target"])
    at, raw = np.searchsorted(SCALE_GRID, s_rule), np.searchsorted(SCALE_GRID, 1.0)
    details["ebce_target_met"] = met
    details["on_calibration_split"] = {"rule_scale": {"ebce": float(by_scale["ebce"][at]),
                                                      "rs": float(by_scale["rs"][at])},
                                       "raw_scale": {"ebce": float(by_scale["ebce"][raw]),
                                                     "rs": float(by_scale["rs"][raw])}}
    conformal = conformal_scale(pair_thresholds(chosen, rejected), settings["alpha"],
                                guarantee=settings["guarantee"], delta=settings["delta"], risk="cf_rate")
    return Calibration(kind="pairs", temperature=temperature, isotonic=isotonic,
                       scales={"rule": s_rule, "conformal": conformal.scale}, interval=settings["interval"],
                       conformal=conformal.to_dict(), fitted_on=fitted_on, details=details)


def _fit_pointwise(predictions: pd.DataFrame, settings: dict, fitted_on: dict) -> Calibration:
    y = predictions["score"].to_numpy(dtype=float)
    r = predictions["prediction"].to_numpy(dtype=float)
    half = predictions["upper"].to_numpy(dtype=float) - r
    conformal = conformal_scale(coverage_thresholds(y, r, half), settings["pointwise_alpha"],
                                guarantee=settings["guarantee"], delta=settings["delta"], risk="miscoverage")
    return Calibration(kind="pointwise", scales={"conformal": conformal.scale}, interval="conformal",
                       conformal=conformal.to_dict(), fitted_on=fitted_on,
                       details={"note": "rated responses: no temperature (a regression), the interval scale only"})


def recalibrated_metrics(predictions: pd.DataFrame, calibration: Calibration, metric_cfg) -> dict:
    """``recal/<metric>`` of a pairwise or K-wise predictions table (the raw table's metrics after the run's
    recalibration; win rates and accuracies are unchanged by construction), with the applied ``recal/temperature``,
    ``recal/scale`` and, for pairwise tables, the conformal scale's realised risk ``recal/conformal/cf_share`` (the
    unweighted share of confidently false pairs, what the guarantee bounds)."""
    from rewarduq_exp.metrics.scoring import score_predictions, scoring_kind

    table = calibration.apply_predictions(predictions)
    found = score_predictions(table, metric_cfg)
    kind = scoring_kind(table, metric_cfg.get("scoring", "auto"))
    if calibration.isotonic is not None and kind == "pairs":
        found.update(_isotonic_calibration(table, calibration, int(metric_cfg.n_bins)))
    out = {f"{PREFIX}{k}": v for k, v in found.items()}
    out[f"{PREFIX}temperature"] = calibration.temperature
    out[f"{PREFIX}scale"] = calibration.scale
    out[f"{PREFIX}probability_map"] = calibration.probability_map
    if "chosen_reward" in predictions.columns and "conformal" in calibration.scales:
        chosen, rejected, _ = pairs_from_table(predictions)
        out[f"{PREFIX}conformal/scale"] = calibration.scales["conformal"]
        out[f"{PREFIX}conformal/cf_share"] = risk_at(pair_thresholds(chosen, rejected),
                                                     calibration.scales["conformal"])
        out[f"{PREFIX}conformal/alpha"] = calibration.conformal.get("alpha")
        out[f"{PREFIX}conformal/feasible"] = calibration.conformal.get("feasible")
    return out


def _isotonic_calibration(table: pd.DataFrame, calibration: Calibration, n_bins: int) -> dict:
    """ECE, ELCE/EUCE/EBCE and Brier of a (recalibrated) pairwise table with the isotonic map on its probabilities."""
    chosen, rejected, weight = pairs_from_table(table)
    m, lo, hi = bound_margins(chosen, rejected, 1.0)   # the table's bounds are already scaled
    p, p_lo, p_hi = (calibration.probability(expit(v)) for v in (m, lo, hi))
    return calibration_metrics(p, np.minimum(p_lo, p), np.maximum(p_hi, p), np.ones(len(p)), weight, n_bins=n_bins)


def recalibrated_pointwise_metrics(y, reward, lower, upper, calibration: Calibration) -> dict:
    """Coverage and width of rated responses' intervals before (``probe/...``) and after (``recal/probe/...``)."""
    y, r, lo, hi = (np.asarray(a, dtype=float) for a in (y, reward, lower, upper))
    r2, lo2, hi2 = calibration.apply_arrays(r, lo, hi)
    return {"probe/coverage": float(np.mean((y >= lo) & (y <= hi))), "probe/mean_width": float(np.mean(hi - lo)),
            f"{PREFIX}probe/coverage": float(np.mean((y >= lo2) & (y <= hi2))),
            f"{PREFIX}probe/mean_width": float(np.mean(hi2 - lo2)), f"{PREFIX}scale": calibration.scale,
            f"{PREFIX}conformal/scale": calibration.scales.get("conformal"),
            f"{PREFIX}conformal/alpha": calibration.conformal.get("alpha"),
            f"{PREFIX}conformal/feasible": calibration.conformal.get("feasible")}
