"""A fair use of a run's uncertainty in best-of-n, against the simplest rivals a practitioner would try.

``r - k u`` with a fixed k means something different per method (BAY-LIN's u is hundreds of reward units wide and
nearly constant, an ensemble's a fraction of one), and a k chosen on the prompts it is reported on flatters it. Here:

- **a comparable unit**: u is rescaled to the spread of the run's own reward over the candidates of the split,
  ``u_std = u * sd(r) / sd(u)``, so ``r - k u_std`` ranks as ``z(r) - k z(u)`` does: k = 1 weighs the standardised
  uncertainty as much as the standardised reward, for every method. It uses no gold;
- **k chosen on held-out prompts**: the prompts of a split are cut once (``task.seed``) into a selection share and a
  report share; k is the value of ``task.k_grid`` (0 included: "do not use u") whose conservative curve has the
  highest mean gold over the KL range on the selection prompts, and everything reported comes from the other prompts;
- **two rivals**, chosen the same way where they have a k:
  - ``knn``: a distance to the training data in the backbone's feature space that needs no knowledge of the shortcut
    (the mean Euclidean distance to the ``task.knn`` nearest training completions, features standardised by the
    training set's mean and sd) used as u; for methods that keep frozen features (ENS-MLP, BAY-LIN);
  - ``filter``: oracle knowledge, an upper reference: candidates beyond the training range of a known shortcut
    feature (more fillers, or more words, than any training completion) are ranked below every other candidate.
"""

from __future__ import annotations

import numpy as np

from rewarduq_exp.downstream.best_of_n import area_weights, expected_best_of_n

# Comparisons reported on the report prompts: (rule, baseline) pairs, each a paired difference per prompt.
COMPARISONS = (("model", "mean"), ("knn", "mean"), ("filter", "mean"), ("model", "knn"), ("model", "filter"))


def standardised_u(reward: np.ndarray, u: np.ndarray) -> np.ndarray:
    """u in units of the reward's spread over these candidates (zero where u does not vary at all)."""
    sd_u = float(np.std(u))
    return np.zeros_like(u, dtype=np.float64) if sd_u == 0 else np.asarray(u, np.float64) * float(np.std(reward)) / sd_u


def prompt_split(n_prompts: int, select_share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the selection prompts and of the report prompts (each at least one; sorted)."""
    if n_prompts < 2:
        raise ValueError("choosing k on held-out prompts needs at least 2 prompts (task.prompts)")
    order = np.random.default_rng([int(seed), 4242]).permutation(n_prompts)
    cut = min(max(int(round(select_share * n_prompts)), 1), n_prompts - 1)
    return np.sort(order[:cut]), np.sort(order[cut:])


def choose_k(reward, u_std, gold, prompts, ns, weights, grid) -> tuple[float, np.ndarray]:
    """The k of ``grid`` whose ``r - k u_std`` curve has the highest mean gold over KL on ``prompts`` (the smallest
    such k on a tie: u earns its weight), and every k's criterion value."""
    scores = np.array([float(expected_best_of_n(reward[prompts] - k * u_std[prompts], gold[prompts], ns).mean(0)
                             @ weights) for k in grid])
    best = int(np.flatnonzero(scores >= scores.max() - 1e-12)[0])
    return float(grid[best]), scores


def knn_distance(train: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """Mean Euclidean distance of each candidate feature row to its ``k`` nearest training rows, every dimension
    standardised by the training set (a hidden state's few huge dimensions would otherwise decide alone)."""
    from sklearn.neighbors import NearestNeighbors

    mean, sd = train.mean(0), train.std(0)
    sd = np.where(sd > 0, sd, 1.0)
    index = NearestNeighbors(n_neighbors=min(int(k), len(train))).fit((train - mean) / sd)
    distances, _ = index.kneighbors((candidates - mean) / sd)
    return distances.mean(1)


def use_curves(reward, u, gold, beyond, ns, kl, grid, select_share: float, seed: int, knn_u=None) -> dict:
    """Per-prompt gold of the pick on the report prompts, (P_report, J) per rule: ``mean``, ``model`` (r - k u_std,
    k chosen on the selection prompts), ``knn`` (the same with the k-NN distance as u; absent without features),
    ``filter`` (candidates ``beyond`` the training range last; absent when none is beyond anywhere) and ``oracle``;
    plus ``k_model`` / ``k_knn`` and the report prompts' indices."""
    reward, gold = np.asarray(reward, np.float64), np.asarray(gold, np.float64)
    weights = area_weights(kl)
    select, report = prompt_split(reward.shape[0], select_share, seed)
    out = {"report_prompts": report, "mean": expected_best_of_n(reward[report], gold[report], ns),
           "oracle": expected_best_of_n(gold[report], gold[report], ns)}
    sources = {"model": u, "knn": knn_u}
    for name, source in sources.items():
        if source is None:
            continue
        u_std = standardised_u(reward, source)
        k, _ = choose_k(reward, u_std, gold, select, ns, weights, grid)
        out[f"k_{name}"] = k
        out[name] = expected_best_of_n(reward[report] - k * u_std[report], gold[report], ns)
    if beyond is not None and np.asarray(beyond).any():
        # below every candidate inside the range, in the proxy's own order among themselves
        span = float(np.ptp(reward)) + 1.0
        filtered = reward - np.asarray(beyond, np.float64) * (span + np.abs(reward).max())
        out["filter"] = expected_best_of_n(filtered[report], gold[report], ns)
    return out
