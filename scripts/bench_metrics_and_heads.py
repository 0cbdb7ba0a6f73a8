"""Time, in one run, the metric call and an ENS-MLP training epoch against their naive forms (issue 45).

    python scripts/bench_metrics_and_heads.py                 # 100k pairs; K=20 heads on d=1024, 8000 pairs
    python scripts/bench_metrics_and_heads.py --smoke         # tiny sizes (tests/test_bench_scripts.py)

1. ``compute_metrics`` (``metric=rewarduq``'s families: win rate, CT/UT/CF/UF, RS_alpha, ECE/MCE, ELCE/EUCE/EBCE,
   Brier, and the bound widths) on a predictions table of ``--metric-pairs`` pairs, against the former way written
   here (``former_metrics``: the path of commit 9fad1af step for step, its values to the bit: the table's columns
   stacked and copied twice, validated on strided views, the symmetrised set concatenated, ``np.digitize`` bins,
   weighted sums by one BLAS dot each), checked equal within 1e-12 (the weighted sums now add BLAS dots of 8192
   values, which leaves them a few ulps from one threaded dot; every binned value is equal to the bit).
2. One ENS-MLP epoch on random features of the backbone's size (the features come from the cache, so the backbone
   is not part of an epoch), K heads d-128-128-1, batch 64, lr 1e-3, lambda 0.1, gamma 0.01, float32: the training
   step as it is (the anchor's gradient added directly; the first weight stack d-major in memory, so einsum
   copies nothing) against the former step of 9fad1af (the anchor's value and gradient through autograd, the stack
   K-major, which einsum copied into and out of its one-GEMM layout every step, torch.optim.AdamW's default loop
   over tensors, glibc's default heap), same init and data order. The optimizer's construction is left out of both
   (after the warm-up torch._dynamo, which torch.optim.AdamW imports, is loaded; ``bench_whole_process.py`` counts
   it).

Medians over ``--metric-repeats`` and ``--repeats``, the two variants alternating.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time

import numpy as np
import pandas as pd
import torch

from rewarduq_exp.core import heap
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.base import bradley_terry_nll, weighted_mean
from rewarduq_exp.methods.ens_mlp import EnsMLP
from rewarduq_exp.methods.training import cosine_schedule_with_warmup
from rewarduq_exp.metrics import preference
from rewarduq_exp.metrics.calibration import CalibrationCurve, symmetrise
from rewarduq_exp.metrics.rewarduq import compute_metrics


# ---------------------------------------------------------------------------------------------------- metrics
def former_pairs(table: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The former pairs_from_table and validate_pairs: the columns stacked, copied again as (N, 3) arrays, checked
    column by column on strided views, the bounds clipped in place."""
    def column(name):
        return pd.to_numeric(table[name], errors="coerce").to_numpy(dtype=float)

    missing = [c for c in preference.REQUIRED_COLUMNS if c not in table.columns]
    if missing:
        raise UserError(f"missing column(s) {', '.join(missing)}")
    values = np.column_stack([column(c) for c in preference.REWARD_COLUMNS])
    c, r = np.array(values[:, :3], dtype=float), np.array(values[:, 3:], dtype=float)
    if len(c) == 0:
        raise UserError("no preference pairs")
    w = np.array(column("weight"), dtype=float).reshape(-1)
    if not np.isfinite(w).all() or (w < 0).any() or not w.sum() > 0:
        raise UserError("bad weights")
    for j in range(6):
        if not np.isfinite((c if j < 3 else r)[:, j % 3]).all():
            raise UserError("NaN/inf")
    for arr in (c, r):
        reward, lower, upper = arr[:, 0], arr[:, 1], arr[:, 2]
        tol = preference.BOUND_RTOL * np.maximum(1.0, np.abs(reward))
        if (lower > reward + tol).any() or (reward > upper + tol).any():
            raise UserError("bounds out of order")
        arr[:, 1] = np.minimum(lower, reward)
        arr[:, 2] = np.maximum(upper, reward)
    return c, r, w


def former_curve(q, y, w, n_bins: int) -> CalibrationCurve:
    """The former binned_curve: np.digitize of the rounded probabilities (a binary search per value)."""
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    b = np.digitize(np.round(q, 12), edges[1:-1])
    sw = np.bincount(b, weights=w, minlength=n_bins)
    swq = np.bincount(b, weights=w * q, minlength=n_bins)
    swy = np.bincount(b, weights=w * y, minlength=n_bins)
    occ = sw > 0
    conf, acc = np.full(n_bins, np.nan), np.full(n_bins, np.nan)
    conf[occ], acc[occ] = swq[occ] / sw[occ], swy[occ] / sw[occ]
    return CalibrationCurve(edges=edges, confidence=conf, accuracy=acc, weight=sw)


