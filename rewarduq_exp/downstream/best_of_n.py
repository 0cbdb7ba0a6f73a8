"""Best-of-n overoptimization against the true reward (Gao et al. 2023, "Scaling laws for reward model
overoptimization", best-of-n part): does the proxy's pick get better or worse in gold reward as n grows, and does
ranking by a conservative reward ``r - k u`` keep it from getting worse?

For each prompt, ``n_max`` candidates are drawn once from the run's world and scored once: from the synthetic world's
generator (gold: its true reward), or, for a run trained on VADER (``dataset=vader_pairs``, BoRP's
``vader_ratings``), real held-out sentences (gold: the crowd's mean rating; :mod:`~rewarduq_exp.downstream.vader_gold`).
The gold reward of "sample n, keep the proxy's best" is then computed for every n <= n_max at once with the unbiased
estimator of Nakano et al. (2021, WebGPT appendix; the one Gao et al. use): with the candidates sorted by proxy
score, the i-th smallest (1-based) is the best of a uniformly random n-subset with probability
C(i-1, n-1) / C(n_max, n). One matrix product per selection rule, instead of drawing and scoring fresh candidates
for every n (which costs sum(n) = 2 n_max scored candidates and gives noisier curves).

KL(best-of-n || base) = log n - (n - 1) / n (Stiennon et al. 2020), the x axis of Gao et al.'s figures.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.special import gammaln

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.downstream.statistics import largest_drop

SELECTIONS = ("mean", "conservative", "optimistic")
ORACLE = "oracle"  # pick by the gold reward itself: the ceiling no reward model can beat


def kl_best_of_n(n) -> np.ndarray:
    """KL divergence of the best-of-n distribution from the base distribution, log n - (n - 1) / n."""
    n = np.asarray(n, dtype=np.float64)
    return np.log(n) - (n - 1) / n


def area_weights(kl: np.ndarray) -> np.ndarray:
    """Weights w with curve @ w = the curve's mean over the KL range (trapezoid rule / span; the first point when the
    range is empty)."""
    kl = np.asarray(kl, dtype=np.float64)
    w = np.zeros_like(kl)
    if kl.size < 2 or kl[-1] == kl[0]:
        w[0] = 1.0
        return w
    steps = np.diff(kl)
    w[:-1] += steps / 2
    w[1:] += steps / 2
    return w / (kl[-1] - kl[0])


def powers_of_two(n_max: int) -> list[int]:
    """1, 2, 4, ..., up to n_max (n_max itself included when it is not a power of two)."""
    if isinstance(n_max, bool) or not isinstance(n_max, (int, np.integer)) or n_max < 1:
        raise UserError(f"task.n_max={n_max!r} is invalid: must be an integer >= 1")
    ns = [2 ** i for i in range(int(np.log2(n_max)) + 1)]
    return ns if ns[-1] == n_max else [*ns, int(n_max)]


def selection_weights(n_candidates: int, ns) -> np.ndarray:
    """(len(ns), n_candidates): row j gives, for the candidates sorted by proxy score (ascending), the probability
    that each one is the best of a uniformly random subset of size ns[j]: C(i-1, n-1) / C(M, n), i = 1..M."""
    m = int(n_candidates)
    ns = np.asarray(ns, dtype=np.int64)
    if (ns < 1).any() or (ns > m).any():
        raise UserError(f"best-of-n sizes {ns.tolist()} must lie in 1..{m} (the candidates drawn per prompt)")
    i = np.arange(1, m + 1)[None, :]
    n = ns[:, None]
    valid = i >= n
    # log C(i-1, n-1) - log C(m, n), in log space: C(1023, 511) overflows a float64.
    log_w = (gammaln(i) - gammaln(n) - gammaln(np.maximum(i - n, 0) + 1)
             - (gammaln(m + 1) - gammaln(n + 1) - gammaln(m - n + 1)))
    return np.where(valid, np.exp(np.where(valid, log_w, 0.0)), 0.0)


def expected_best_of_n(proxy: np.ndarray, values: np.ndarray, ns) -> np.ndarray:
    """(P, len(ns)): for each prompt (row) the expected ``values`` of the proxy's best of n candidates drawn without
    replacement from the row's M candidates, for every n in ``ns``. Ties in the proxy are broken by position."""
    proxy, values = np.asarray(proxy, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if proxy.shape != values.shape or proxy.ndim != 2:
        raise UserError(f"proxy {proxy.shape} and values {values.shape} must both be (prompts, candidates)")
    if not np.isfinite(proxy).all():
        raise UserError("the proxy scores contain NaN or inf; the reward model produced invalid scores")
    order = np.argsort(proxy, axis=1, kind="stable")
    return np.take_along_axis(values, order, axis=1) @ selection_weights(proxy.shape[1], ns).T


def selection_scores(reward: np.ndarray, u: np.ndarray, ks) -> dict[tuple[str, float], np.ndarray]:
    """The proxy each selection rule ranks by: ``reward`` (mean), ``reward - k u`` (conservative) and
    ``reward + k u`` (optimistic) for every k in ``ks``; k is in units of u (k = beta gives the bounds)."""
    out = {("mean", 0.0): reward}
    for k in ks:
        out[("conservative", float(k))] = reward - k * u
        out[("optimistic", float(k))] = reward + k * u
    return out


def picked_per_prompt(reward: np.ndarray, u: np.ndarray, gold: np.ndarray, ks, ns) -> dict:
    """Per prompt, the expected gold and proxy reward of the best-of-n pick under every selection rule and the
    oracle: ``{(selection, k): (gold (P, J), reward (P, J))}``, J = len(ns). What the curves average over prompts,
    kept per prompt for the paired intervals (:mod:`.statistics`)."""
    proxies = {**selection_scores(reward, u, ks), (ORACLE, 0.0): gold}
    return {key: (expected_best_of_n(proxy, gold, ns), expected_best_of_n(proxy, reward, ns))
            for key, proxy in proxies.items()}


def curves_frame(per_prompt: dict, ns) -> pd.DataFrame:
    """The curves of :func:`picked_per_prompt`'s rules, averaged over prompts. Columns: selection, k, n, kl, gold
    (mean over prompts), gold_se (the standard error of that level over prompts: not the yardstick of a
    difference between rules or n, which is paired), reward (the mean proxy reward of the pick)."""
    rows = []
    for (selection, k), (picked_gold, picked_reward) in per_prompt.items():
        prompts = len(picked_gold)
        se = picked_gold.std(0, ddof=1) / np.sqrt(prompts) if prompts > 1 else np.full(len(ns), np.nan)
        for j, n in enumerate(ns):
            rows.append({"selection": selection, "k": k, "n": int(n), "kl": float(kl_best_of_n(n)),
                         "gold": float(picked_gold[:, j].mean()), "gold_se": float(se[j]),
                         "reward": float(picked_reward[:, j].mean())})
    return pd.DataFrame(rows)


def best_of_n_curves(reward: np.ndarray, u: np.ndarray, gold: np.ndarray, ks, ns) -> pd.DataFrame:
    """Gold reward of the best-of-n pick vs n for every selection rule, plus the oracle (pick by gold).

    ``reward``, ``u``, ``gold``: (P, M) per prompt and candidate; the columns of :func:`curves_frame`."""
    return curves_frame(picked_per_prompt(reward, u, gold, ks, ns), ns)


def curve_summary(curves: pd.DataFrame, k_compare: float) -> dict[str, float]:
    """Point values of one run's curves on one split (their intervals: :mod:`.overoptimization`).

    - ``gold_n1``: gold reward at n = 1 (the base policy); ``gold_nmax``: at the largest n, mean selection;
    - ``best_n`` / ``gold_best``: the n where the mean-selection curve peaks and its gold reward;
    - ``overopt_gap`` = gold_best - gold_nmax (>= 0; 0 when the curve still rises at n_max);
    - ``largest_drop``: the largest fall of the mean-selection curve from any n to a larger one, from
      ``drop_from_n`` to ``drop_to_n`` (0 when it never falls). Unlike a fall measured from the curve's highest
      point, it sees a curve that dips and then climbs above its early peak;
    - ``conservative_gain``: area between the conservative (k = ``k_compare``) and mean curves over KL, divided by
      the KL range (the average gold gained by penalising uncertainty; < 0: it hurts);
      ``optimistic_gain`` likewise for r + k u; ``conservative_gain_nmax``: the difference at n_max;
    - ``oracle_nmax``: gold of the true best of n_max (the ceiling).
    """
    def curve(selection: str, k: float) -> pd.DataFrame:
        c = curves[(curves.selection == selection) & np.isclose(curves.k, k)].sort_values("n")
        if c.empty:
            raise UserError(f"no {selection} curve with k={k}; task.k_compare must be one of task.ks")
        return c

    mean, cons, opt, oracle = (curve("mean", 0.0), curve("conservative", k_compare),
                               curve("optimistic", k_compare), curve(ORACLE, 0.0))
    weights = area_weights(mean.kl.to_numpy())
    gold = mean.gold.to_numpy()
    best = int(gold.argmax())
    drop, drop_from, drop_to = largest_drop(gold)
    return {
        "gold_n1": float(gold[0]),
        "gold_nmax": float(gold[-1]),
        "best_n": int(mean.n.iloc[best]),
        "gold_best": float(gold[best]),
        "overopt_gap": float(gold[best] - gold[-1]),
        "largest_drop": drop,
        "drop_from_n": int(mean.n.iloc[drop_from]),
        "drop_to_n": int(mean.n.iloc[drop_to]),
        "conservative_gain": float((cons.gold.to_numpy() - gold) @ weights),
        "conservative_gain_nmax": float(cons.gold.iloc[-1] - mean.gold.iloc[-1]),
        "optimistic_gain": float((opt.gold.to_numpy() - gold) @ weights),
        "oracle_nmax": float(oracle.gold.iloc[-1]),
    }
