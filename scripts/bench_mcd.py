"""MC-dropout scoring of MCD-DPO: shared backbone (one body forward, K x dropout + LM head) vs K full forward passes;
and the reference log-prob pass before training: ours vs TRL's vs a plain forward of the same model.

    python scripts/bench_mcd.py                          # tiny offline Qwen3, K=20
    python scripts/bench_mcd.py --large                  # also a random Qwen3 of ~0.1B parameters (no download)

Both ways compute the same quantity (K summed completion log-probs per sequence under K dropout masks on the final
hidden states); the naive way runs the whole model K times with a dropout hook before the LM head and materialises
full (B, L, V) logits each time. Timings: median of --repeats after one warm-up, ratio from the same run.

Reference pass (summed completion log-probs, no dropout, no gradients): ours runs the body once and the LM head on the
completion positions only, in chunks (``McdDpo``'s ``compute_ref_log_probs``); TRL's asks the model patched with
its fused LM head for the completion log-probs (``labels=..., fused_lm_head=True``, what
``DPOTrainer.compute_ref_log_probs`` does: the head in tiles over the labelled positions); the plain
forward is ``model(input_ids)`` with its full (B, L, V) logits and nothing else. Printed as sequences per second.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs without install

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


def naive(model, ids, attn, comp, K, p):
    out = []
    for _ in range(K):
        h = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
        logits = model.lm_head(torch.nn.functional.dropout(h, p, training=True)).float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        out.append((lp * comp[:, 1:]).sum(-1))
    return torch.stack(out)


def shared(model, ids, attn, comp, K, p, chunk):
    from rewarduq_exp.methods.mcd_dpo import mc_completion_logps, row_generators

    h = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
    return mc_completion_logps(h, model.lm_head, ids, comp, K, p, row_generators(range(len(ids)), h.device), chunk)


def timed(fn, repeats, device):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench(name, model, vocab, batch, length, prompt_len, K, p, chunk, repeats, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, length), generator=g).to(device)
    attn = torch.ones_like(ids)
    comp = torch.zeros_like(ids)
    comp[:, prompt_len:] = 1
    with torch.no_grad():
        t_naive = timed(lambda: naive(model, ids, attn, comp, K, p), repeats, device)
        t_shared = timed(lambda: shared(model, ids, attn, comp, K, p, chunk), repeats, device)
    print(f"{name}: B={batch} L={length} completion={length - prompt_len} K={K} V={vocab}  "
          f"naive {t_naive * 1e3:.1f} ms  shared-backbone {t_shared * 1e3:.1f} ms  ratio {t_naive / t_shared:.1f}x",
          flush=True)
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model)  # as DPOTrainer does: only calls with fused_lm_head=True take the fused head
    with torch.no_grad():
        t_plain = timed(lambda: model(input_ids=ids, attention_mask=attn, use_cache=False).logits, repeats, device)
        t_trl = timed(lambda: trl_reference(model, ids, attn, comp), repeats, device)
        t_ours = timed(lambda: ours_reference(model, ids, attn, comp, chunk), repeats, device)
        diff = (trl_reference(model, ids, attn, comp) - ours_reference(model, ids, attn, comp, chunk)).abs().max()
    rate = {k: batch / t for k, t in (("plain", t_plain), ("trl", t_trl), ("ours", t_ours))}
    print(f"{name} reference pass: ours {rate['ours']:.1f} seq/s, TRL's {rate['trl']:.1f} seq/s, plain forward "
          f"{rate['plain']:.1f} seq/s  ratio ours / plain forward {t_plain / t_ours:.2f}x, ours / TRL's "
          f"{t_trl / t_ours:.2f}x (max |diff| {float(diff):.1e})", flush=True)


def trl_reference(model, ids, attn, comp):
    labels = ids.masked_fill(comp == 0, -100)
    return model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False, fused_lm_head=True
                 ).log_probs.sum(dim=1)


def ours_reference(model, ids, attn, comp, chunk):
    from rewarduq_exp.methods.mcd_dpo import completion_logps

    h = model.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    return completion_logps(h, model.lm_head, ids, comp, chunk)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--large", action="store_true", help="also a random 12-layer Qwen3 (hidden 768, vocab 32k)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()

    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from rewarduq_exp.data.registry import CONF_DIR
    from rewarduq_exp.models.backbone import resolve_device
    from rewarduq_exp.models.tiny_qwen3 import ensure_tiny_qwen3

    device = resolve_device(args.device)
    torch.manual_seed(0)
    build = dict(OmegaConf.load(CONF_DIR / "model" / "tiny-qwen3.yaml").build)
    tiny = AutoModelForCausalLM.from_pretrained(ensure_tiny_qwen3("outputs/cache", **build)).to(device).eval()
    kw = dict(K=args.samples, p=args.dropout, chunk=args.chunk, repeats=args.repeats, device=device)
    bench("tiny-qwen3", tiny, tiny.config.vocab_size, args.batch, args.length, args.length // 2, **kw)
    if args.large:
        cfg = Qwen3Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                          num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)
        large = Qwen3ForCausalLM(cfg).to(device).eval()
        bench("random-qwen3-12L-768", large, cfg.vocab_size, args.batch, args.length, args.length // 2, **kw)


if __name__ == "__main__":
    main()
