"""Time ENS-LoRA scoring: all K members in one mixed-adapter forward vs K sequential set_adapter passes.

    python scripts/bench_lora.py                              # the tiny model (hidden 256, 1 layer), K=8
    python scripts/bench_lora.py --hidden 512 --layers 4 --members 8 --texts 128 --device cuda

Both ways score the same rendered texts with the same length-sorted batches, in the same process, after a warm-up;
each is repeated and the median is reported, with the ratio sequential / mixed. The model is a random Qwen3 built
from a config (``rewarduq_exp.models.tiny_qwen3``), so nothing is downloaded. On a GPU it also prints scored tokens
per second.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="texts per scoring batch (x members rows if mixed)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    parser.add_argument("--train-pairs", type=int, default=64,
                        help="also time training (fit) on this many pairs, mixed vs one pass per member; 0 = skip")
    args = parser.parse_args()

    import torch
    from omegaconf import OmegaConf

    from rewarduq_exp.data.contract import render_all
    from rewarduq_exp.data.synthetic import SyntheticWorld
    from rewarduq_exp.methods.ens_lora import EnsLoRA
    from rewarduq_exp.models.backbone import Backbone

    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TQDM_DISABLE", "1")
    cache = tempfile.mkdtemp(prefix="bench_lora_")  # the benchmark's own model; removed at exit
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    cfg = OmegaConf.create({"name": "bench-qwen3", "builder": "tiny-qwen3", "hub_id": None, "revision": None,
                            "path": None, "dtype": "float32", "trust_remote_code": False,
                            "build": {"hidden_size": args.hidden, "num_layers": args.layers,
                                      "num_heads": args.heads, "num_kv_heads": args.heads}})
    backbone = Backbone(cfg, cache_dir=cache, device=args.device)

    class _Encoder:  # ENS-LoRA reads only the backbone of its encoder
        def __init__(self, backbone):
            self.backbone = backbone

    method = EnsLoRA(encoder=_Encoder(backbone), num_members=args.members, lora_rank=args.rank,
                     lora_alpha=2 * args.rank, score_batch_size=args.batch, device=args.device, show_progress=False)
    method._build()
    world = SyntheticWorld(seed=0, n_train=args.texts, n_eval=1, n_ood=1)
    frame = world.load("train")
    texts = render_all(backbone.tokenizer, frame["prompt"], frame["chosen"])
    tokens = sum(len(s) for s in method._tokenize(texts))

    def timed(mixed: bool) -> float:
        if method.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        method.member_rewards(texts, mixed=mixed)
        if method.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    a, b = method.member_rewards(texts, mixed=True), method.member_rewards(texts, mixed=False)  # warm-up
    diff = float((a - b).abs().max())
    times = {"mixed": [], "sequential": []}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both ways alike
        times["mixed"].append(timed(True))
        times["sequential"].append(timed(False))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: random Qwen3 hidden={args.hidden} layers={args.layers}, K={args.members} LoRA r={args.rank} "
          f"all-linear, {args.texts} texts ({tokens} tokens), batch {args.batch}, device {method.device}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"max |mixed - sequential| reward difference: {diff:.2e}")
    for k in ("sequential", "mixed"):
        print(f"{k:>10}: median {med[k] * 1e3:8.1f} ms over {args.repeats} repeats "
              f"({args.members * tokens / med[k]:,.0f} member-tokens/s)")
    print(f"scoring speed-up mixed vs sequential: {med['sequential'] / med['mixed']:.2f}x")

    if args.train_pairs:
        pairs = SyntheticWorld(seed=1, n_train=args.train_pairs, n_eval=1, n_ood=1).load("train")
        # "one pass per member" is the work of K adapters trained one after the other (each step: K separate
        # forward/backward passes of the backbone); "mixed" routes the K members' rows through one forward.
        train_times = {"mixed": [], "sequential": []}
        for _ in range(max(1, args.repeats // 2)):
            for name, mixed in (("mixed", True), ("sequential", False)):
                m = EnsLoRA(encoder=method.encoder, num_members=args.members, lora_rank=args.rank,
                            lora_alpha=2 * args.rank, batch_size=args.batch, mixed_adapter_training=mixed,
                            device=args.device, show_progress=False)
                train_times[name].append(m.fit(pairs).fit_summary["seconds_training"])
        tmed = {k: statistics.median(v) for k, v in train_times.items()}
        steps = -(-args.train_pairs // args.batch)
        labels = {"sequential": "one pass per member (K adapters in turn)", "mixed": "mixed-adapter batch"}
        for k in ("sequential", "mixed"):
            print(f"train, {labels[k]:<40}: median {tmed[k]:6.2f} s for {steps} steps ({tmed[k] / steps:.3f} s/step)")
        print(f"training speed-up mixed vs one pass per member: {tmed['sequential'] / tmed['mixed']:.2f}x")

if __name__ == "__main__":
    main()
