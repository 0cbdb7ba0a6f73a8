"""Time preparing a preference dataset for a run: normalise + length filter, cold vs with the token-count cache.

    python scripts/bench_data.py                  # 10K UltraFeedback-shaped pairs of ~800 tokens, tiny tokenizer
    python scripts/bench_data.py --pairs 62000 --model qwen3-0.6b

The naive way is what every job of a sweep would do without the cache: count the tokens of every rendered
conversation again. The data is written in the hub schema of trl-lib/ultrafeedback_binarized to a temporary folder
and read through the real loader (``paths.datasets_dir``), so the timing covers the code a run executes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def write_ultrafeedback_like(root: Path, pairs: int) -> None:
    from datasets import Dataset, Features, List, Value

    msgs = List({"content": Value("string"), "role": Value("string")})
    feats = Features({"chosen": msgs, "rejected": msgs, "score_chosen": Value("float64"),
                      "score_rejected": Value("float64")})
    rows = []
    for i in range(pairs):
        prompt = f"Question {i}: explain how bridges carry their load, step by step. " * 8
        rows.append({"chosen": [{"content": prompt, "role": "user"},
                                {"content": f"A careful answer number {i} about arches and beams. " * 20,
                                 "role": "assistant"}],
                     "rejected": [{"content": prompt, "role": "user"},
                                  {"content": "I am not sure how that works, sorry. " * 20, "role": "assistant"}],
                     "score_chosen": 8.0, "score_rejected": 3.0})
    data = root / "trl-lib/ultrafeedback_binarized/data"
    data.mkdir(parents=True)
    Dataset.from_list(rows, features=feats).to_parquet(str(data / "train-00000-of-00001.parquet"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10_000)
    ap.add_argument("--model", default="tiny-qwen3", help="conf/model/<name> whose tokenizer and template are used")
    ap.add_argument("--max-length", type=int, default=2048)
    args = ap.parse_args()

    import datasets
    from omegaconf import OmegaConf

    from rewarduq_exp.data.contract import filter_by_length
    from rewarduq_exp.data.registry import CONF_DIR, build_loader, load_dataset_config
    from rewarduq_exp.models.backbone import Backbone
    from rewarduq_exp.models.token_counter import TokenCounter

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(tmp / "hf_cache")
        write_ultrafeedback_like(tmp / "hub", args.pairs)
        backbone = Backbone(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml"), cache_dir=tmp / "cache",
                            device="cpu")
        tokenizer = backbone.tokenizer
        loader = build_loader(load_dataset_config("ultrafeedback", 0, {"datasets_dir": str(tmp / "hub")}))

        def prepare(count):
            t0 = time.perf_counter()
            frame = loader.load("train")
            t1 = time.perf_counter()
            kept, report = filter_by_length(frame, tokenizer, args.max_length, "ultrafeedback_train", count)
            return t1 - t0, time.perf_counter() - t1, report

        load_s, naive_s, report = prepare(None)  # also warms the datasets Arrow cache
        counter = TokenCounter(tokenizer, backbone.identity(), tmp / "cache" / "token_lengths")
        _, cold_s, _ = prepare(counter)
        _, warm_s, warm_report = prepare(counter)
        assert warm_report == report, "cached counts must give the same filter result"
    print(f"{report.line()}")
    print(f"load + normalise (every job):        {load_s:7.2f} s")
    print(f"length filter, naive (every job):    {naive_s:7.2f} s")
    print(f"length filter, first job (fills):    {cold_s:7.2f} s")
    print(f"length filter, later jobs (cached):  {warm_s:7.2f} s   -> {naive_s / warm_s:.1f}x faster than naive")
    print(f"per job: {load_s + naive_s:.2f} s naive vs {load_s + warm_s:.2f} s cached "
          f"({(load_s + naive_s) / (load_s + warm_s):.1f}x)")


if __name__ == "__main__":
    main()
