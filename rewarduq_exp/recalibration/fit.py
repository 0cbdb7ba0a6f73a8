"""Fitting a run's recalibration on its calibration split, and the recalibrated metrics of an evaluated set.

``recalibrate`` settings (conf/train.yaml):

* ``probability``: auto (temperature, then isotonic where the calibration split supports it) | temperature | isotonic;
* ``interval``: which scale of u the recalibrated bounds use: rule (the paper's selection rule applied to s: the best
  RS_``rank_alpha`` on the calibration split among the s with EBCE <= ``ebce_target``) | conformal (the risk guarantee
  below) | none (s = 1);
* ``alpha``, ``guarantee`` (high_probability | expectation), ``delta``: the conformal guarantee on CF / N for pairs;
  ``pointwise_alpha`` the miscoverage bound for rated responses (BoRP);
* ``isotonic_min_pairs``: fewer calibration pairs never get the isotonic map;
* ``temperature_prior_sd`` (0.2; null: maximum likelihood), ``temperature_check`` (true) and ``isotonic_z`` (1.645):
  how a map fitted on few pairs is kept from making the probabilities worse (:func:`fit_probability_map`).

The conformal guarantee treats calibration pairs as exchangeable and equally weighted, so pair weights are ignored
there (calibration splits come from training data, where every weight is 1); temperature and EBCE use the weights.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pandas as pd
from scipy.special import expit

from rewarduq_exp.core.checks import check_choice, check_integer
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.hashing import stable_hash
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
from rewarduq_exp.recalibration.probability import (
    ISOTONIC_Z,
    IsotonicMap,
    cross_fitted_brier,
    cross_fitted_log_loss,
    fit_isotonic,
    fit_temperature,
)

PROBABILITY_CHOICES = ("auto", "temperature", "isotonic")
DEFAULTS = {"enabled": True, "probability": "auto", "interval": "rule", "ebce_target": 0.01, "rank_alpha": 0.2,
            "alpha": 0.05,
            "guarantee": "high_probability", "delta": 0.1, "pointwise_alpha": 0.1, "isotonic_min_pairs": 500,
            "temperature_prior_sd": 0.2, "temperature_check": True, "isotonic_z": ISOTONIC_Z}
# The largest prior sd accepted: beyond it the prior is nothing next to one pair (and 0 would fix T = 1 outright,
# which temperature_check already offers where the data do not support T).
MAX_PRIOR_SD = 100.0
PREFIX = "recal/"


def interval_prefix(interval: str) -> str:
    """``recal@<interval>/``: where evaluate.py puts the metrics of an interval choice other than the run's own, beside
    the run's own ``recal/`` rows (which it never replaces)."""
    return f"recal@{interval}/"

log = logging.getLogger(__name__)


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
    sd = values["temperature_prior_sd"]
    if sd is not None and (isinstance(sd, bool) or not isinstance(sd, (int, float)) or not 0 < sd <= MAX_PRIOR_SD):
        raise UserError(f"recalibrate.temperature_prior_sd={sd!r} is invalid: must be null (maximum likelihood) or a "
                        f"number in (0, {MAX_PRIOR_SD:g}]")
    z = values["isotonic_z"]
    if isinstance(z, bool) or not isinstance(z, (int, float)) or not 0 <= z <= 10:
        raise UserError(f"recalibrate.isotonic_z={z!r} is invalid: must be a number in [0, 10] (standard errors; 0: "
                        "isotonic wherever its cross-fitted Brier score is lower at all)")
    if not isinstance(values["temperature_check"], bool):
        raise UserError(f"recalibrate.temperature_check={values['temperature_check']!r} is invalid: must be true or "
                        "false")
    return values