def former_metrics(table: pd.DataFrame, n_bins: int = 20, alphas=preference.DEFAULT_ALPHAS) -> dict[str, float]:
    """compute_metrics the former way (commit 9fad1af, a table without ``true_margin``), written out here: its
    values to the bit and its work step for step (checked against that commit's compute_metrics)."""
    c, r, w = former_pairs(table)
    p, p_lo, p_hi = (preference.sigmoid(m) for m in (c[:, 0] - r[:, 0], c[:, 1] - r[:, 2], c[:, 2] - r[:, 1]))
    true, conf_true, conf_false = c[:, 0] > r[:, 0], c[:, 1] > r[:, 2], c[:, 2] < r[:, 1]
    sums = np.bincount(np.where(conf_true, 0, np.where(true, 1, np.where(conf_false, 2, 3))), weights=w, minlength=4)
    ct, ut, cf, uf = (float(s) for s in sums / sums.sum())
    t = float(np.dot(w, true) / w.sum())
    out = {"win_rate": t, "ct_rate": ct, "ut_rate": ut, "cf_rate": cf, "uf_rate": uf}
    out |= {f"rs_{a}": preference.ranking_score(ct, cf, t, cf + uf, a) for a in alphas}
    y = np.ones_like(p)
    q, q_lo, q_hi, ys, ws = symmetrise(p, p_lo, p_hi, y, w)
    pred, lower, upper = (former_curve(x, ys, ws, n_bins) for x in (q, q_lo, q_hi))
    elce, euce = lower.lower_error(), upper.upper_error()
    out |= {"ece": pred.ece(), "mce": pred.mce(), "elce": elce, "euce": euce, "ebce": 0.5 * (elce + euce),
            "brier": float(np.dot(w, (p - y) ** 2) / w.sum())}
    out["bound_width"] = float(np.dot(w, (c[:, 2] - c[:, 1]) + (r[:, 2] - r[:, 1])) / (2.0 * w.sum()))
    out["pref_bound_width"] = float(np.dot(w, p_hi - p_lo) / w.sum())
    out["n_pairs"] = len(table)
    out["weight_sum"] = float(w.sum())
    return out


def predictions_table(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    cr, rr = rng.normal(size=n), rng.normal(size=n)
    cu, ru = rng.uniform(0, 1, n), rng.uniform(0, 1, n)
    return pd.DataFrame({"weight": rng.uniform(0, 2, n), "chosen_reward": cr, "chosen_lower": cr - cu,
                         "chosen_upper": cr + cu, "rejected_reward": rr, "rejected_lower": rr - ru,
                         "rejected_upper": rr + ru})


def bench_metrics(pairs: int, repeats: int) -> None:
    table = predictions_table(pairs)
    new, old = compute_metrics(table), former_metrics(table)
    assert new.keys() == old.keys(), (new.keys(), old.keys())
    # The weighted sums are BLAS dot products by chunks now, not one threaded BLAS call: a few ulps apart, no more.
    diff = max(abs(new[key] - old[key]) for key in old)
    assert diff <= 1e-12, {key: (new[key], old[key]) for key in old if new[key] != old[key]}
    same = sum(new[key] == old[key] for key in old)
    times = {"new": [], "former": []}
    for _ in range(repeats):
        for name, fn in (("new", compute_metrics), ("former", former_metrics)):
            t0 = time.perf_counter()
            fn(table)
            times[name].append(time.perf_counter() - t0)
    new_s, old_s = statistics.median(times["new"]), statistics.median(times["former"])
    others = f", the others within {diff:.1e}" if same < len(old) else ""
    print(f"metrics (every key of compute_metrics), {pairs} pairs, median of {repeats}: {same} of {len(old)} values "
          f"equal to the bit{others}")
    print(f"  compute_metrics:                              {new_s * 1e3:8.2f} ms  (min {min(times['new']) * 1e3:.2f})")
    print(f"  the former way (9fad1af's path, written here): {old_s * 1e3:8.2f} ms  "
          f"(min {min(times['former']) * 1e3:.2f})")
    print(f"  metrics speed-up (former / new): {old_s / new_s:.2f}x")


# ---------------------------------------------------------------------------------------------------- ENS-MLP
def naive_fit(m: EnsMLP, zc, zr, weight) -> None:
    """The former ENS-MLP step and loop (9fad1af): eq. 11 with the anchor in the autograd graph, one backward,
    ``torch.optim.AdamW`` with its CPU default (a loop over tensors) under a ``LambdaLR``, ``clip_grad_norm_``; the
    same batches in the same order as :func:`~rewarduq_exp.methods.training.run_training`."""
    s, params = m.schedule, list(m.heads.parameters())
    steps = math.ceil(len(zc) / s.batch_size)
    optimizer = torch.optim.AdamW(params, lr=s.learning_rate, betas=tuple(s.adam_betas), eps=s.adam_eps,
                                  weight_decay=s.weight_decay)
    scheduler = cosine_schedule_with_warmup(optimizer, int(round(s.warmup_ratio * steps)), steps)
    order = torch.randperm(len(zc), generator=torch.Generator().manual_seed(m.seed))
    for i in range(steps):
        index = order[i * s.batch_size:(i + 1) * s.batch_size]
        optimizer.zero_grad(set_to_none=True)
        c, r, w = zc[index], zr[index], weight[index]
        n = c.shape[0]
        rewards = m.heads(torch.cat([c, r]))
        rc, rr = rewards[:, :n], rewards[:, n:]
        bt = weighted_mean(bradley_terry_nll(rc - rr).mean(0), w)
        center = weighted_mean((rc + rr).pow(2).mean(0), w)
        sq = sum((p - p0).pow(2).flatten(1).sum(1) for p, p0 in zip(params, m.initial))
        anchor = (sq / m.heads.params_per_head).mean()
        (bt + m.reg_lambda * anchor + m.center_gamma * center).backward()
        torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm)
        optimizer.step()
        scheduler.step()


