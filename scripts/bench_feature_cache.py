"""The per-text feature cache: a request for texts already extracted, in another order or split into other requests,
does no backbone pass; what a lookup costs per row, against extracting the rows again (what a cache keyed by the
whole ordered list of texts had to do for such a request).

    python scripts/bench_feature_cache.py                 # 400 synthetic pairs (800 texts), the offline tiny Qwen3
    python scripts/bench_feature_cache.py --pairs 2000
    python scripts/bench_feature_cache.py --smoke         # a few seconds (CI)

Four requests after a cold extraction of the pairs, each through a fresh encoder (a new process's view of the cache):
the same rows reversed, shuffled, regrouped into three requests of other sizes, and a subset. Each line prints the
backbone forward passes it made (0 when every text is found), its time, the time per row and the speed-up against
the cold extraction's time for the same number of rows.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.features import FeatureEncoder

ROOT = Path(__file__).resolve().parents[1]


def encoder(backbone, cache: Path) -> FeatureEncoder:
    probe = OmegaConf.create({"layer": -1, "pooling": "last", "batch_size": 16})
    return FeatureEncoder(backbone, probe, cache / "features", max_length=2048, show_progress=False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=400, help="synthetic preference pairs (two texts each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="40 pairs")
    args = parser.parse_args(argv)
    n_pairs = 40 if args.smoke else args.pairs
    torch.set_num_threads(max(1, torch.get_num_threads()))
    frame = SyntheticWorld(n_train=n_pairs, seed=args.seed).load("train")
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        backbone = Backbone(OmegaConf.load(ROOT / "conf/model/tiny-qwen3.yaml"), cache_dir=cache, device="cpu")
        backbone.load_encoder()  # built and loaded before the clock starts
        cold = encoder(backbone, cache)
        t0 = time.perf_counter()
        chosen, rejected = cold.encode_pairs(frame)
        t_cold = time.perf_counter() - t0
        rows = 2 * n_pairs
        per_row_cold = t_cold / rows
        print(f"feature cache, tiny Qwen3 on CPU: {n_pairs} pairs = {rows} texts")
        print(f"{'request':<34} {'rows':>6} {'passes':>7} {'time':>9} {'per row':>10} {'speed-up':>9}")
        print(f"{'cold extraction':<34} {rows:>6} {cold.stats['backbone_forward_passes']:>7} {t_cold:>8.2f}s "
              f"{per_row_cold * 1e6:>8.0f}us {'':>9}")
        cuts = sorted(rng.choice(np.arange(1, n_pairs), size=2, replace=False))
        requests = {
            "reversed": [frame.iloc[::-1]],
            "shuffled": [frame.iloc[rng.permutation(n_pairs)]],
            "regrouped into 3 requests": [frame.iloc[a:b] for a, b in zip([0, *cuts], [*cuts, n_pairs])],
            "a quarter of the rows": [frame.iloc[rng.choice(n_pairs, size=max(1, n_pairs // 4), replace=False)]],
        }
        for name, parts in requests.items():
            enc = encoder(backbone, cache)
            t0 = time.perf_counter()
            out = [enc.encode_pairs(part.reset_index(drop=True)) for part in parts]
            elapsed = time.perf_counter() - t0
            n_rows = 2 * sum(len(p) for p in parts)
            for part, (zc, _) in zip(parts, out):  # the cached rows are the cold extraction's rows
                assert torch.equal(zc, chosen[torch.tensor(part.index.to_list())])
            print(f"{name:<34} {n_rows:>6} {enc.stats['backbone_forward_passes']:>7} {elapsed:>8.3f}s "
                  f"{elapsed / n_rows * 1e6:>8.0f}us {per_row_cold * n_rows / elapsed:>8.0f}x", flush=True)
    print("speed-up = the cold extraction's time for as many rows / the request's time (a cache keyed by the whole "
          "ordered list re-extracted every one of these requests)")


if __name__ == "__main__":
    main()
