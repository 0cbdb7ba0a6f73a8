"""Time ENS-LoRA: all K members in one batched multi-LoRA forward vs K sequential passes vs PEFT's mixed-adapter batch.

    python scripts/bench_lora.py                              # the tiny model (hidden 256, 1 layer), K=8
    python scripts/bench_lora.py --hidden 512 --layers 4 --members 8 --texts 128 --device cuda

Scoring: the same rendered texts in the same length-sorted batches of ``--batch`` texts, scored four ways in the same
process, interleaved, after a warm-up, each the median of ``--repeats`` runs:

* extraction: the plain frozen body (no adapters) once over each batch, last-token pooling (the feature encoder's
  forward): the ceiling a K-member forward can reach per member-token;
* batched: ``EnsLoRA.member_rewards_ids(mixed=True)``, the K x B rows in one forward of the multi-LoRA module
  (:mod:`rewarduq_exp.models.multi_lora`);
* sequential: ``mixed=False``, one pass of the B rows per member;
* PEFT mixed: the same weights as a PEFT model, the K x B rows in one forward routed by PEFT's ``adapter_names=``
  (what ENS-LoRA ran before the multi-LoRA module).

Throughput counts member-tokens (K x the batch's real tokens) for the three K-member ways and tokens for the
extraction; the script prints the ratios batched / sequential, batched / PEFT mixed and batched member-tokens/s over
extraction tokens/s (a GPU aims at >= 0.8 there). Training (``--train-pairs``): ``fit`` on that many pairs with all
members in one batched forward and backward per step vs one pass and backward per member. The model is a random
Qwen3 built from a config (``rewarduq_exp.models.tiny_qwen3``), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import atexit
import copy
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
    parser.add_argument("--batch", type=int, default=16, help="texts per scoring batch (x members rows if batched)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    parser.add_argument("--train-pairs", type=int, default=64,
                        help="also time training (fit) on this many pairs, batched vs one pass per member; 0 = skip")
    args = parser.parse_args()

    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModel

    from rewarduq_exp.data.contract import render_all
    from rewarduq_exp.data.synthetic import SyntheticWorld
    from rewarduq_exp.methods.ens_lora import EnsLoRA
    from rewarduq_exp.models.backbone import Backbone
    from rewarduq_exp.models.shared_prefix import batch_order

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
    with torch.no_grad():   # trained-looking members (PEFT starts B at 0); the work is the same either way
        for p in method.model.lora_parameters():
            p.normal_(0, 0.02)
    peft = copy.deepcopy(method.model).to_peft()   # the same weights, routed by PEFT
    body = backbone.from_pretrained(AutoModel).to(method.device).eval().requires_grad_(False)
    world = SyntheticWorld(seed=0, n_train=args.texts, n_eval=1, n_ood=1)
    frame = world.load("train")
    texts = render_all(backbone.tokenizer, frame["prompt"], frame["chosen"])
    seqs = method._tokenize(texts)
    tokens = sum(len(s) for s in seqs)
    order = batch_order(seqs, [0] * len(seqs), args.batch)
    batches = [method._pad([seqs[j] for j in order[i:i + args.batch]]) for i in range(0, len(seqs), args.batch)]
    k = args.members

    def pooled(hidden, mask):
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), mask.sum(1) - 1]

    @torch.no_grad()
    def extraction():
        return [pooled(body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state, mask)
                for ids, mask in batches]

    @torch.no_grad()
    def ens(mixed: bool):
        return torch.cat([method.member_rewards_ids(ids, mask, mixed) for ids, mask in batches], 1)

    @torch.no_grad()
    def peft_mixed():
        out = []
        for ids, mask in batches:
            names = [n for n in method.member_names for _ in range(ids.shape[0])]
            h = peft(input_ids=ids.repeat(k, 1), attention_mask=mask.repeat(k, 1), use_cache=False,
                     adapter_names=names).last_hidden_state
            z = pooled(h, mask.repeat(k, 1)).float().view(k, ids.shape[0], -1)
            out.append((z * method.head[:, None, :]).sum(-1))
        return torch.cat(out, 1)

    ways = {"extraction": extraction, "batched": lambda: ens(True), "sequential": lambda: ens(False),
            "PEFT mixed": peft_mixed}

    def timed(fn) -> float:
        if method.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if method.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    results = {name: fn() for name, fn in ways.items()}  # warm-up
    diff = {name: float((results[name] - results["batched"]).abs().max()) for name in ("sequential", "PEFT mixed")}
    times = {name: [] for name in ways}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits every way alike
        for name, fn in ways.items():
            times[name].append(timed(fn))
    med = {name: statistics.median(v) for name, v in times.items()}
    rate = {name: (1 if name == "extraction" else k) * tokens / med[name] for name in ways}
    print(f"model: random Qwen3 hidden={args.hidden} layers={args.layers}, K={k} LoRA r={args.rank} all-linear, "
          f"{args.texts} texts ({tokens} tokens), batch {args.batch}, device {method.device}, torch threads "
          f"{torch.get_num_threads()}")
    print("max |reward - batched reward|: " + ", ".join(f"{n} {d:.2e}" for n, d in diff.items()))
    for name in ways:
        unit = "tokens/s" if name == "extraction" else "member-tokens/s"
        print(f"{name:>11}: median {med[name] * 1e3:8.1f} ms over {args.repeats} repeats ({rate[name]:,.0f} {unit})")
    print(f"scoring speed-up batched vs sequential: {med['sequential'] / med['batched']:.2f}x; "
          f"batched vs PEFT mixed: {med['PEFT mixed'] / med['batched']:.2f}x")
    print(f"batched member-tokens/s / extraction tokens/s: {rate['batched'] / rate['extraction']:.2f} "
          f"(sequential {rate['sequential'] / rate['extraction']:.2f}, PEFT mixed "
          f"{rate['PEFT mixed'] / rate['extraction']:.2f}; 1.00 = the time of K extractions)")

    if args.train_pairs:
        pairs = SyntheticWorld(seed=1, n_train=args.train_pairs, n_eval=1, n_ood=1).load("train")
        # "one pass per member": each step runs K separate forward/backward passes of the backbone; "batched": one
        # forward and one backward of the K x 2b rows.
        train_times = {"batched": [], "sequential": []}
        for _ in range(max(1, args.repeats // 2)):
            for name, mixed in (("batched", True), ("sequential", False)):
                m = EnsLoRA(encoder=method.encoder, num_members=k, lora_rank=args.rank, lora_alpha=2 * args.rank,
                            batch_size=args.batch, mixed_adapter_training=mixed, device=args.device,
                            show_progress=False)
                train_times[name].append(m.fit(pairs).fit_summary["seconds_training"])
        tmed = {name: statistics.median(v) for name, v in train_times.items()}
        steps = -(-args.train_pairs // args.batch)
        labels = {"sequential": "one pass per member", "batched": "all members, one batched forward"}
        for name in ("sequential", "batched"):
            print(f"train, {labels[name]:<34}: median {tmed[name]:6.2f} s for {steps} steps "
                  f"({tmed[name] / steps:.3f} s/step)")
        print(f"training speed-up batched vs one pass per member: {tmed['sequential'] / tmed['batched']:.2f}x")


if __name__ == "__main__":
    main()
