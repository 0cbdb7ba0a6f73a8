"""Shared prompts run once: feature extraction, MCD-DPO's forward + backward of a DPO batch, and ENS-LoRA's training
and scoring, with each batch's distinct prompts computed once (``rewarduq_exp.models.shared_prefix``) against the
plain right-padded forward that runs every row's prompt again.

    python scripts/bench_shared_prefix.py                                       # tiny offline Qwen3, synthetic pairs
    python scripts/bench_shared_prefix.py --model smollm2-135m --dataset vader_pairs --pairs 300
    python scripts/bench_shared_prefix.py --smoke                               # a few seconds (CI)

Extraction: the pairs' 2 x pairs texts through ``FeatureEncoder`` (last token, last layer), once without prompt
sharing (batched longest first) and once with it (batched by prompt where that runs fewer positions). Training: DPO
batches of ``--dpo-batch`` pairs in the data's order (as the Trainer draws them, chosen and rejected stacked), the
summed completion log-probs (body, then the LM head on the completion positions) and their backward. Both print
texts or pairs per second, the token positions run, the speed-up measured in this run and the largest difference
of the results (features; gradients of the body), which is float rounding. ENS-LoRA: ``--lora-members`` adapters
trained one pass per member (the CPU default) for one epoch over ``--lora-pairs`` pairs, then the pairs scored,
once with prompt sharing switched off and once with it; the training loss and the rewards must agree.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs without install

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from rewarduq_exp.data.contract import render_prompt_heads  # noqa: E402
from rewarduq_exp.data.synthetic import SyntheticWorld  # noqa: E402
from rewarduq_exp.data.vader_ratings import VaderPairs  # noqa: E402
from rewarduq_exp.methods.ens_lora import EnsLoRA  # noqa: E402
from rewarduq_exp.methods.mcd_dpo import completion_logps, load_causal_lm, tokenize_completion  # noqa: E402
from rewarduq_exp.models import shared_prefix  # noqa: E402
from rewarduq_exp.models.backbone import Backbone  # noqa: E402
from rewarduq_exp.models.features import FeatureEncoder  # noqa: E402
from rewarduq_exp.models.shared_prefix import shared_prefix_hidden  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load_pairs(name: str, n: int, cache: str):
    if name == "synthetic":
        return SyntheticWorld(n_train=n, seed=0).load("train")
    return VaderPairs(cache_dir=cache, n_train=n).load("train")


def bench_extraction(backbone, frame, cache: Path) -> None:
    probe = OmegaConf.create({"layer": -1, "pooling": "last", "batch_size": 32})
    enc = FeatureEncoder(backbone, probe, cache / "features", max_length=4096, show_progress=False)
    prompts = list(frame["prompt"]) * 2
    texts = [backbone.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False)
             for p, c in zip(prompts, list(frame["chosen"]) + list(frame["rejected"]))]
    heads = render_prompt_heads(backbone.tokenizer, prompts)
    enc._extract(texts[:8], "warm-up")
    results = {}
    for way, given in (("plain", None), ("shared", heads)):
        enc.stats = {"backbone_forward_passes": 0}
        t0 = time.perf_counter()
        feats = enc._extract(texts, way, given)
        results[way] = (time.perf_counter() - t0, feats, enc.stats.get("tokens_run", 0),
                        enc.stats.get("tokens_without_sharing", 0))
    (t_plain, f_plain, _, _), (t_shared, f_shared, run, without) = results["plain"], results["shared"]
    print(f"extraction, {len(texts)} texts: plain {len(texts) / t_plain:.1f} texts/s, shared prompts "
          f"{len(texts) / t_shared:.1f} texts/s; token positions {run} of {without} "
          f"({without / max(run, 1):.2f}x fewer); speed-up {t_plain / t_shared:.2f}x; "
          f"max |difference| {(f_plain - f_shared).abs().max().item():.1e} (features up to "
          f"{f_plain.abs().max().item():.0f})", flush=True)


def dpo_batches(tokenizer, frame, pairs: int):
    """Collated [chosen; rejected] batches as TRL's DPO collator makes them (right-padded, completion mask)."""
    for s in range(0, len(frame), pairs):
        part = frame.iloc[s:s + pairs]
        rows = [tokenize_completion(tokenizer, list(p), list(c)) for side in ("chosen", "rejected")
                for p, c in zip(part["prompt"], part[side])]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        attn, comp = torch.zeros_like(ids), torch.zeros_like(ids)
        for r, (seq, start) in enumerate(rows):
            ids[r, :len(seq)], attn[r, :len(seq)], comp[r, start:len(seq)] = torch.tensor(seq), 1, 1
        yield ids, attn, comp


