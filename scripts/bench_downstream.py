"""Time a best-of-n curve (n = 1, 2, 4, ..., n_max) on the tiny offline backbone: drawn once and scored in one batch
(what ``downstream.py task=best_of_n`` does) vs the naive way, fresh candidates for every n scored prompt by prompt.

    python scripts/bench_downstream.py                      # 16 prompts, n_max 256, ENS-MLP heads (20)
    python scripts/bench_downstream.py --prompts 64 --n-max 1024

The naive way scores sum(n) = 2 n_max - 1 candidates per prompt and calls the model once per (prompt, n); ours
scores n_max per prompt once and gets every n from the unbiased estimator. Both start with an empty in-memory
feature store, so both pay the backbone passes they need. Prints candidates/s of each and the speed-up.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
from omegaconf import OmegaConf

from rewarduq_exp.data.registry import CONF_DIR
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.downstream.best_of_n import best_of_n_curves, powers_of_two
from rewarduq_exp.methods.ens_mlp import EnsMLP
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.features import FeatureEncoder
from rewarduq_exp.models.memory_features import MemoryFeatures


def make_method(backbone: Backbone, probe) -> EnsMLP:
    """Untrained heads on a fresh in-memory store: scoring cost does not depend on training."""
    method = EnsMLP(encoder=FeatureEncoder(backbone, probe, MemoryFeatures(2**31), 2048, show_progress=False),
                    device="cpu", show_progress=False)
    method._build(int(backbone.cfg.hidden_size))
    return method


def ours(method, world, prompts: int, n_max: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    cand = world.candidates("eval", prompts, n_max)
    flat_prompts = [p for p in cand.prompts for _ in range(n_max)]
    s = method.score(flat_prompts, [[{"role": "assistant", "content": t}] for g in cand.texts for t in g])
    reward = s.reward.reshape(prompts, n_max)
    u = ((s.upper - s.reward) / method.beta).reshape(prompts, n_max)
    best_of_n_curves(reward, u, cand.gold, [1.0], powers_of_two(n_max))
    return time.perf_counter() - t0, prompts * n_max


def naive(method, world, prompts: int, n_max: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    scored = 0
    for seed, n in enumerate(powers_of_two(n_max)):
        cand = world.candidates("eval", prompts, n, seed=1000 + seed)  # fresh candidates for every n
        for p in range(prompts):
            s = method.score([cand.prompts[p]] * n, [[{"role": "assistant", "content": t}] for t in cand.texts[p]])
            _ = cand.gold[p, int(np.argmax(s.reward))]
            scored += n
    return time.perf_counter() - t0, scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n-max", type=int, default=256)
    args = parser.parse_args()
    model_cfg = OmegaConf.load(CONF_DIR / "model" / "tiny-qwen3.yaml")
    probe = OmegaConf.load(CONF_DIR / "probe" / "last_token.yaml")
    with tempfile.TemporaryDirectory() as cache:
        backbone = Backbone(model_cfg, cache_dir=cache, device="cpu")
        world = SyntheticWorld(n_train=8, n_eval=8, n_ood=8)
        warm = make_method(backbone, probe)  # loads the weights, outside both timings
        warm.score([[{"role": "user", "content": "warm up"}]], [[{"role": "assistant", "content": "x"}]])
        t_ours, n_ours = ours(make_method(backbone, probe), world, args.prompts, args.n_max)
        t_naive, n_naive = naive(make_method(backbone, probe), world, args.prompts, args.n_max)
    print(f"best-of-n curve, {args.prompts} prompts, n = 1..{args.n_max}:")
    rate_ours, rate_naive = n_ours / t_ours, n_naive / t_naive
    print(f"  batched, drawn once:  {n_ours:7d} candidates in {t_ours:7.2f} s ({rate_ours:8.0f} candidates/s)")
    print(f"  naive, fresh per n:   {n_naive:7d} candidates in {t_naive:7.2f} s ({rate_naive:8.0f} candidates/s)")
    print(f"speed-up of the curve: {t_naive / t_ours:.2f}x (candidates/s ratio {rate_ours / rate_naive:.2f}x)")


if __name__ == "__main__":
    main()
