"""Time Plackett-Luce marginals: the closed forms against summing the probabilities of all m! rankings.

    python scripts/bench_ranking.py                  # m = 6, 7, 8; n = 100 samples
    python scripts/bench_ranking.py --sizes 6,7,8,9 --n 50
    python scripts/bench_ranking.py --smoke          # tiny and fast (CI)

For each m the same work is done both ways for n samples with random log-weights: sub-k and top-k marginals of all
ordered k-tuples for k = 2 and 3, and the full (m x m) pairwise matrix. The closed forms are
``rewarduq_exp.ranking.plackett_luce.PlackettLuce``; the brute-force baseline is what the reference code does in
spirit: compute the probability of every one of the m! rankings (vectorised over samples) and sum those in each event
(``ExplicitDistribution``, one event-mask matmul per call). The largest absolute difference between the two is
printed as a correctness check. Timings are the best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

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


if __name__ == "__main__":
    main()
