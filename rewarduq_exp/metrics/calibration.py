"""Calibration of preference probabilities and their bounds (RewardUQ paper, eqs. 7-8, appendix A.3-A.5).

Probabilities are Bradley-Terry: ``p = sigmoid(m)`` with bounds ``sigmoid(m_lower)``, ``sigmoid(m_upper)``. Every
metric here is computed on the symmetrised set: each pair contributes its row ``(p, p_lo, p_hi, y)`` and the flipped
row ``(1-p, 1-p_hi, 1-p_lo, 1-y)`` (the bounds swap), both with the pair's weight. This makes the metrics
independent of which response is listed first. Bins are ``n_bins`` equal-width, left-closed bins on [0, 1] with
1.0 in the last bin; predictions, lower and upper bounds are each binned by their own value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.preference import check_n_bins, table_columns, weighted_sum

# Probabilities from a valid table are ordered exactly (rounding is monotone); this only absorbs caller noise.
_ORDER_TOL = 1e-12
# Rows per step of the calibration curves of a predictions table (_preferred_curves).
_CHUNK = 16384


@dataclass(frozen=True, eq=False)
class CalibrationCurve:
    """Per-bin reliability statistics of one kind of probability (prediction, lower or upper bound).

    ``edges`` has n_bins+1 entries; ``confidence`` (weighted mean probability), ``accuracy`` (weighted mean label)
    and ``weight`` (total weight) have n_bins. Empty bins have NaN confidence/accuracy and weight 0.
    """

    edges: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray
    weight: np.ndarray

    @property
    def occupied(self) -> np.ndarray:
        return self.weight > 0

    @property
    def share(self) -> np.ndarray:
        """Each bin's share of the total weight."""
        return self.weight / self.weight.sum()

    def _weighted(self, gap: np.ndarray) -> float:
        occ = self.occupied
        return float(np.dot(self.share[occ], gap[occ]))

    def ece(self) -> float:
        """Expected calibration error (eq. 7): sum_b share_b * |acc_b - conf_b|."""
        return self._weighted(np.abs(self.accuracy - self.confidence))

    def mce(self) -> float:
        """Maximum calibration error: max over non-empty bins of |acc_b - conf_b|."""
        return float(np.max(np.abs(self.accuracy - self.confidence)[self.occupied]))

    def lower_error(self) -> float:
        """ELCE form (eq. 8): sum_b share_b * max(conf_b - acc_b, 0); a lower bound above the frequency is an error."""
        return self._weighted(np.maximum(self.confidence - self.accuracy, 0.0))

    def upper_error(self) -> float:
        """EUCE form (eq. 8): sum_b share_b * max(acc_b - conf_b, 0); an upper bound below the frequency is an error."""
        return self._weighted(np.maximum(self.accuracy - self.confidence, 0.0))


def binned_curve(q: np.ndarray, y: np.ndarray, w: np.ndarray, n_bins: int) -> CalibrationCurve:
    """Bin probabilities ``q`` (labels ``y`` in [0, 1], weights ``w``) into a :class:`CalibrationCurve`.

    No symmetrisation here; callers pass the symmetrised rows.
    """
    n_bins = check_n_bins(n_bins)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    return _curve(edges, bin_index(q, edges), q, w * y, w)


