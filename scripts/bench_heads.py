"""Time one ENS-MLP training epoch on cached features: batched heads vs a Python loop over K separate heads.

    python scripts/bench_heads.py                     # d=1024 (Qwen3-0.6B), 8000 pairs, K=20, CPU
    python scripts/bench_heads.py --pairs 62000 --dim 2560 --device cuda

Both variants train the same model (same init, same data order, same loss of eq. 11, AdamW with a cosine schedule);
the naive one is what the reference implementation does (``stack([mlp(z) for mlp in heads])`` and the anchor term
from the concatenated parameters of every head). The features are random tensors of the backbone's hidden size:
the backbone is not part of an ENS-MLP epoch, because the features come from the cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from rewarduq_exp.methods.base import cosine_schedule_with_warmup
from rewarduq_exp.methods.ens_mlp import EnsMLP


def naive_epoch(method: EnsMLP, zc, zr, weight, sync) -> float:
    """The loop-over-heads baseline, with the same optimiser, schedule, batches and loss terms."""
    heads = method.heads.separate_heads()
    initial = torch.cat([p.detach().flatten() for h in heads for p in h.parameters()]).view(len(heads), -1)
    s = method.schedule
    n = len(zc)
    steps = -(-n // s.batch_size)
    opt = torch.optim.AdamW(heads.parameters(), lr=s.learning_rate, weight_decay=0.0)
    sched = cosine_schedule_with_warmup(opt, int(round(s.warmup_ratio * steps)), steps)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).to(zc.device)
    sync()
    t0 = time.perf_counter()
    for step in range(steps):
        idx = order[step * s.batch_size:(step + 1) * s.batch_size]
        z = torch.cat([zc[idx], zr[idx]])
        r = torch.stack([h(z).squeeze(-1) for h in heads])  # (K, 2B), one head at a time
        rc, rr = r[:, :len(idx)], r[:, len(idx):]
        w = weight[idx]
        bt = ((-nn.functional.logsigmoid(rc - rr)).mean(0) * w).sum() / w.sum()
        center = ((rc + rr).pow(2).mean(0) * w).sum() / w.sum()
        flat = torch.cat([p.flatten() for h in heads for p in h.parameters()]).view(len(heads), -1)
        anchor = (flat - initial).pow(2).mean(1).mean()
        loss = bt + method.reg_lambda * anchor + method.center_gamma * center
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if s.max_grad_norm is not None:  # the same clipping as the batched fit
            torch.nn.utils.clip_grad_norm_(heads.parameters(), s.max_grad_norm)
        opt.step()
        sched.step()
    sync()
    return time.perf_counter() - t0


def batched_epoch(method: EnsMLP, zc, zr, weight, sync) -> float:
    sync()
    t0 = time.perf_counter()
    method._fit_features(zc, zr, weight)
    sync()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8000)
    parser.add_argument("--dim", type=int, default=1024, help="backbone hidden size (Qwen3-0.6B: 1024)")
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    zc = torch.randn(args.pairs, args.dim, generator=g).to(device)
    zr = torch.randn(args.pairs, args.dim, generator=g).to(device)
    weight = torch.ones(args.pairs, device=device)
    times = {"batched": [], "loop": []}
    for fn in (batched_epoch, naive_epoch):  # untimed warm-up: imports, allocator and thread pools
        method = EnsMLP(num_heads=args.heads, device=args.device, show_progress=False, seed=0)
        method._build(args.dim)
        fn(method, zc[:256], zr[:256], weight[:256], sync)
    for _ in range(args.repeats):
        for name in ("batched", "loop"):
            method = EnsMLP(num_heads=args.heads, device=args.device, show_progress=False, seed=0)
            method._build(args.dim)
            fn = batched_epoch if name == "batched" else naive_epoch
            times[name].append(fn(method, zc, zr, weight, sync))
    steps = -(-args.pairs // 64)
    batched, loop = statistics.median(times["batched"]), statistics.median(times["loop"])
    print(f"ENS-MLP, one epoch on cached features: {args.pairs} pairs ({steps} steps of 64), d={args.dim}, "
          f"K={args.heads}, device={device}, median of {args.repeats}")
    print(f"  batched heads (one einsum/bmm): {batched:8.3f} s  ({steps / batched:8.1f} steps/s)")
    print(f"  loop over {args.heads} separate heads: {loop:8.3f} s  ({steps / loop:8.1f} steps/s)")
    print(f"  speed-up (loop / batched): {loop / batched:.2f}x")


if __name__ == "__main__":
    main()