def bench_training(backbone, frame, pairs: int) -> None:
    lm = load_causal_lm(backbone).train()
    body = lm.get_decoder()
    batches = list(dpo_batches(backbone.tokenizer, frame, pairs))
    results = {}
    for way in ("plain", "shared"):
        stats, grads = {}, None
        t0 = time.perf_counter()
        for ids, attn, comp in batches:
            lm.zero_grad(set_to_none=True)
            if way == "plain":
                hidden = body(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
            else:
                hidden = shared_prefix_hidden(body, ids, attn, comp.argmax(1).tolist(), stats=stats)
            completion_logps(hidden, lm.lm_head, ids, comp, 64).sum().backward()
            grads = torch.cat([p.grad.flatten() for p in body.layers[0].parameters()])
        results[way] = (time.perf_counter() - t0, grads, stats)
    (t_plain, g_plain, _), (t_shared, g_shared, stats) = results["plain"], results["shared"]
    n = len(frame)
    print(f"DPO forward + backward, {n} pairs in batches of {pairs}: plain {n / t_plain:.2f} pairs/s, shared prompts "
          f"{n / t_shared:.2f} pairs/s; token positions {stats['tokens_run']} of {stats['tokens_without_sharing']}; "
          f"speed-up {t_plain / t_shared:.2f}x; max |gradient difference| (first block, last batch) "
          f"{(g_plain - g_shared).abs().max().item():.1e} of {g_plain.abs().max().item():.1e}", flush=True)


class _Encoder:  # ENS-LoRA reads only the backbone of its encoder
    def __init__(self, backbone):
        self.backbone = backbone


def bench_ens_lora(backbone, frame, members: int, batch: int) -> None:
    results = {}
    for way in ("plain", "shared"):
        original = shared_prefix.can_share
        if way == "plain":
            shared_prefix.can_share = lambda model: False
        try:
            method = EnsLoRA(encoder=_Encoder(backbone), num_members=members, batch_size=batch,
                             mixed_adapter_training=False, mixed_adapter_scoring=False, device="cpu",
                             show_progress=False)
            method.fit(frame)
            t0 = time.perf_counter()
            chosen, _ = method.score_pairs(frame)
            results[way] = (method.fit_summary["seconds_training"], time.perf_counter() - t0,
                            method.history[-1]["loss"], chosen.reward)
        finally:
            shared_prefix.can_share = original
    (train_plain, score_plain, loss_plain, r_plain), (train_shared, score_shared, loss_shared, r_shared) = (
        results["plain"], results["shared"])
    steps = -(-len(frame) // batch)
    print(f"ENS-LoRA, K={members} one pass per member, {len(frame)} pairs: training {steps} steps plain "
          f"{train_plain / steps:.2f} s/step, shared prompts {train_shared / steps:.2f} s/step, speed-up "
          f"{train_plain / train_shared:.2f}x (last loss {loss_plain:.5f} vs {loss_shared:.5f}); scoring "
          f"{2 * len(frame)} texts plain {score_plain:.1f} s, shared {score_shared:.1f} s, speed-up "
          f"{score_plain / score_shared:.2f}x; max |reward difference| {abs(r_plain - r_shared).max():.1e}",
          flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3", help="a conf/model name (tiny-qwen3, smollm2-135m)")
    parser.add_argument("--dataset", default="synthetic", choices=["synthetic", "vader_pairs"])
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--dpo-batch", type=int, default=16, help="pairs per DPO batch")
    parser.add_argument("--cache", default="outputs/cache", help="where the real model and the data are cached")
    parser.add_argument("--lora-pairs", type=int, default=64, help="ENS-LoRA pairs (0: skip)")
    parser.add_argument("--lora-members", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="24 pairs")
    args = parser.parse_args(argv)
    pairs = 24 if args.smoke else args.pairs
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) if args.model == "tiny-qwen3" else Path(args.cache)
        backbone = Backbone(OmegaConf.load(ROOT / f"conf/model/{args.model}.yaml"), cache_dir=cache, device="cpu")
        frame = load_pairs(args.dataset, pairs, args.cache)
        print(f"shared prompts, {args.model} on {backbone.device} ({torch.get_num_threads()} threads), {args.dataset}: "
              f"{len(frame)} pairs", flush=True)
        bench_extraction(backbone, frame, Path(tmp))
        bench_training(backbone, frame, min(args.dpo_batch, len(frame)))
        if args.lora_pairs:
            bench_ens_lora(backbone, frame.iloc[:min(args.lora_pairs, len(frame))], args.lora_members, 16)


if __name__ == "__main__":
    main()