def bin_index(q: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The bin of each probability ``q`` in [0, 1] under ``edges`` (``np.linspace(0, 1, n_bins + 1)``): the bins
    of ``np.digitize(np.round(q, 12), edges[1:-1])``, computed directly (floor of q times n_bins), value for value
    (tests/test_calibration_bins.py).

    Assigned after rounding to 12 decimals: a probability on an edge and its flip (1 - 0.7 = 0.30000000000000004
    for 0.3) must land in the same bin, or a step map (isotonic recalibration outputs exactly 0.3) splits its rows
    by label between two bins. Bin means use the probabilities as they are.
    """
    q = np.asarray(q, dtype=float)
    return _bin_index_into(q, edges, np.empty(q.shape, np.intp), np.empty(q.shape))


# Where q * n_bins is at least _NEAR_EDGE from every integer, its floor is the bin: rounding q to 12 decimals moves
# q * n_bins by at most n_bins * 5.1e-13 and linspace's edges lie within a few ulps of k / n_bins, both far below
# _NEAR_EDGE up to _FLOOR_MAX_BINS bins. The other rows (on or near an edge, 0, 1: a few in a million for
# continuous probabilities) take the rounded form.
_NEAR_EDGE = 1e-6
_FLOOR_MAX_BINS = 100_000


def _bin_index_into(q: np.ndarray, edges: np.ndarray, b: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """:func:`bin_index` of a float64 ``q`` written into ``b`` (intp), with ``tmp`` (float64, shaped as ``q``) as
    scratch: buffers used again save the fresh allocations a call would otherwise fault in page by page."""
    n_bins = len(edges) - 1
    if n_bins > _FLOOR_MAX_BINS:
        b[...] = _rounded_bins(q, edges)
        return b
    np.multiply(q, n_bins, out=tmp)
    np.copyto(b, tmp, casting="unsafe")   # truncation toward zero, as astype(np.intp)
    np.minimum(b, n_bins - 1, out=b)
    np.subtract(tmp, b, out=tmp)   # in [0, 1) for q in [0, 1); 1 for q = 1; negative, larger or NaN for no probability
    far = tmp >= _NEAR_EDGE
    far &= tmp <= 1.0 - _NEAR_EDGE
    if not far.all():
        near = np.flatnonzero(~far)
        b[near] = _rounded_bins(q[near], edges)
    return b


def _rounded_bins(q: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The bins of ``np.digitize(np.round(q, 12), edges[1:-1])`` for any ``q``: the floor of the rounded q times
    n_bins, moved onto the bin the edges give."""
    n_bins = len(edges) - 1
    qr = np.round(q, 12)
    b = np.minimum((qr * n_bins).astype(np.intp), n_bins - 1)   # 1.0 in the last bin
    # q * n_bins and linspace's edges round differently, so the floor can be one bin off where q sits on (or within
    # rounding of) an edge: move it to the bin the edges themselves give (left-closed, as np.digitize).
    b -= qr < edges[b]
    b += qr >= np.append(edges[1:-1], np.inf)[b]
    return b


def _curve(edges: np.ndarray, b: np.ndarray, q: np.ndarray, wy: np.ndarray, w: np.ndarray) -> CalibrationCurve:
    """The curve of rows in bins ``b`` (``wy``: weight times label, which the three curves of a set share)."""
    n_bins = len(edges) - 1
    sw = np.bincount(b, weights=w, minlength=n_bins)
    swq = np.bincount(b, weights=w * q, minlength=n_bins)
    swy = np.bincount(b, weights=wy, minlength=n_bins)
    return _curve_of_sums(edges, sw, swq, swy)


def _curve_of_sums(edges: np.ndarray, sw: np.ndarray, swq: np.ndarray, swy: np.ndarray) -> CalibrationCurve:
    """The curve of per-bin sums of weight, weight times probability and weight times label."""
    n_bins = len(edges) - 1
    # A bin holding only zero-weight rows is empty: weight w must equal repeating the row w times.
    occ = sw > 0
    conf = np.full(n_bins, np.nan)
    acc = np.full(n_bins, np.nan)
    conf[occ] = swq[occ] / sw[occ]
    acc[occ] = swy[occ] / sw[occ]
    return CalibrationCurve(edges=edges, confidence=conf, accuracy=acc, weight=sw)


def symmetrise(
    p: np.ndarray, p_lo: np.ndarray, p_hi: np.ndarray, y: np.ndarray, w: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Append each pair's flip ``(1-p, 1-p_hi, 1-p_lo, 1-y)``; return ``(p, p_lo, p_hi, y, w)`` of length 2N."""
    return (
        np.concatenate([p, 1.0 - p]),
        np.concatenate([p_lo, 1.0 - p_hi]),
        np.concatenate([p_hi, 1.0 - p_lo]),
        np.concatenate([y, 1.0 - y]),
        np.concatenate([w, w]),
    )


def _validate_probabilities(p, p_lo, p_hi, y, weight) -> tuple[np.ndarray, ...]:
    arrays = {}
    for name, v in (("p", p), ("p_lo", p_lo), ("p_hi", p_hi), ("y", y)):
        a = np.asarray(v, dtype=float).reshape(-1)   # read only: no copy
        if not np.isfinite(a).all() or (a < 0).any() or (a > 1).any():
            raise UserError(f"{name} must hold finite values in [0, 1]")
        arrays[name] = a
    n = len(arrays["p"])
    if n == 0:
        raise UserError("no preference pairs: calibration metrics need at least one pair")
    lengths = {k: len(a) for k, a in arrays.items()}
    w = np.ones(n) if weight is None else np.asarray(weight, dtype=float).reshape(-1)
    lengths["weight"] = len(w)
    if len(set(lengths.values())) != 1:
        raise UserError(f"p, p_lo, p_hi, y and weight must have the same length, got {lengths}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise UserError("weight must hold finite values >= 0")
    if not w.sum() > 0:
        raise UserError("all weights are zero; at least one pair needs a positive weight")
    if (arrays["p_lo"] > arrays["p"] + _ORDER_TOL).any() or (arrays["p"] > arrays["p_hi"] + _ORDER_TOL).any():
        raise UserError("probability bounds must satisfy p_lo <= p <= p_hi")
    return arrays["p"], arrays["p_lo"], arrays["p_hi"], arrays["y"], w


def _curves(p, p_lo, p_hi, y, w, n_bins: int) -> dict[str, CalibrationCurve]:
    """The pred/lower/upper curves of the symmetrised set; ``y=None``: every label 1 (a predictions table)."""
    if y is None:
        return _preferred_curves(p, p_lo, p_hi, w, n_bins)
    q, q_lo, q_hi, ys, ws = symmetrise(p, p_lo, p_hi, y, w)
    edges, wy = np.linspace(0.0, 1.0, n_bins + 1), ws * ys
    return {key: _curve(edges, bin_index(x, edges), x, wy, ws)
            for key, x in (("pred", q), ("lower", q_lo), ("upper", q_hi))}


def _preferred_curves(p, p_lo, p_hi, w, n_bins: int) -> dict[str, CalibrationCurve]:
    """:func:`_curves` with every label 1, to the bit, without building the symmetrised set.

    Each per-bin sum adds the rows in the order of the symmetrised set (the pairs' rows, then the flipped rows), as
    ``np.bincount`` over it does: here ``np.add.at``, which adds in index order too, over chunks of ``_CHUNK`` rows
    taken in that order. The labels, 1 on the pairs' rows and 0 on the flipped ones, add exact zeros after the pairs'
    rows, so the label sums are those of the pairs' rows alone; these are the weight sums' partial sums too, which
    the flipped rows then continue.
    """
    n = len(p)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    size = min(n, _CHUNK)
    # The scratch of one chunk, used by every chunk of the three curves: it stays in the CPU cache, and it is
    # allocated once instead of arrays of 2N values per step (each faulted in page by page).
    x, tmp, b = np.empty(size), np.empty(size), np.empty(size, np.intp)
    curves = {}
    for key, rows, flipped in (("pred", p, p), ("lower", p_lo, p_hi), ("upper", p_hi, p_lo)):
        swq, swy = np.zeros(n_bins), np.zeros(n_bins)
        for flip in (False, True):
            sw = swy.copy() if flip else swy   # the pairs' rows add their weights to swy, the flipped rows to sw
            for i in range(0, n, size):
                k = min(size, n - i)
                q = np.subtract(1.0, flipped[i:i + k], out=x[:k]) if flip else rows[i:i + k]
                bins = _bin_index_into(q, edges, b[:k], tmp[:k])
                np.add.at(swq, bins, np.multiply(w[i:i + k], q, out=tmp[:k]))
                np.add.at(sw, bins, w[i:i + k])
        curves[key] = _curve_of_sums(edges, sw, swq, swy)
    return curves


def _calibration(p, p_lo, p_hi, y, w, n_bins: int) -> dict[str, float]:
    """Calibration metrics of validated probabilities; ``y=None``: every label 1 (a predictions table)."""
    curves = _curves(p, p_lo, p_hi, y, w, n_bins)
    elce = curves["lower"].lower_error()
    euce = curves["upper"].upper_error()
    # The flipped row has the same squared error, so this equals the plain Brier score.
    brier = weighted_sum(w, lambda rows, out: np.square(np.subtract(p[rows], 1.0 if y is None else y[rows], out=out),
                                                        out=out)) / float(w.sum())
    return {
        "ece": curves["pred"].ece(),
        "mce": curves["pred"].mce(),
        "elce": elce,
        "euce": euce,
        "ebce": 0.5 * (elce + euce),
        "brier": brier,
        "pref_bound_width": weighted_sum(w, lambda rows, out: np.subtract(p_hi[rows], p_lo[rows], out=out))
        / float(w.sum()),
    }


def calibration_metrics(p, p_lo, p_hi, y, weight=None, *, n_bins: int = 20) -> dict[str, float]:
    """Calibration metrics of preference probabilities ``p`` with bounds ``[p_lo, p_hi]`` and labels ``y``.

    ``y`` is 1 where the first response was preferred, 0 otherwise (soft labels in [0, 1] are accepted). The set is
    symmetrised internally, so passing the flipped pairs (``1-p``, ``1-p_hi``, ``1-p_lo``, ``1-y``) gives the same
    result. Keys:

    - ``ece`` (eq. 7) and ``mce`` on the predicted probabilities;
    - ``elce`` = sum_b share_b * max(conf_b - acc_b, 0) on lower-bound probabilities, ``euce`` =
      sum_b share_b * max(acc_b - conf_b, 0) on upper-bound probabilities (eq. 8);
    - ``ebce`` = (elce + euce) / 2, the paper's selection metric. Symmetrisation maps the lower-bound rows onto the
      mirrored upper-bound rows, so elce == euce == ebce except for points exactly on bin edges;
    - ``brier``: weighted mean of (p - y)^2;
    - ``pref_bound_width``: weighted mean of p_hi - p_lo.
    """
    n_bins = check_n_bins(n_bins)
    return _calibration(*_validate_probabilities(p, p_lo, p_hi, y, weight), n_bins)


def calibration_curves(predictions: pd.DataFrame, *, n_bins: int = 20) -> dict[str, CalibrationCurve]:
    """Reliability curves of a predictions table on the symmetrised set: keys ``pred``, ``lower``, ``upper``.

    ``curves["pred"].ece()`` is the table's ECE (eq. 7); ``curves["lower"].lower_error()`` its ELCE and
    ``curves["upper"].upper_error()`` its EUCE (eq. 8).
    """
    n_bins = check_n_bins(n_bins)
    pairs = table_columns(predictions)
    return _curves(*pairs.probabilities(), None, pairs.weight, n_bins)
