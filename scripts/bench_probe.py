"""Suffix-only probing (BoRP section 3.4): hidden states for N suffixes per conversation with the prefix's KV cache
reused (both layouts of rewarduq_exp.models.prefix_cache: packed and repeat) vs every prefix + suffix run from
scratch, in one run, for N = 2, 4, 8.

    python scripts/bench_probe.py                        # hidden 512, 4 layers, 8 conversations of 256-512 tokens
    python scripts/bench_probe.py --device cuda --dtype bfloat16 --hidden 2048 --layers 8 --conversations 64
    python scripts/bench_probe.py --threads 1            # on a shared CPU: stable timings
    python scripts/bench_probe.py --smoke                # a few seconds: CI checks that it runs
    python scripts/bench_probe.py --model-path DIR       # any local causal LM (e.g. SmolLM2-135M-Instruct)

The backbone is the offline tiny Qwen3 built with a larger config (random weights: the timing does not depend on
them), so that long prefixes dominate the cost as real conversations do, or, with ``--model-path``, any local causal
LM checkpoint (transformers format; its chat template may add a default system prompt, which the suffix leaves out).
Prefixes are random token ids of lengths
drawn uniformly from [--min-prefix, --max-prefix]; the N suffixes are a short BoRP probe rendered with N different
polarity words (a user turn + generation prefix + answer, ~30-40 tokens, about what the generic probe is with the
Qwen3 tokenizer). Both paths use the same batching (the same
conversations per forward) and read the same two layers (an intermediate one and the last).

Throughput is counted in *logical* tokens, sum over (prefix, suffix) of L + s, per second, so the speed-up is the
ratio of the two rates; the ideal speed-up is the ratio of token positions computed, N (L + s) / (L + N s) (exact
sums over the conversations), and "fraction of ideal" is the measured speed-up over it. The largest absolute
difference between the two paths' hidden states is printed as a check (tests assert it, not this script).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from rewarduq_exp.methods.borp import ProbeTemplate
from rewarduq_exp.models import prefix_cache
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.runner.cli import fail

POLARITY_WORDS = ["Excellent", "Terrible", "Good", "Bad", "Great", "Poor", "Fine", "Awful", "Superb", "Weak",
                  "Perfect", "Useless", "Solid", "Mediocre", "Brilliant", "Broken"]


def build_backbone(args) -> Backbone:
    if args.model_path:
        if not Path(args.model_path).is_dir():
            fail(f"--model-path {args.model_path} is not a folder with a checkpoint (config.json, weights, tokenizer)")
        cfg = OmegaConf.create({"name": Path(args.model_path).name, "hub_id": None, "revision": None,
                                "path": str(args.model_path), "dtype": args.dtype, "trust_remote_code": False})
        return Backbone(cfg, cache_dir=args.cache_dir, device=args.device)
    cfg = OmegaConf.create({
        "name": "bench-qwen3", "builder": "tiny-qwen3", "hub_id": None, "revision": None, "path": None,
        "dtype": args.dtype, "hidden_size": args.hidden, "trust_remote_code": False, "keep_dtype_on_cpu": False,
        "build": {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": args.heads,
                  "num_kv_heads": args.heads, "seed": 0, "vocab_size": 2048, "attention_temperature": 0.01},
    })
    return Backbone(cfg, cache_dir=args.cache_dir, device=args.device)


def timed(fn, sync, repeats: int) -> tuple[float, torch.Tensor]:
    """Median wall time of ``repeats`` calls and the last result."""
    times, out = [], None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--min-prefix", type=int, default=256)
    parser.add_argument("--max-prefix", type=int, default=512)
    parser.add_argument("--suffixes", type=int, nargs="+", default=[2, 4, 8], help="values of N")
    parser.add_argument("--batch-size", type=int, default=32, help="(prefix, suffix) rows per forward, both paths")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path (median)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--cache-dir", default="outputs/cache", help="where the benchmark model is built once")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; on a shared machine 1 "
                        "gives stable timings, as other processes' load makes spinning OpenMP threads wait)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (CI)")
    parser.add_argument("--model-path", type=Path, help="a local causal LM checkpoint instead of the built model")
    args = parser.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.conversations = 64, 2, 4, 4
        args.min_prefix, args.max_prefix, args.suffixes, args.repeats = 24, 40, [2], 1
        args.threads = args.threads or 1
    if max(args.suffixes) > len(POLARITY_WORDS):
        parser.error(f"--suffixes: at most {len(POLARITY_WORDS)}")

    if args.threads:
        torch.set_num_threads(args.threads)
    backbone = build_backbone(args)
    tok = backbone.tokenizer
    model = backbone.load_encoder()
    device = backbone.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_prefix, args.max_prefix + 1, (args.conversations,), generator=gen).tolist()
    first = len(tok.all_special_ids)
    prefixes = [torch.randint(first, len(tok), (n,), generator=gen).tolist() for n in lengths]
    # Short wording: the tiny byte-level tokenizer splits English into ~3x more tokens than Qwen3's does, and the
    # generic probe is ~35 Qwen3 tokens; this one is about that long here.
    template = ProbeTemplate(instruction="Was the user satisfied?", answer="Performance: {polarity}")
    layers = [max(1, args.layers // 2), -1]
    pad = tok.pad_token_id
    threads = f", torch threads {torch.get_num_threads()}" if device.type == "cpu" else ""
    if args.model_path:
        args.hidden, args.layers = int(model.config.hidden_size), prefix_cache.num_layers_of(model)
        layers = [max(1, args.layers // 2), -1]
    print(f"device: {device}{threads}; model: {backbone.name}, hidden {args.hidden}, {args.layers} layers, "
          f"{backbone.dtype}; "
          f"{args.conversations} conversations, prefix L {min(lengths)}-{max(lengths)} (mean "
          f"{statistics.mean(lengths):.0f}); layers {layers}; batch {args.batch_size} rows; median of {args.repeats}")
    header = (f"{'N':>3} {'s':>4} {'full tok/s':>10} {'repeat tok/s':>12} {'packed tok/s':>12} {'repeat':>7} "
              f"{'packed':>7} {'ideal':>6} {'fraction of ideal (repeat, packed)':>35} {'max|diff|':>9}")
    print(header)
    for n in args.suffixes:
        suffixes = prefix_cache.tokenize_pieces(tok, [template.suffix(tok, w) for w in POLARITY_WORDS[:n]])
        s_total = sum(len(s) for s in suffixes)
        logical = sum(n * length + s_total for length in lengths)          # sum over pairs of L + s
        computed = sum(length + s_total for length in lengths)             # L + sum of s, per prefix
        kw = dict(pad_id=pad, batch_size=args.batch_size)
        runs = {
            "full": lambda: prefix_cache.full_recompute(model, prefixes, suffixes, layers, **kw),
            "repeat": lambda: prefix_cache.suffix_states(model, prefixes, suffixes, layers, mode="repeat", **kw),
            "packed": lambda: prefix_cache.suffix_states(model, prefixes, suffixes, layers, mode="packed", **kw),
        }
        if not prefix_cache.packed_supported(model):
            runs.pop("packed")
        for fn in runs.values():
            fn()  # warm-up (allocator, kernels)
        seconds, states = {}, {}
        for name, fn in runs.items():
            seconds[name], states[name] = timed(fn, sync, args.repeats)
        ideal = logical / computed
        speed = {k: seconds["full"] / seconds[k] for k in runs if k != "full"}
        diff = max((states[k] - states["full"]).abs().max().item() for k in speed)
        rate = {k: f"{logical / seconds[k]:.0f}" if k in seconds else "-" for k in ("full", "repeat", "packed")}
        up = {k: f"{speed[k]:.2f}x" if k in speed else "-" for k in ("repeat", "packed")}
        frac = ", ".join(f"{speed[k] / ideal:.2f}" if k in speed else "-" for k in ("repeat", "packed"))
        print(f"{n:>3} {s_total / n:>4.0f} {rate['full']:>10} {rate['repeat']:>12} {rate['packed']:>12} "
              f"{up['repeat']:>7} {up['packed']:>7} {ideal:>5.2f}x {frac:>35} {diff:>9.1e}")
    print("tok/s = sum over (prefix, suffix) of (L + s) per second; speed-up = full recompute time / prefix-reuse "
          "time; ideal = N (L + s) / (L + N s); fraction of ideal = speed-up / ideal (the ideal counts token "
          "positions; attention grows with (L + s)^2 per sequence, so on long prefixes the speed-up can exceed it)")


if __name__ == "__main__":
    main()
