"""``<run>/calibration.json``: a run's recalibration (fitted on its calibration split after training) and how every
reader applies it to scores.

Applied per response, so the API, evaluation and downstream tasks all see the same recalibrated
``(reward, lower, upper)``:

    reward' = reward / T,  lower' = (reward - s (reward - lower)) / T,  upper' = (reward + s (upper - reward)) / T

(T: temperature, s: the interval scale; bounds r +- beta s u on the temperature's scale). T > 0 and one affine map
per response keep every ordering of rewards, so no win rate changes. An isotonic map, where fitted, acts on pair
probabilities only (``probability``): it is not a function of one response's score. Rated responses (BoRP) get no
temperature (a regression has no probability to scale): only s.

The file is strict JSON, written atomically; read back with bounds (a run folder is a file anyone can hand you):
every number finite and in its range, the knots of an isotonic map sorted and in [0, 1].

An infeasible conformal scale (``conformal.feasible: false``: no scale meets the guarantee on this calibration split)
is never applied: asked for, the bounds fall back to the rule's scale (rated responses: s = 1) with one warning line,
and the file records it (``interval``: what is applied, ``interval_requested``: what was asked for,
``interval_fallback``: why). A file from before that rule which applies such a scale is read with the same fallback.

A calibration belongs to one model: ``fitted_to`` names the ``model_id`` of the run's ``model/method.json`` (new at
every save) and the kind of scores that model gives, and ``fitted_on`` the calibration split's rows (their ids' hash)
and the predictions' scores (``scores_hash``). A reader refuses, in one line, a file fitted to another model (copied
from another run, or reached through a link to one), of the wrong kind (``pointwise`` in a run of pairs), or unbound in
a run whose model has an id (a binding removed). Runs saved before models had an id read their file as before.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.saved_files import read_json_object
from rewarduq_exp.methods.base import Scores
from rewarduq_exp.recalibration.probability import LOG_T_BOUNDS, IsotonicMap

log = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.json"
FORMAT = 1
INTERVALS = ("rule", "conformal", "none")
PROBABILITY_MAPS = ("temperature", "isotonic")
# Largest interval scale a file may hold: the fitted grid ends at 1e3; a conformal threshold can be larger, but a
# scale beyond this makes every interval cover everything and is refused as damage.
MAX_SCALE = 1e9
MAX_KNOTS = 200_000
MAX_TEXT = 1000   # characters of interval_fallback: one line of why, never a document
# The rule's grid of interval scales (interval_scale.SCALE_GRID): a scale outside it is read, with one warning line.
SANE_SCALE = (1e-3, 1e3)


@dataclass
class Calibration:
    """A fitted recalibration. ``kind``: ``pairs`` (reward models) or ``pointwise`` (rated responses)."""

    kind: str
    temperature: float = 1.0
    isotonic: IsotonicMap | None = None
    scales: dict = field(default_factory=dict)   # criterion -> s (rule, conformal)
    interval: str = "rule"                       # which of ``scales`` the bounds use (none: s = 1)
    conformal: dict = field(default_factory=dict)
    fitted_on: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    interval_requested: str | None = None        # what was asked for (None: ``interval``)
    interval_fallback: str | None = None         # why ``interval`` is not the one asked for (None: it is)
    fitted_to: dict = field(default_factory=dict)  # the model it belongs to: model_id, method (set when saved)

    def __post_init__(self):
        if self.interval_requested is None:
            self.interval_requested = self.interval

    @property
    def scale(self) -> float:
        return 1.0 if self.interval == "none" else float(self.scales[self.interval])

    @property
    def conformal_scale(self) -> float | None:
        """s_c, or None where there is none or it is infeasible (no scale met the guarantee: it is never used)."""
        if "conformal" not in self.scales or self.conformal.get("feasible", True) is False:
            return None
        return float(self.scales["conformal"])

    @property
    def fallback_interval(self) -> str:
        """What replaces an infeasible conformal scale: the rule's (reward models) or s = 1 (rated responses)."""
        return "rule" if "rule" in self.scales else "none"

    def without_infeasible(self, requested: str, asked: str, *, recorded: bool = False) -> Calibration:
        """This calibration with ``requested`` applied, or, where that is an infeasible conformal scale, with
        :attr:`fallback_interval` and one warning line naming what ``asked`` for it (``recalibrate.interval=conformal``
        and the like; ``recorded``: the line says calibration.json keeps the fallback, as when it is fitted)."""
        if requested != "conformal" or self.conformal_scale is not None or "conformal" not in self.scales:
            return replace(self, interval=requested, interval_requested=requested, interval_fallback=None)
        why = infeasible_reason(self.conformal)
        out = replace(self, interval=self.fallback_interval, interval_requested=requested, interval_fallback=why)
        log.warning("%s", fallback_line(why, asked, out.interval, out.scale, recorded))
        return out

    @property
    def probability_map(self) -> str:
        return "isotonic" if self.isotonic is not None else "temperature"

    def with_interval(self, interval: str) -> Calibration:
        """The same calibration with the bounds of another criterion (``recalibrate.interval`` of evaluate.py)."""
        if interval not in INTERVALS or (interval != "none" and interval not in self.scales):
            allowed = [k for k in INTERVALS if k == "none" or k in self.scales]
            raise UserError(f"recalibrate_interval={interval!r} is invalid for this run: allowed values are "
                            f"{', '.join(allowed)}")
        return self.without_infeasible(interval, f"recalibrate_interval={interval}")

    # ------------------------------------------------------------------ applying
    def apply_arrays(self, reward, lower, upper) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r, lo, hi = (np.asarray(a, dtype=float) for a in (reward, lower, upper))
        s, t = self.scale, self.temperature
        return r / t, (r - s * (r - lo)) / t, (r + s * (hi - r)) / t

    def apply(self, scores: Scores) -> Scores:
        """reward / T and u s / T, with the same beta: bounds (r -+ beta s u) / T, as :meth:`apply_arrays` gives."""
        t = self.temperature
        return Scores(scores.reward / t, scores.u * (self.scale / t), scores.beta)

    def probability(self, p):
        """Pair probabilities already on the temperature's scale, through the isotonic map where one was fitted."""
        return self.isotonic(p) if self.isotonic is not None else np.asarray(p, dtype=float)

    def apply_predictions(self, predictions: pd.DataFrame) -> pd.DataFrame:
        """A predictions table (pairwise, K-wise or rated responses) with its scores recalibrated."""
        out = predictions.copy()
        if "chosen_reward" in out.columns:
            for side in ("chosen", "rejected"):
                cols = [f"{side}_{c}" for c in ("reward", "lower", "upper")]
                r, lo, hi = self.apply_arrays(*(out[c].to_numpy(dtype=float) for c in cols))
                out[cols[0]], out[cols[1]], out[cols[2]] = r, lo, hi
        elif "rewards" in out.columns:
            lowers = out["lowers"] if "lowers" in out.columns else out["rewards"]
            uppers = out["uppers"] if "uppers" in out.columns else out["rewards"]
            rows = [self.apply_arrays(r, lo, hi) for r, lo, hi in zip(out["rewards"], lowers, uppers)]
            out["rewards"], out["lowers"], out["uppers"] = ([list(row[i]) for row in rows] for i in range(3))
        elif "prediction" in out.columns:
            r, lo, hi = self.apply_arrays(out["prediction"], out["lower"], out["upper"])
            out["prediction"], out["lower"], out["upper"] = r, lo, hi
            if "u" in out.columns:
                out["u"] = out["u"].to_numpy(dtype=float) * self.scale
        else:
            raise UserError("recalibration: a predictions table needs chosen_/rejected_ columns, rewards lists or "
                            "prediction/lower/upper")
        return out

    # ------------------------------------------------------------------ the file
    def to_dict(self) -> dict:
        return {"format": FORMAT, "kind": self.kind, "interval": self.interval, "scale": self.scale,
                "probability": {"map": self.probability_map, "temperature": self.temperature,
                                "isotonic": None if self.isotonic is None else
                                {"x": self.isotonic.x.tolist(), "y": self.isotonic.y.tolist()}},
                "scales": dict(self.scales), "conformal": dict(self.conformal), "fitted_on": dict(self.fitted_on),
                "details": dict(self.details), "interval_requested": self.interval_requested,
                "interval_fallback": self.interval_fallback, "fitted_to": dict(self.fitted_to)}

    @classmethod
    def from_dict(cls, data: dict, where: str) -> Calibration:
        def bad(what: str) -> UserError:
            return UserError(f"{where} is refused: {what}")

        if data.get("format") != FORMAT:
            raise bad(f"format {data.get('format')!r} is not {FORMAT} (written by another version)")
        kind = data.get("kind")
        if kind not in ("pairs", "pointwise"):
            raise bad(f"kind {kind!r} is not pairs or pointwise")
        prob = data.get("probability")
        if not isinstance(prob, dict):
            raise bad("probability is not an object")
        t = _number(prob.get("temperature"))
        if t is None or not math.exp(LOG_T_BOUNDS[0]) * 0.999 <= t <= math.exp(LOG_T_BOUNDS[1]) * 1.001:
            raise bad(f"probability.temperature {prob.get('temperature')!r} is not a number in [1e-3, 1e3]")
        isotonic = None
        if prob.get("isotonic") is not None:
            knots = prob["isotonic"]
            x, y = (np.asarray(knots.get(k) if isinstance(knots, dict) else None, dtype=object) for k in "xy")
            try:
                x, y = x.astype(float), y.astype(float)
            except (TypeError, ValueError):
                raise bad("probability.isotonic knots are not lists of numbers") from None
            if (x.ndim != 1 or x.shape != y.shape or not 1 <= len(x) <= MAX_KNOTS or not np.isfinite(x).all()
                    or not np.isfinite(y).all() or (x < 0).any() or (x > 1).any() or (y < 0).any() or (y > 1).any()
                    or (np.diff(x) < 0).any() or (np.diff(y) < 0).any()):
                raise bad(f"probability.isotonic knots must be 1..{MAX_KNOTS} sorted values in [0, 1], x and y "
                          "alike")
            isotonic = IsotonicMap(x, y)
        scales = data.get("scales")
        if not isinstance(scales, dict) or not set(scales) <= {"rule", "conformal"}:
            raise bad("scales must map rule / conformal to numbers")
        for key, value in scales.items():
            v = _number(value)
            if v is None or not 0 <= v <= MAX_SCALE:
                raise bad(f"scales.{key} {value!r} is not a number in [0, {MAX_SCALE:g}]")
        interval = data.get("interval")
        if interval not in INTERVALS or (interval != "none" and interval not in scales):
            raise bad(f"interval {interval!r} is not one of {', '.join(INTERVALS)} with its scale present")
        # Files from before interval_requested / interval_fallback existed lack both: nothing fell back then.
        requested, fallback = data.get("interval_requested", interval), data.get("interval_fallback")
        if requested not in INTERVALS:
            raise bad(f"interval_requested {requested!r} is not one of {', '.join(INTERVALS)}")
        if fallback is not None and (not isinstance(fallback, str) or not 0 < len(fallback) <= MAX_TEXT):
            raise bad(f"interval_fallback must be null or a text of 1..{MAX_TEXT} characters")
        found = cls(kind=kind, temperature=float(t), isotonic=isotonic,
                    scales={k: float(v) for k, v in scales.items()}, interval=interval,
                    conformal=_object(data.get("conformal")), fitted_on=_object(data.get("fitted_on")),
                    details=_object(data.get("details")), interval_requested=requested, interval_fallback=fallback,
                    fitted_to=_fitted_to(data.get("fitted_to"), bad))
        if fallback is None and requested != interval:
            raise bad(f"interval_requested {requested!r} differs from interval {interval!r} without an "
                      "interval_fallback saying why")
        if fallback is not None and (requested != "conformal" or found.conformal_scale is not None
                                     or interval != found.fallback_interval):
            raise bad(f"interval_fallback is only for an infeasible conformal scale replaced by "
                      f"{found.fallback_interval!r}, not interval_requested {requested!r} -> interval {interval!r}")
        if interval == "conformal" and found.conformal_scale is None:   # written before such scales were refused
            return found.without_infeasible("conformal", f"{where} (written before infeasible scales were refused): "
                                                         "interval=conformal")
        return found


