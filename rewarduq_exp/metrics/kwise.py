"""K-wise scoring (RewardBench 2 style): one prompt, K completions, one of them the correct ("best") one.

A K-wise predictions table has one row per prompt: ``id``, ``subset``, ``weight``, list columns ``rewards``,
``lowers``, ``uppers`` (length K for that row; K may differ between rows) and ``best``, the index of the correct
completion in those lists. RewardBench 2 counts a prompt as solved when the best completion's reward is strictly
above every other reward. The RewardUQ metrics (paper eqs. 4-8) are pairwise, so they are computed on the K-1
pairs "best vs. each other completion" of every prompt.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from rewarduq_exp.errors import UserError
from rewarduq_exp.metrics import compute_metrics
from rewarduq_exp.metrics.preference import DEFAULT_ALPHAS, describe_rows, numeric_column, table_ids

LIST_COLUMNS = ("rewards", "lowers", "uppers")
KWISE_COLUMNS = ("weight", *LIST_COLUMNS, "best")


def is_kwise(predictions: pd.DataFrame) -> bool:
    """True when the table is K-wise (has a ``rewards`` list column) rather than pairwise."""
    return "rewards" in predictions.columns


def _validated(predictions: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (k, best, weight, ids) per row after the structural checks; values are checked by compute_metrics."""
    missing = [c for c in KWISE_COLUMNS if c not in predictions.columns]
    if missing:
        raise UserError(f"K-wise predictions table is missing column(s) {', '.join(missing)}; "
                        f"required: {', '.join(KWISE_COLUMNS)}")
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
    weight = numeric_column(predictions, "weight")
    row_ids = (predictions["id"].astype(str).to_numpy() if "id" in predictions.columns
               else np.arange(len(predictions)).astype(str))
    return k.astype(int), best.astype(int), weight, row_ids


def _groups(predictions: pd.DataFrame, k: np.ndarray):
    """Per distinct K: (row positions, {column: (n, K) float array}); rows of equal K are stacked at once."""
    for kk in np.unique(k):
        pos = np.flatnonzero(k == kk)
        arrays = {c: np.array(predictions[c].iloc[pos].tolist(), dtype=float).reshape(len(pos), kk)
                  for c in LIST_COLUMNS}
        yield pos, arrays


def kwise_to_pairs(predictions: pd.DataFrame) -> pd.DataFrame:
    """Expand each K-wise row into K-1 pairwise rows "best vs. completion j" (the pairwise predictions contract).

    Pair ids are ``f"{id}/{j}"`` with ``j`` the other completion's index; each pair gets ``weight / (K-1)`` so a
    prompt keeps its total weight whatever its K. Rows stay in prompt order, and by ``j`` within a prompt.
    """
    if len(predictions) == 0:
        raise UserError("no K-wise prompts: metrics need at least one prompt")
    k, best, weight, ids = _validated(predictions)
    subsets = (predictions["subset"].astype(str).to_numpy() if "subset" in predictions.columns
               else np.full(len(predictions), ""))
    parts = []
    for pos, arr in _groups(predictions, k):
        n, kk = arr["rewards"].shape
        b = best[pos]
        other = np.arange(kk)[None, :] != b[:, None]  # (n, K): exactly K-1 True per row
        j = np.broadcast_to(np.arange(kk), (n, kk))[other]
        rep = np.repeat(pos, kk - 1)
        part = {"_pos": rep, "_j": j, "subset": subsets[rep], "weight": np.repeat(weight[pos] / (kk - 1), kk - 1)}
        for col, name in zip(LIST_COLUMNS, ("reward", "lower", "upper")):
            part[f"chosen_{name}"] = np.repeat(arr[col][np.arange(n), b], kk - 1)
        for col, name in zip(LIST_COLUMNS, ("reward", "lower", "upper")):
            part[f"rejected_{name}"] = arr[col][other]
        parts.append(pd.DataFrame(part))
    pairs = pd.concat(parts, ignore_index=True).sort_values(["_pos", "_j"], kind="stable", ignore_index=True)
    pairs.insert(0, "id", pd.Series(ids[pairs["_pos"].to_numpy()]) + "/" + pairs["_j"].astype(str))
    return pairs.drop(columns=["_pos", "_j"])


def kwise_metrics(
    predictions: pd.DataFrame, *, n_bins: int = 20, alphas: Iterable[float] = DEFAULT_ALPHAS
) -> dict:
    """Best-of-K accuracy (RewardBench 2) plus the pairwise RewardUQ metrics of the expanded pairs.

    Keys: ``best_of_k_accuracy`` (weighted share of prompts whose best completion's reward is strictly above all
    others; a tie with another completion counts as wrong), ``subset/<subset>/best_of_k_accuracy``,
    ``best_of_k_accuracy_subset_mean`` (unweighted mean over subsets, as the RewardBench 2 leaderboard averages
    subsets equally), every :func:`compute_metrics` key of :func:`kwise_to_pairs` under its plain name (win rate
    eq. 4 ... EBCE eq. 8), ``n_pairs`` (expanded pairs) and ``n_prompts`` (rows).
    """
    # The pairwise metrics validate weights, values and bounds with one-line errors, so they run first.
    pair_metrics = compute_metrics(kwise_to_pairs(predictions), n_bins=n_bins, alphas=alphas)
    k, best, weight, _ = _validated(predictions)
    correct = np.zeros(len(predictions), dtype=bool)
    for pos, arr in _groups(predictions, k):
        r = arr["rewards"]
        b = best[pos]
        best_r = r[np.arange(len(pos)), b]
        others = np.where(np.arange(r.shape[1])[None, :] == b[:, None], -np.inf, r)
        correct[pos] = best_r > others.max(axis=1)

    subsets = (predictions["subset"].astype(str).to_numpy() if "subset" in predictions.columns
               else np.full(len(predictions), ""))
    names, codes = np.unique(subsets, return_inverse=True)
    size = np.bincount(codes, weights=weight, minlength=len(names))
    hits = np.bincount(codes, weights=weight * correct, minlength=len(names))
    per_subset = {s: float(h / t) for s, h, t in zip(names, hits, size) if t > 0}

    out: dict = {
        "best_of_k_accuracy": float(np.dot(weight, correct) / weight.sum()),
        "best_of_k_accuracy_subset_mean": float(np.mean(list(per_subset.values()))),
    }
    out.update(pair_metrics)
    out["weight_sum"] = float(weight.sum())  # the prompts' total; the split pair weights only add up to it in floats
    out["n_prompts"] = len(predictions)
    out.update({f"subset/{s}/best_of_k_accuracy": v for s, v in per_subset.items()})
    return out