def _check_open_unit(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise UserError(f"recalibrate.{key}={value!r} is invalid: must be a number in (0, 1)")


def fit_probability_map(margin, weight, settings: dict) -> tuple[float, IsotonicMap | None, dict]:
    """(T, the isotonic map or None, what was chosen and why: ``temperature_choice``, ``probability_choice`` and
    the cross-fitted scores behind them) of calibration pairs' margins (chosen minus rejected) under checked
    ``settings`` (:func:`recalibrate_settings`): the probability map of :func:`fit_calibration`, which
    ``scripts/calibration_size_table.py`` fits on subsets of a calibration split exactly so.

    The temperature is the MAP estimate under log T ~ N(0, ``temperature_prior_sd``^2), and with
    ``temperature_check`` it is kept only where its cross-fitted log loss on the calibration pairs (5 folds, each
    fold's T fitted on the others, with the same prior) is lower than the raw probabilities' (T = 1); else T = 1.
    Why both, from the measurement in docs/recalibration.md (calibration subsets of 20-2000 pairs, eval ECE after
    minus before): the plain maximum-likelihood T made the eval ECE worse on average below 100-500 pairs (+0.038 at
    20 pairs for BAY-LIN, whose T is 0.78, +0.023 for ENS-MLP). A minimum size would throw away the real gains of a
    badly scaled model (T 3: ECE -0.096 from 20 pairs) and still needs a threshold; the check alone (keep the
    maximum-likelihood T where it wins held out) still picked noisy temperatures often enough to hurt on average
    (+0.014 at 20 pairs for BAY-LIN); the prior alone kept every mean at or below 0 but left about half the draws of
    BAY-LIN slightly worse. The prior sd 0.2 (T within a factor 1.5 of 1 before any data) is the widest of those
    measured (0.2, 0.3, 0.5) that made no size worse on average (0.3: +0.002 at 100 pairs for BAY-LIN); it costs
    part of the gain of a badly scaled model at small sizes (T 3: -0.028 instead of -0.096 from 20 pairs), and from
    a few hundred pairs the data override it. The check cuts the share of draws made worse (BAY-LIN at 20 pairs:
    0.46 with the prior alone, 0.19 with both). A model that is exactly calibrated cannot gain and loses from every
    T but 1: the guards cut that loss (+0.05 -> +0.003 at 20 simulated pairs) but do not remove it. Then the
    isotonic map on top of that T, where its cross-fitted Brier score is lower by ``isotonic_z`` standard errors
    (:mod:`.probability`)."""
    m = np.asarray(margin, dtype=float)
    w = np.ones_like(m) if weight is None else np.asarray(weight, dtype=float)
    prior = settings["temperature_prior_sd"]
    details: dict = {"temperature_prior_sd": prior}
    temperature = fit_temperature(m, w, prior)
    if not settings["temperature_check"]:
        details["temperature_choice"] = (f"fitted: T = {temperature:.4g} (temperature_check=false)")
    elif len(m) < 2:
        details["temperature_choice"] = f"1 (raw probabilities): {len(m)} calibration pair cannot be cross-fitted"
        temperature = 1.0
    else:
        loss = cross_fitted_log_loss(m, w, prior)
        details["cross_fitted_log_loss"] = loss
        if loss["fitted"] < loss["raw"]:
            details["temperature_choice"] = (f"fitted: T = {temperature:.4g} lowers the cross-fitted log loss "
                                             f"({loss['fitted']:.4g} against {loss['raw']:.4g} with T = 1)")
        else:
            details["temperature_choice"] = (f"1 (raw probabilities): the fitted T = {temperature:.4g} does not lower "
                                             f"the cross-fitted log loss ({loss['fitted']:.4g} against "
                                             f"{loss['raw']:.4g} with T = 1)")
            temperature = 1.0
    use_isotonic = settings["probability"] == "isotonic"
    if settings["probability"] == "auto":
        if len(m) >= settings["isotonic_min_pairs"]:
            kept = temperature   # the folds fit T as above, or keep T = 1 where the check did
            brier = cross_fitted_brier(m, w, fit_t=(lambda mm, ww: fit_temperature(mm, ww, prior)) if kept != 1.0
                                       else (lambda mm, ww: 1.0))
            details["cross_fitted_brier"] = brier
            z = settings["isotonic_z"]
            use_isotonic = brier["isotonic"] < brier["temperature"] - z * brier["difference_se"]
            details["probability_choice"] = (
                f"isotonic: its cross-fitted Brier score is lower by more than isotonic_z={z:g} standard errors"
                if use_isotonic else f"temperature: isotonic's cross-fitted Brier score is not lower by more than "
                f"isotonic_z={z:g} standard errors")
        else:
            details["probability_choice"] = (f"temperature: {len(m)} calibration pairs, fewer than "
                                             f"isotonic_min_pairs={settings['isotonic_min_pairs']}")
    isotonic = fit_isotonic(expit(m / temperature), np.ones(len(m)), w) if use_isotonic else None
    return temperature, isotonic, details


def scores_hash(predictions: pd.DataFrame) -> str:
    """The identity of the predictions a calibration was fitted on: their numeric columns in row order, as float64
    bytes (the same model on the same rows gives the same hash; another model's scores another)."""
    numbers = predictions.select_dtypes("number").sort_index(axis=1)
    digest = hashlib.sha256(",".join(numbers.columns).encode())
    digest.update(np.ascontiguousarray(numbers.to_numpy(dtype=np.float64)).tobytes())
    return digest.hexdigest()[:16]


def fit_calibration(predictions: pd.DataFrame, settings: dict, split: str, n_bins: int = 20) -> Calibration:
    """Fit on the calibration split's predictions table (pairwise, or rated responses with ``score``)."""
    settings = recalibrate_settings(settings)
    fitted_on = {"split": split, "n": int(len(predictions)), "scores_hash": scores_hash(predictions)}
    if "id" in predictions.columns:   # a record of the rows it was fitted on (the runner refuses overlaps by id)
        fitted_on["ids_hash"] = stable_hash(sorted(predictions["id"].astype(str)), n=16)
    if "score" in predictions.columns and "prediction" in predictions.columns:
        return _fit_pointwise(predictions, settings, fitted_on)
    if "chosen_reward" not in predictions.columns:
        raise UserError(f"recalibration: the calibration split {split} must be pairwise or rated responses")
    chosen, rejected, weight = pairs_from_table(predictions)
    margin = chosen[:, 0] - rejected[:, 0]
    details = {"n_bins": int(n_bins), "ebce_target": float(settings["ebce_target"]),
               "rank_alpha": float(settings["rank_alpha"])}
    temperature, isotonic, choices = fit_probability_map(margin, weight, settings)
    details.update(choices)
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
    fitted = Calibration(kind="pairs", temperature=temperature, isotonic=isotonic,
                         scales={"rule": s_rule, "conformal": conformal.scale}, interval="rule",
                         conformal=conformal.to_dict(), fitted_on=fitted_on, details=details)
    return _applied(fitted, conformal, settings["interval"], f"recalibrate.interval={settings['interval']}")


def _applied(fitted: Calibration, conformal, interval: str, asked: str) -> Calibration:
    """``fitted`` with ``interval`` applied. An infeasible conformal scale is never applied: asked for, the bounds fall
    back (one warning line; calibration.json records it); not asked for, one line still says that it is not there to
    use (downstream reads none: :attr:`Calibration.conformal_scale`)."""
    applied = fitted.without_infeasible(interval, asked, recorded=True)
    if not conformal.feasible and interval != "conformal":
        log.warning("the conformal interval scale is infeasible and is not used anywhere: %s (%s applies s = %.4g)",
                    conformal.reason, asked, applied.scale)
    return applied


def _fit_pointwise(predictions: pd.DataFrame, settings: dict, fitted_on: dict) -> Calibration:
    y = predictions["score"].to_numpy(dtype=float)
    r = predictions["prediction"].to_numpy(dtype=float)
    half = predictions["upper"].to_numpy(dtype=float) - r
    conformal = conformal_scale(coverage_thresholds(y, r, half), settings["pointwise_alpha"],
                                guarantee=settings["guarantee"], delta=settings["delta"], risk="miscoverage")
    # Rated responses have no rule's scale: their interval is the conformal one (s = 1 where it is infeasible).
    fitted = Calibration(kind="pointwise", scales={"conformal": conformal.scale}, interval="none",
                         conformal=conformal.to_dict(), fitted_on=fitted_on,
                         details={"note": "rated responses: no temperature (a regression), the interval scale only"})
    return _applied(fitted, conformal, "conformal", "the rated responses' interval (conformal, always)")


def recalibrated_metrics(predictions: pd.DataFrame, calibration: Calibration, metric_cfg,
                         prefix: str = PREFIX) -> dict:
    """``recal/<metric>`` of a pairwise or K-wise predictions table (the raw table's metrics after the run's
    recalibration; win rates and accuracies are unchanged by construction), with the applied ``recal/temperature``,
    ``recal/scale`` and which scale that is, ``recal/interval`` (rule, conformal or none), and, for pairwise
    tables, the conformal scale's realised risk ``recal/conformal/cf_share`` (the unweighted share of confidently
    false pairs, what the guarantee bounds; absent, like ``recal/conformal/scale``, where the scale is infeasible:
    it guarantees nothing). ``prefix``: another name for the block (``recal@conformal/``: evaluate.py's other
    interval choice beside the run's own)."""
    from rewarduq_exp.metrics.scoring import score_predictions, scoring_kind

    table = calibration.apply_predictions(predictions)
    found = score_predictions(table, metric_cfg)
    kind = scoring_kind(table, metric_cfg.get("scoring", "auto"))
    if calibration.isotonic is not None and kind == "pairs":
        found.update(_isotonic_calibration(table, calibration, int(metric_cfg.n_bins)))
    out = {f"{prefix}{k}": v for k, v in found.items()}
    out[f"{prefix}temperature"] = calibration.temperature
    out[f"{prefix}scale"] = calibration.scale
    out[f"{prefix}interval"] = calibration.interval
    out[f"{prefix}probability_map"] = calibration.probability_map
    if "chosen_reward" in predictions.columns and "conformal" in calibration.scales:
        if calibration.conformal_scale is not None:
            chosen, rejected, _ = pairs_from_table(predictions)
            out[f"{prefix}conformal/scale"] = calibration.conformal_scale
            out[f"{prefix}conformal/cf_share"] = risk_at(pair_thresholds(chosen, rejected),
                                                         calibration.conformal_scale)
        out[f"{prefix}conformal/alpha"] = calibration.conformal.get("alpha")
        out[f"{prefix}conformal/feasible"] = calibration.conformal.get("feasible")
    return out


def _isotonic_calibration(table: pd.DataFrame, calibration: Calibration, n_bins: int) -> dict:
    """ECE, ELCE/EUCE/EBCE and Brier of a (recalibrated) pairwise table with the isotonic map on its probabilities."""
    chosen, rejected, weight = pairs_from_table(table)
    m, lo, hi = bound_margins(chosen, rejected, 1.0)   # the table's bounds are already scaled
    p, p_lo, p_hi = (calibration.probability(expit(v)) for v in (m, lo, hi))
    return calibration_metrics(p, np.minimum(p_lo, p), np.maximum(p_hi, p), np.ones(len(p)), weight, n_bins=n_bins)


def recalibrated_pointwise_metrics(y, reward, lower, upper, calibration: Calibration, prefix: str = PREFIX) -> dict:
    """Coverage and width of rated responses' intervals before (``probe/...``) and after (``recal/probe/...``), with
    the applied ``recal/scale`` and ``recal/interval`` (``prefix`` as in :func:`recalibrated_metrics`)."""
    y, r, lo, hi = (np.asarray(a, dtype=float) for a in (y, reward, lower, upper))
    r2, lo2, hi2 = calibration.apply_arrays(r, lo, hi)
    out = {"probe/coverage": float(np.mean((y >= lo) & (y <= hi))), "probe/mean_width": float(np.mean(hi - lo)),
           f"{prefix}probe/coverage": float(np.mean((y >= lo2) & (y <= hi2))),
           f"{prefix}probe/mean_width": float(np.mean(hi2 - lo2)), f"{prefix}scale": calibration.scale,
           f"{prefix}interval": calibration.interval,
           f"{prefix}conformal/alpha": calibration.conformal.get("alpha"),
           f"{prefix}conformal/feasible": calibration.conformal.get("feasible")}
    if calibration.conformal_scale is not None:   # an infeasible one guarantees nothing: not reported as a scale
        out[f"{prefix}conformal/scale"] = calibration.conformal_scale
    return out