def _fitted_to(value, bad) -> dict:
    """The ``fitted_to`` record: absent (a file from before calibrations were bound) or a model id of hex digits."""
    if value is None or value == {}:   # {}: written where no model was saved beside it
        return {}
    if not isinstance(value, dict) or not _is_model_id(value.get("model_id")):
        raise bad("fitted_to must name the model_id (32 hex digits) of the model it was fitted on")
    method = value.get("method")
    if method is not None and not (isinstance(method, str) and 0 < len(method) <= 100):
        raise bad("fitted_to.method must be a method name")
    return {"model_id": value["model_id"], "method": method}


def _is_model_id(value) -> bool:
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)


def infeasible_reason(conformal: dict) -> str:
    """Why a conformal scale is infeasible, from its record (a file from before the reason was kept: its n)."""
    reason = conformal.get("reason")
    if isinstance(reason, str) and reason:
        return reason[:MAX_TEXT]
    return f"no scale met the guarantee on its n={conformal.get('n')} calibration items (feasible: false)"


def fallback_line(reason: str, asked: str, applied: str, scale: float, recorded: bool = False) -> str:
    """The one warning line of an infeasible conformal scale that was ``asked`` for and is replaced."""
    instead = "the rule's scale" if applied == "rule" else "no scale (none: s = 1)"
    kept = " (recorded in calibration.json as interval_fallback)" if recorded else ""
    return (f"the conformal interval scale is infeasible and is not applied: {reason}; {asked} falls back to "
            f"{instead}, s = {scale:.4g}{kept}")


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _object(value) -> dict:
    return dict(value) if isinstance(value, dict) else {}


