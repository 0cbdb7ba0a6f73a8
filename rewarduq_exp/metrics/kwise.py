"""K-wise scoring (RewardBench 2): one prompt, K completions, one or more of them correct.

A K-wise predictions table has one row per prompt: ``id``, ``subset``, ``weight``, list columns ``rewards``,
``lowers``, ``uppers`` (length K for that row; K may differ between rows), ``best`` (the index of the first correct
completion) and optionally ``num_correct`` (default 1, so tables without it keep working): completions
``best .. best + num_correct - 1`` are correct, the others incorrect. With several correct completions ``best`` must
be 0 (RewardBench 2's convention: the correct ones first, ``num_correct`` from the hub).

Scoring follows the official RewardBench 2 scorer (allenai/reward-bench, ``scripts/run_v2.py`` and
``rewardbench/utils.py``):

* a prompt with one correct completion scores ``1 / (number of completions whose reward equals the maximum)`` when
  the correct one has the maximum reward, else 0: a tie at the top with one other completion scores 1/2
  (``tie_rule="official"``). Our stricter variant (``tie_rule="strict"``) scores 1 only when the correct reward is
  strictly above every other one;
* a prompt with several correct completions is "accurate" when the worst correct reward is strictly above the best
  incorrect one (``_compute_prompt_stats``); that flag is its result under either tie rule;
* the subset named ``Ties`` (any case) has its own score: 0.30 accuracy on its "tied" prompts (several correct
  answers) + 0.30 accuracy on its "ref" prompts (the same question with one correct answer) + 0.20 the share of
  prompts whose correct-vs-incorrect margin (worst correct - best incorrect) on the tied prompt exceeds the spread
  of its correct answers (best - worst correct) + 0.20 the same with the smaller of the ref and tied margins + 0.01
  the mean of tanh(min margin / spread - 1), NaN (a division 0/0) counted as 0 (``process_single_model``). Its
  comparisons are strict under either tie rule, as in the official code. Prompts are paired by their ids,
  ``ref:<n>`` and ``tied:<n>``; the three margin terms use the numbers present as both, so a Ties subset without
  such a pair (e.g. a small random sample of RewardBench 2) has a NaN score, as the official scorer gives, and a
  NaN ``rb2_score``; a Ties row with another id is a user error;
* a subset's score is the mean of its prompts' results (the Ties formula for Ties), and the RewardBench 2 score
  (``rb2_score``) is the unweighted mean over the subsets, as the leaderboard averages its six subsets.

The RewardUQ metrics (paper eqs. 4-8) are pairwise, so they are computed on the pairs "each correct vs. each
incorrect completion" of every prompt.

The calibrated-label-ranking paper (appendix D) calibrates the same K scores as a ranking distribution: the pooled
(context, position) top-1 calibration of the Plackett-Luce probabilities ``softmax(rewards)``
(:func:`top1_calibration`), its pairwise (sub-2) counterpart (:func:`pairwise_calibration`) and, only to reproduce
the reference code's figures, :func:`chosen_only_ece` (at the end of this module).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.metrics.calibration import CalibrationCurve
from rewarduq_exp.metrics.preference import DEFAULT_ALPHAS, describe_rows, numeric_column, table_ids
from rewarduq_exp.metrics.ranking import bin_edges, bin_index
from rewarduq_exp.metrics.rewarduq import compute_metrics

log = logging.getLogger(__name__)

LIST_COLUMNS = ("rewards", "lowers", "uppers")
KWISE_COLUMNS = ("weight", *LIST_COLUMNS, "best")
TIE_RULES = ("official", "strict")
TIES_SUBSET = "ties"
# Weights of the official Ties score (rewardbench/utils.py, process_single_model).
TIES_WEIGHTS = {"tied_accuracy": 0.30, "ref_accuracy": 0.30, "correctness_preferred": 0.20,
                "correctness_preferred_hard": 0.20, "margin_score": 0.01}


def is_kwise(predictions: pd.DataFrame) -> bool:
    """True when the table is K-wise (has a ``rewards`` list column) rather than pairwise."""
    return "rewards" in predictions.columns


def check_tie_rule(tie_rule, key: str = "metric.kwise_tie_rule") -> str:
    if tie_rule not in TIE_RULES:
        raise UserError(f"{key}={tie_rule!r} is invalid: allowed values are {', '.join(TIE_RULES)}")
    return tie_rule


def _validated(predictions: pd.DataFrame):
    """(k, best, num_correct, weight, ids) per row after the structural checks; values are checked by
    compute_metrics."""
    missing = [c for c in KWISE_COLUMNS if c not in predictions.columns]
    if missing:
        raise UserError(f"K-wise predictions table is missing column(s) {', '.join(missing)}; "
                        f"required: {', '.join(KWISE_COLUMNS)} (optional: num_correct)")
    ids = table_ids(predictions)
    # pandas' .str.len() also measures lists/arrays; a non-list entry gives NaN.
    lengths = np.column_stack([predictions[c].str.len().to_numpy(dtype=float) for c in LIST_COLUMNS])
    k = lengths[:, 0]
    bad = ~np.isfinite(lengths).all(axis=1) | (lengths != k[:, None]).any(axis=1)
    if bad.any():
        raise UserError(f"rewards, lowers and uppers must be lists of the same length in {describe_rows(bad, ids)}")
    if (k < 2).any():
        raise UserError(f"a K-wise prompt needs at least 2 completions; fewer in {describe_rows(k < 2, ids)}")
    best = numeric_column(predictions, "best")
    bad = ~np.isfinite(best) | (best != np.round(best)) | (best < 0) | (best >= k)
    if bad.any():
        raise UserError(f"best must be an integer index into the completions (0 <= best < K) in "
                        f"{describe_rows(bad, ids)}")
    n_correct = numeric_column(predictions, "num_correct") if "num_correct" in predictions.columns \
        else np.ones(len(predictions))
    bad = ~np.isfinite(n_correct) | (n_correct != np.round(n_correct)) | (n_correct < 1)
    if bad.any():
        raise UserError(f"num_correct must be an integer >= 1 in {describe_rows(bad, ids)}")
    if (n_correct >= k).any():
        raise UserError(f"a K-wise prompt needs at least one incorrect completion (num_correct < K); not so in "
                        f"{describe_rows(n_correct >= k, ids)}")
    bad = (n_correct > 1) & (best != 0)
    if bad.any():
        raise UserError(f"with num_correct > 1 the correct completions must come first (best 0, correct ones "
                        f"0 .. num_correct-1, as RewardBench 2 stores them); best != 0 in {describe_rows(bad, ids)}")
    weight = numeric_column(predictions, "weight")
    row_ids = (predictions["id"].astype(str).to_numpy() if "id" in predictions.columns
               else np.arange(len(predictions)).astype(str))
    return k.astype(int), best.astype(int), n_correct.astype(int), weight, row_ids


def _groups(predictions: pd.DataFrame, k: np.ndarray, best: np.ndarray, n_correct: np.ndarray):
    """Per distinct K: (row positions, {column: (n, K) float array}, correct mask (n, K)); rows of equal K at once."""
    for kk in np.unique(k):
        pos = np.flatnonzero(k == kk)
        arrays = {c: np.array(predictions[c].iloc[pos].tolist(), dtype=float).reshape(len(pos), kk)
                  for c in LIST_COLUMNS}
        j = np.arange(kk)[None, :]
        correct = (j >= best[pos, None]) & (j < (best + n_correct)[pos, None])
        yield pos, arrays, correct


def kwise_to_pairs(predictions: pd.DataFrame) -> pd.DataFrame:
    """Expand each K-wise row into the pairs "correct completion i vs. incorrect completion j" (the pairwise
    predictions contract).

    With one correct completion these are the K-1 pairs "best vs. each other completion", with ids ``f"{id}/{j}"``;
    with several, the ids are ``f"{id}/{i}>{j}"``. Each pair gets ``weight / (n_correct * n_incorrect)``, so a prompt
    keeps its total weight whatever its K. Rows stay in prompt order, then by (i, j) within a prompt.
    """
    if len(predictions) == 0:
        raise UserError("no K-wise prompts: metrics need at least one prompt")
    k, best, n_correct, weight, ids = _validated(predictions)
    subsets = (predictions["subset"].astype(str).to_numpy() if "subset" in predictions.columns
               else np.full(len(predictions), ""))
    parts = []
    for pos, arr, correct in _groups(predictions, k, best, n_correct):
        # (n, K, K) mask of (correct i, incorrect j) pairs; nonzero() walks it in (row, i, j) order.
        pair = correct[:, :, None] & ~correct[:, None, :]
        row, i, j = np.nonzero(pair)
        n_pairs = pair.sum(axis=(1, 2))[row]
        rep = pos[row]
        part = {"_pos": rep, "_i": i, "_j": j, "subset": subsets[rep], "weight": weight[rep] / n_pairs}
        for col, name in zip(LIST_COLUMNS, ("reward", "lower", "upper")):
            part[f"chosen_{name}"] = arr[col][row, i]
        for col, name in zip(LIST_COLUMNS, ("reward", "lower", "upper")):
            part[f"rejected_{name}"] = arr[col][row, j]
        parts.append(pd.DataFrame(part))
    pairs = pd.concat(parts, ignore_index=True).sort_values(["_pos", "_i", "_j"], kind="stable", ignore_index=True)
    several = n_correct[pairs["_pos"].to_numpy()] > 1
    suffix = np.where(several, pairs["_i"].astype(str) + ">" + pairs["_j"].astype(str), pairs["_j"].astype(str))
    pairs.insert(0, "id", pd.Series(ids[pairs["_pos"].to_numpy()]) + "/" + suffix)
    return pairs.drop(columns=["_pos", "_i", "_j"])


def prompt_statistics(predictions: pd.DataFrame, tie_rule: str = "official") -> pd.DataFrame:
    """Per prompt: ``result`` (its best-of-K score under ``tie_rule``), ``accurate`` (worst correct > best incorrect),
    ``correct_incorrect_margin`` (worst correct - best incorrect) and ``correct_spread`` (best - worst correct; NaN
    with one correct completion), in table order."""
    check_tie_rule(tie_rule, "tie_rule")
    k, best, n_correct, _, _ = _validated(predictions)
    n = len(predictions)
    out = {name: np.full(n, np.nan) for name in ("result", "accurate", "correct_incorrect_margin", "correct_spread")}
    for pos, arr, correct in _groups(predictions, k, best, n_correct):
        r = arr["rewards"]
        worst_correct = np.where(correct, r, np.inf).min(axis=1)
        best_correct = np.where(correct, r, -np.inf).max(axis=1)
        best_incorrect = np.where(~correct, r, -np.inf).max(axis=1)
        margin = worst_correct - best_incorrect
        accurate = margin > 0
        top = r.max(axis=1)
        r_best = r[np.arange(len(pos)), best[pos]]
        if tie_rule == "official":  # 1 / number of completions tied at the maximum, if the correct one is among them
            single = np.where(r_best == top, 1.0 / (r == top[:, None]).sum(axis=1), 0.0)
        else:
            single = accurate.astype(float)  # strictly above every other completion
        several = n_correct[pos] > 1
        out["result"][pos] = np.where(several, accurate.astype(float), single)
        out["accurate"][pos] = accurate
        out["correct_incorrect_margin"][pos] = margin
        out["correct_spread"][pos] = np.where(several, best_correct - worst_correct, np.nan)
    return pd.DataFrame(out, index=predictions.index)


def ties_score(ids, stats: pd.DataFrame, weight: np.ndarray) -> dict:
    """The official RewardBench 2 score of the Ties subset from its prompts' statistics (module docstring).

    ``ids`` are ``ref:<n>`` / ``tied:<n>``; the accuracies are weighted means over the ref and over the tied prompts,
    the margin terms weighted means over the prompt numbers present as both (weight: the tied prompt's).
    """
    kinds, numbers = [], []
    for i in ids:
        kind, _, number = str(i).partition(":")
        if kind not in ("ref", "tied") or not number:
            raise UserError(f"the Ties subset scores 'ref:<n>' and 'tied:<n>' prompts (RewardBench 2's ids); got id "
                            f"{str(i)!r}: name Ties rows so, or give that subset another name")
        kinds.append(kind)
        numbers.append(number)
    frame = stats.assign(kind=kinds, number=numbers, weight=weight)

    def mean(values, w):
        return float(np.dot(values, w) / w.sum()) if len(values) and w.sum() > 0 else float("nan")

    ref, tied = frame[frame.kind == "ref"], frame[frame.kind == "tied"]
    both = tied.merge(ref, on="number", suffixes=("", "_ref"))
    spread = both["correct_spread"].to_numpy()
    margin_tied = both["correct_incorrect_margin"].to_numpy()
    margin_hard = np.minimum(both["correct_incorrect_margin_ref"].to_numpy(), margin_tied)
    with np.errstate(divide="ignore", invalid="ignore"):
        tanh = np.nan_to_num(np.tanh(margin_hard / spread - 1), nan=0.0)
    w = both["weight"].to_numpy()
    parts = {
        "tied_accuracy": mean(tied["accurate"].to_numpy(), tied["weight"].to_numpy()),
        "ref_accuracy": mean(ref["accurate"].to_numpy(), ref["weight"].to_numpy()),
        "correctness_preferred": mean(margin_tied > spread, w),   # a NaN spread compares False, as in the scorer
        "correctness_preferred_hard": mean(margin_hard > spread, w),
        "margin_score": mean(tanh, w),
    }
    if len(both) == 0:
        log.warning("Ties subset: no prompt number has both a 'ref:<n>' and a 'tied:<n>' prompt (a sample of "
                    "RewardBench 2?); its margin terms, its score and rb2_score are NaN")
    parts["score"] = float(sum(TIES_WEIGHTS[k] * v for k, v in parts.items()))
    return parts


def kwise_metrics(
    predictions: pd.DataFrame, *, n_bins: int = 20, alphas: Iterable[float] = DEFAULT_ALPHAS,
    tie_rule: str = "official",
) -> dict:
    """RewardBench 2 scores plus the pairwise RewardUQ metrics of the expanded pairs.

    Keys: ``best_of_k_accuracy`` (weighted mean over prompts of their result under ``tie_rule``),
    ``subset/<s>/best_of_k_accuracy``, ``subset/<s>/score`` (the Ties formula for a Ties subset, whose parts are
    ``subset/<s>/<part>``; the best-of-K accuracy otherwise), ``rb2_score`` (unweighted mean of the subset scores: the
    RewardBench 2 leaderboard score), every :func:`compute_metrics` key of :func:`kwise_to_pairs` under its plain name
    (win rate eq. 4 ... EBCE eq. 8), ``n_pairs`` (expanded pairs), ``n_prompts`` (rows) and ``weight_sum``.
    """
    tie_rule = check_tie_rule(tie_rule, "tie_rule")
    # The pairwise metrics validate weights, values and bounds with one-line errors, so they run first.
    pair_metrics = compute_metrics(kwise_to_pairs(predictions), n_bins=n_bins, alphas=alphas)
    _, _, _, weight, ids = _validated(predictions)
    stats = prompt_statistics(predictions, tie_rule)
    result = stats["result"].to_numpy()
    subsets = (predictions["subset"].astype(str).to_numpy() if "subset" in predictions.columns
               else np.full(len(predictions), ""))

    out: dict = {"best_of_k_accuracy": float(np.dot(weight, result) / weight.sum())}
    per_subset: dict[str, dict] = {}
    for s in np.unique(subsets):
        rows = subsets == s
        if not weight[rows].sum() > 0:
            continue
        block = {"best_of_k_accuracy": float(np.dot(weight[rows], result[rows]) / weight[rows].sum())}
        if s.lower() == TIES_SUBSET:
            parts = ties_score(ids[rows], stats[rows], weight[rows])
            block.update(parts)
        else:
            block["score"] = block["best_of_k_accuracy"]
        per_subset[s] = block
    out["rb2_score"] = float(np.mean([b["score"] for b in per_subset.values()]))
    out.update(pair_metrics)
    out["weight_sum"] = float(weight.sum())  # the prompts' total; the split pair weights only add up to it in floats
    out["n_prompts"] = len(predictions)
    for s, block in per_subset.items():
        out.update({f"subset/{s}/{k}": v for k, v in block.items()})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Appendix D of the label-ranking paper: calibration of a reward model's K-wise scores
# ---------------------------------------------------------------------------------------------------------------


def padded_rewards(rewards) -> np.ndarray:
    """Rewards as a float (n, K_max) array, NaN after each row's own K responses.

    Accepts a 2-D array (NaN padding allowed at the end of a row) or a sequence of 1-D arrays of varying length
    (e.g. RewardBench 2's Ties prompts have more responses; the paper excludes Ties, which is left to the caller).
    """
    if isinstance(rewards, np.ndarray) and rewards.ndim == 2:
        out = rewards.astype(np.float64)
    else:
        rows = [np.asarray(r, dtype=np.float64).reshape(-1) for r in rewards]
        if not rows:
            raise UserError("rewards: no contexts")
        out = np.full((len(rows), max(len(r) for r in rows)), np.nan)
        for s, row in enumerate(rows):
            out[s, : len(row)] = row
    if out.ndim != 2 or out.shape[0] == 0:
        raise UserError(f"rewards must be (n, K) or a list of per-context arrays, got shape {out.shape}")
    valid = ~np.isnan(out)
    k = valid.sum(axis=1)
    if (valid != (np.arange(out.shape[1]) < k[:, None])).any():
        raise UserError("rewards: NaN padding must come after a row's responses (no NaN between rewards)")
    if (k < 2).any():
        raise UserError(f"rewards: every context needs at least 2 responses; row {int(np.argmax(k < 2))} has "
                        f"{int(k[np.argmax(k < 2)])}")
    if np.isinf(out).any():
        raise UserError("rewards must be finite")
    return out


def _best(best_index, rewards: np.ndarray) -> np.ndarray:
    b = np.asarray(best_index)
    if b.shape != (len(rewards),) or not np.issubdtype(b.dtype, np.integer):
        raise UserError(f"best_index must be {len(rewards)} integers (one per context), got shape {b.shape}")
    k = (~np.isnan(rewards)).sum(axis=1)
    if (b < 0).any() or (b >= k).any():
        raise UserError("best_index: each index must point at one of its context's responses (0-based)")
    return b.astype(np.int64)


def plackett_luce_top1(rewards) -> np.ndarray:
    """Top-1 probabilities of the Plackett-Luce model with utilities = rewards: a softmax per row (max subtracted),
    NaN at padded positions."""
    r = padded_rewards(rewards)
    z = np.exp(r - np.nanmax(r, axis=1, keepdims=True))
    return z / np.nansum(z, axis=1, keepdims=True)


@dataclass(frozen=True, eq=False)
class KwiseCalibration:
    """Pooled calibration of reward-model probabilities: ``ece`` and the reliability ``curve`` (bin confidence,
    accuracy and count in ``curve.weight``), ready for :func:`rewarduq_exp.metrics.diagrams.draw_reliability`."""

    ece: float
    curve: CalibrationCurve
    n_contexts: int
    n_predictions: int


def _pooled(q: np.ndarray, y: np.ndarray, n_contexts: int, n_bins: int) -> KwiseCalibration:
    """Equal-width binning of pooled predictions (the bins of :func:`binary_ece`) into a reliability curve."""
    edges = bin_edges(n_bins)
    b = bin_index(q, edges)
    count = np.bincount(b, minlength=len(edges) - 1).astype(np.float64)
    occ = count > 0
    conf = np.full(len(count), np.nan)
    acc = np.full(len(count), np.nan)
    conf[occ] = np.bincount(b, weights=q, minlength=len(count))[occ] / count[occ]
    acc[occ] = np.bincount(b, weights=y, minlength=len(count))[occ] / count[occ]
    curve = CalibrationCurve(edges=edges, confidence=conf, accuracy=acc, weight=count)
    return KwiseCalibration(ece=curve.ece(), curve=curve, n_contexts=n_contexts, n_predictions=len(q))


def top1_calibration(rewards, best_index, n_bins: int = 10) -> KwiseCalibration:
    """Appendix D's top-1 calibration of a reward model on K-wise data.

    For each context the Plackett-Luce top-1 probability softmax(r)_t of every response position t, with label 1 at
    the correct position (``best_index``) and 0 elsewhere; all (context, position) predictions pooled, binned into
    ``n_bins`` equal-width bins (left-closed, 1.0 in the last) and ECE = sum_b (n_b / N) |accuracy_b - confidence_b|.
    This is rank-wise top-1 calibration (Definition 7, k = 1) pooled over positions, the only top-k event that is
    observed when just the correct response is known. Invariant to adding a constant to a context's rewards.
    """
    r = padded_rewards(rewards)
    b = _best(best_index, r)
    q = plackett_luce_top1(r)
    y = np.zeros_like(q)
    y[np.arange(len(r)), b] = 1.0
    valid = ~np.isnan(q)
    return _pooled(q[valid], y[valid], len(r), n_bins)


def pairwise_calibration(rewards, best_index, n_bins: int = 10) -> KwiseCalibration:
    """Sub-2 (pairwise) calibration of the Plackett-Luce model induced by the rewards, on the pairs that are
    observed when only the correct response is known: for each other response j, the events (correct > j) with
    P = sigmoid(r_correct - r_j) (the PL pairwise marginal, w_c / (w_c + w_j)) and label 1, and (j > correct) with
    P = sigmoid(r_j - r_correct) and label 0; pooled and binned as in :func:`top1_calibration`. Pairs between two
    incorrect responses are not observed and not used."""
    r = padded_rewards(rewards)
    b = _best(best_index, r)
    diff = r[np.arange(len(r)), b][:, None] - r  # r_correct - r_j
    other = ~np.isnan(r)
    other[np.arange(len(r)), b] = False
    d = diff[other]
    q_win = 0.5 * (1.0 + np.tanh(0.5 * d))  # sigmoid without overflow
    q = np.concatenate([q_win, 1.0 - q_win])
    y = np.concatenate([np.ones_like(d), np.zeros_like(d)])
    return _pooled(q, y, len(r), n_bins)


def chosen_only_ece(rewards, best_index=None) -> float:
    """The reference code's RewardBench 2 "ECE", for reproducing its figures only: 1 - mean over contexts of the
    top-1 probability of the correct response (``best_index``; the reference's index 0 when None).

    **Not the paper's definition** (appendix D pools all (context, position) predictions, :func:`top1_calibration`):
    the reference bins only the correct response's probability with every label 1, so bins play no role and the
    number is exactly 1 - mean p_chosen; rejected responses never enter as label-0 events.
    """
    r = padded_rewards(rewards)
    b = np.zeros(len(r), dtype=np.int64) if best_index is None else _best(best_index, r)
    return float(1.0 - plackett_luce_top1(r)[np.arange(len(r)), b].mean())