def new_fit(m: EnsMLP, zc, zr, weight) -> None:
    """The step as a run takes it: ``FeatureHeadMethod.fit``'s heap policy around ``_fit_features``."""
    with heap.keeping_freed_memory():
        m._fit_features(zc, zr, weight)


def bench_heads(pairs: int, dim: int, heads: int, repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    zc, zr = torch.randn(pairs, dim, generator=g), torch.randn(pairs, dim, generator=g)
    weight = torch.ones(pairs)
    make = functools.partial(EnsMLP, num_heads=heads, hidden_dim=128, num_hidden_layers=2, batch_size=64,
                             learning_rate=1e-3, reg_lambda=0.1, center_gamma=0.01, num_epochs=1,
                             max_grad_norm=1.0, device="cpu", show_progress=False, seed=0)

    def epoch(fit) -> tuple[float, EnsMLP]:
        m = make()
        m._build(dim)
        if fit is naive_fit:   # the former (K, d, h)-contiguous first stack, which einsum copied both ways each step
            with torch.no_grad():
                m.heads.weights[0].data = m.heads.weights[0].data.contiguous()
            m.initial[0] = m.initial[0].contiguous()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            t0 = time.perf_counter()
            fit(m, zc, zr, weight)
            return time.perf_counter() - t0, m

    variants = {"new": new_fit, "naive": naive_fit}
    for fit in variants.values():   # untimed warm-up: allocator and thread pools
        epoch(fit)
    times, models = {"new": [], "naive": []}, {}
    for _ in range(repeats):
        for name, fit in variants.items():
            seconds, models[name] = epoch(fit)
            times[name].append(seconds)
    with torch.no_grad():
        diff = max(float((a - b).abs().max()) for a, b in zip(models["new"].heads.parameters(),
                                                              models["naive"].heads.parameters()))
    steps = -(-pairs // 64)
    new_s, old_s = statistics.median(times["new"]), statistics.median(times["naive"])
    print(f"ENS-MLP, one epoch: {pairs} pairs ({steps} steps of 64), d={dim}, K={heads}, torch threads "
          f"{torch.get_num_threads()}, median of {repeats}; parameters differ by at most {diff:.1e}")
    print(f"  this step (direct anchor, d-major 1st stack, foreach AdamW, blocks kept): {new_s:8.3f} s  "
          f"({new_s / steps * 1e3:6.1f} ms a step, min {min(times['new']):.3f} s)")
    print(f"  former (anchor through autograd, K-major, AdamW's loop, glibc's heap):   {old_s:8.3f} s  "
          f"({old_s / steps * 1e3:6.1f} ms a step, min {min(times['naive']):.3f} s)")
    print(f"  training speed-up (naive / new): {old_s / new_s:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metric-pairs", type=int, default=100_000)
    parser.add_argument("--pairs", type=int, default=8000, help="ENS-MLP training pairs")
    parser.add_argument("--dim", type=int, default=1024, help="backbone hidden size (Qwen3-0.6B: 1024)")
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="ENS-MLP epochs per variant")
    parser.add_argument("--metric-repeats", type=int, default=21, help="metric calls per variant")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.metric_pairs, args.pairs, args.dim, args.heads, args.repeats, args.metric_repeats = 500, 128, 16, 3, 1, 1
    bench_metrics(args.metric_pairs, args.metric_repeats)
    bench_heads(args.pairs, args.dim, args.heads, args.repeats)


if __name__ == "__main__":
    main()