def save_calibration(run_dir, calibration: Calibration) -> Path:
    """Write ``calibration.json``, bound to the model saved in the run's ``model/`` (where there is one)."""
    from rewarduq_exp.core.strict_json import write_json

    model = saved_model(run_dir)
    if model is not None and _is_model_id(model.get("model_id")):
        calibration = replace(calibration, fitted_to={"model_id": model["model_id"], "method": model.get("method")})
    path = Path(run_dir) / CALIBRATION_FILE
    write_json(path, calibration.to_dict())
    return path


def saved_model(run_dir) -> dict | None:
    """The run's ``model/method.json`` (None where the folder has none: not a run, or a bare calibration folder)."""
    path = Path(run_dir) / "model" / "method.json"
    return read_json_object(path, "the saved method") if path.exists() else None


def check_bound_to_run(calibration: Calibration, run_dir, where: str) -> None:
    """Refuse a calibration that belongs to another model than the run's, or gives another kind of scores."""
    model = saved_model(run_dir)
    if model is None:
        return
    ours, theirs = model.get("model_id"), calibration.fitted_to.get("model_id")
    if theirs is not None and theirs != ours:
        raise UserError(f"{where} is refused: it was fitted on another model ({calibration.fitted_to.get('method')} "
                        f"model_id {theirs}; this run's model {ours}): copied from another run or linked to its "
                        "file? delete it (the run then scores raw) or retrain the run to fit its own")
    if theirs is None and _is_model_id(ours):
        raise UserError(f"{where} is refused: it names no model it was fitted on (fitted_to), but this run's model "
                        f"has one ({ours}): a calibration of this run always does, so this one comes from elsewhere; "
                        "delete it or retrain the run")
    task = model.get("task") or ("pointwise" if model.get("method") == "borp" else "preferences")
    expected = {"pointwise": "pointwise", "preferences": "pairs"}.get(task)
    if expected is not None and calibration.kind != expected:
        raise UserError(f"{where} is refused: kind {calibration.kind!r} does not fit this run's model "
                        f"({model.get('method')} scores {expected}); delete it or retrain the run")


def read_calibration(run_dir, *, say_missing: bool = True) -> Calibration | None:
    """The run's recalibration, or None (with one log line) for a run without ``calibration.json``: trained before
    recalibration existed or with ``recalibrate.enabled=false``."""
    path = Path(run_dir) / CALIBRATION_FILE
    if not path.exists() and not path.is_symlink():
        if say_missing:
            log.warning("%s has no %s (trained before recalibration existed, or with recalibrate.enabled=false): "
                        "raw scores and metrics only", run_dir, CALIBRATION_FILE)
        return None
    calibration = Calibration.from_dict(read_json_object(path, "the run's recalibration"), str(path))
    check_bound_to_run(calibration, run_dir, str(path))
    s = calibration.scale
    if not SANE_SCALE[0] <= s <= SANE_SCALE[1]:   # valid, but hardly what a fit gives: say what it does
        what = ("u = 0 everywhere: every interval is the reward alone" if s == 0 else
                f"intervals {s:.3g} times as wide as the model's own" if s > 1 else
                f"intervals {s:.3g} times the model's own, almost the reward alone")
        log.warning("%s applies the interval scale s = %.4g (%s); the rule's fitted grid spans %g..%g", path, s,
                    what, *SANE_SCALE)
    return calibration
