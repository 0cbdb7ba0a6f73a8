"""Time Plackett-Luce marginals (closed forms against summing all m! rankings) and the full-rank kernel estimator.

    python scripts/bench_ranking.py                  # m = 6, 7, 8; n = 100 samples; the kernel settings below
    python scripts/bench_ranking.py --sizes 6,7,8,9 --n 50
    python scripts/bench_ranking.py --smoke          # tiny and fast (CI)

For each m the same work is done both ways for n samples with random log-weights: sub-k and top-k marginals of all
ordered k-tuples for k = 2 and 3, and the full (m x m) pairwise matrix. The closed forms are
``rewarduq_exp.ranking.plackett_luce.PlackettLuce``; the brute-force baseline is what the reference code does in
spirit: compute the probability of every one of the m! rankings (vectorised over samples) and sum those in each event
(``ExplicitDistribution``, one event-mask matmul per call). The largest absolute difference between the two is
printed as a correctness check. Timings are the best of ``--repeats`` runs.

Second table: the Dirichlet-kernel calibration estimator of the full-rank metrics
(``rewarduq_exp.metrics.ranking.dirichlet_kernel_ece``, float64, blocks of rows) against the dense way of the
reference code: one (n, n, C) float32 torch tensor for the log-kernel, then exp, a row sum and a product with the
one-hot labels (written here from the estimator's definition). Each setting is the full-rank problems of a
Plackett-Luce model's predictions on synthetic rankings: full-rank sub-2 at m = 6 (15 problems of C = 2 classes),
sub-3 (20 problems, C = 6), top-3 at m = 4 (C = 24) and top-5 at m = 6 (C = 720), h = 1, p = 1. The largest
difference between the two is printed (float32 rounding on the baseline's side).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from rewarduq_exp.metrics.ranking import (
    _all_subsets,
    dirichlet_kernel_ece,
    sub_k_full_rank_problems,
    top_k_full_rank_problem,
)
from rewarduq_exp.ranking.distribution import ExplicitDistribution
from rewarduq_exp.ranking.permutations import all_orderings, ordered_tuples
from rewarduq_exp.ranking.plackett_luce import PlackettLuce


def workload(dist, events) -> list[np.ndarray]:
    out = []
    for ev in events:
        out.append(dist.sub_k(ev))
        out.append(dist.top_k(ev))
    out.append(dist.pairwise())
    return out


def closed_form(log_weights, events):
    return workload(PlackettLuce(log_weights), events)


def brute_force(log_weights, events):
    m = log_weights.shape[1]
    orderings = all_orderings(m)
    # probability of every ranking: prod_t w_{o_t} / sum_{u >= t} w_{o_u}, vectorised over samples and rankings
    lw = log_weights - log_weights.max(axis=1, keepdims=True)
    w = np.exp(lw)[:, orderings]  # (n, m!, m)
    suffix = np.cumsum(w[..., ::-1], axis=-1)[..., ::-1]
    probs = np.prod(w / suffix, axis=-1)
    return workload(ExplicitDistribution(orderings, probs), events)


def dense_kernel_ece(probs: np.ndarray, labels: np.ndarray, h: float = 1.0) -> float:
    """The kernel estimator computed the dense way (float32 torch, the whole (n, n, C) tensor at once), p = 1."""
    f = torch.tensor(probs, dtype=torch.float32)
    n, n_classes = f.shape
    alpha = f / h + 1.0
    log_norm = torch.lgamma(alpha.sum(dim=1)) - torch.lgamma(alpha).sum(dim=1)
    log_f = torch.log(f.clamp(min=1e-8))
    logk = log_norm[None, :] + ((alpha - 1.0)[None, :, :] * log_f[:, None, :]).sum(dim=2)  # (n, n, C) -> (n, n)
    logk[torch.arange(n), torch.arange(n)] = -float("inf")
    w = torch.exp(logk - logk.max(dim=1, keepdim=True).values)
    onehot = torch.nn.functional.one_hot(torch.as_tensor(labels), n_classes).to(torch.float32)
    yhat = (w @ onehot) / (w.sum(dim=1, keepdim=True) + 1e-8)
    return float((yhat - f).abs().sum(dim=1).mean())


# (label, m, n, kind, k): the full-rank problems of one metric
KERNEL_SETTINGS = [("sub-2", 6, 5000, "sub", 2), ("sub-2", 6, 1000, "sub", 2), ("sub-3", 6, 1000, "sub", 3),
                   ("top-3", 4, 2000, "top", 3), ("top-5", 6, 500, "top", 5)]
KERNEL_SMOKE = [("sub-2", 4, 60, "sub", 2), ("top-2", 4, 60, "top", 2)]


def kernel_problems(rng, m: int, n: int, kind: str, k: int):
    """Full-rank problems of a Plackett-Luce model on rankings drawn from a nearby Plackett-Luce model."""
    lw = rng.normal(scale=1.0, size=(n, m))
    gumbel = -np.log(-np.log(rng.uniform(size=(n, m))))
    true_ranks = np.argsort(np.argsort(-(lw + 0.3 * rng.normal(size=(n, m)) + gumbel), axis=1), axis=1) + 1
    dist = PlackettLuce(lw)
    if kind == "sub":
        return sub_k_full_rank_problems(true_ranks, dist.sub_k, _all_subsets(m, k))
    return [top_k_full_rank_problem(true_ranks, dist.top_k, k)]


def kernel_table(rng, settings, repeats: int) -> None:
    print("\nFull-rank kernel estimator (h = 1, p = 1): blocked float64 against the dense (n, n, C) float32 way")
    print(f"{'metric':>7} {'m':>3} {'n':>6} {'C':>5} {'problems':>8} {'ours':>10} {'dense':>10} {'speed-up':>9} "
          f"{'max |diff|':>11}")
    for label, m, n, kind, k in settings:
        problems = kernel_problems(rng, m, n, kind, k)
        t_fast, fast = best_time(lambda: [dirichlet_kernel_ece(q.probs, q.labels) for q in problems], repeats)
        t_slow, slow = best_time(lambda: [dense_kernel_ece(q.probs, q.labels) for q in problems], repeats)
        diff = max(abs(a - b) for a, b in zip(fast, slow))
        print(f"{label:>7} {m:>3} {n:>6} {problems[0].probs.shape[1]:>5} {len(problems):>8} {t_fast * 1e3:>8.1f}ms "
              f"{t_slow * 1e3:>8.1f}ms {t_slow / t_fast:>8.1f}x {diff:>11.1e}", flush=True)
    print("speed-up = dense time / blocked time (the same problems)")


def best_time(fn, repeats: int):
    best, result = math.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="6,7,8", help="comma-separated numbers of items m (at most 9)")
    parser.add_argument("--n", type=int, default=100, help="samples (distributions) per evaluation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny fast run (m = 4, 5; n = 4; one repeat)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    n, repeats = args.n, args.repeats
    if args.smoke:
        sizes, n, repeats = [4, 5], 4, 1
    if any(m < 3 or m > 9 for m in sizes):
        parser.error("--sizes must lie in 3..9 (the baseline enumerates m! rankings)")
    rng = np.random.default_rng(args.seed)
    print(f"Plackett-Luce marginals, n = {n} samples: sub-k and top-k of all ordered k-tuples (k = 2, 3) + pairwise")
    print(f"{'m':>3} {'m!':>7} {'events':>7} {'closed form':>12} {'brute force':>12} {'speed-up':>9} "
          f"{'max |diff|':>11}")
    for m in sizes:
        lw = rng.normal(scale=1.5, size=(n, m))
        events = [ordered_tuples(m, 2), ordered_tuples(m, 3)]
        n_events = 2 * sum(len(e) for e in events) + m * (m - 1)
        closed_form(lw[:1], events)  # warm-up (first-call costs are not part of either method)
        t_fast, fast = best_time(lambda: closed_form(lw, events), repeats)
        t_slow, slow = best_time(lambda: brute_force(lw, events), repeats)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(fast, slow))
        print(f"{m:>3} {math.factorial(m):>7} {n_events:>7} {t_fast * 1e3:>10.2f}ms {t_slow * 1e3:>10.1f}ms "
              f"{t_slow / t_fast:>8.1f}x {diff:>11.1e}", flush=True)
    print("speed-up = brute-force time / closed-form time (same events, same samples, best of "
          f"{repeats} run{'s' if repeats > 1 else ''})")
    kernel_table(rng, KERNEL_SMOKE if args.smoke else KERNEL_SETTINGS, repeats)


if __name__ == "__main__":
    main()
