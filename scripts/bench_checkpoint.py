"""What a training checkpoint costs: the time of one save against one training step (ENS-LoRA, MCD-DPO on the tiny
model, measured), and the size of a checkpoint at the paper's backbones (computed from their parameter counts).

    python scripts/bench_checkpoint.py                 # tiny model, K=4 adapters, 64 pairs
    python scripts/bench_checkpoint.py --smoke         # seconds: the CI smoke run

Each method is fit twice in the same process on the same data: once with no checkpoint, once saving after every
step (``checkpoint.every_steps=1``, the most expensive schedule; the default saves every 30 minutes). A save is timed
where it happens (``Phase.save``: tensors to CPU, safetensors file, rename); a step is the plain fit's training time
divided by its steps. The sizes count what a checkpoint holds: the trainable weights and AdamW's two moments, float32
(12 bytes per trainable parameter; BAY-LIN's Laplace Hessian is computed after training, from the cached
features, and is not part of it), for Qwen3 shapes built on the meta device (no weights, no download).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path


def measure(fit, steps_of, directory: Path) -> dict:
    """Fit once plainly and once with a checkpoint after every step; the median save against the mean step."""
    from rewarduq_exp.core import training_checkpoint
    from rewarduq_exp.core.training_checkpoint import Phase, TrainingCheckpoints

    fit()   # warm-up: first calls (kernels, TRL's imports) are not what a step costs
    t0 = time.perf_counter()
    method = fit()
    plain = time.perf_counter() - t0
    steps = steps_of(method)
    saves: list[float] = []
    original = Phase.save

    def timed(self, tensors, meta):
        seconds = original(self, tensors, meta)
        saves.append(seconds)
        return seconds

    Phase.save = timed
    try:
        with training_checkpoint.activate(TrainingCheckpoints(directory, "bench", every_steps=1)):
            t0 = time.perf_counter()
            fit()
            with_saves = time.perf_counter() - t0
    finally:
        Phase.save = original
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    saves.sort()
    return {"steps": steps, "step_s": method.fit_summary["seconds_training"] / steps,
            "save_s": saves[len(saves) // 2] if saves else float("nan"), "saves": len(saves),
            "overhead": with_saves / plain - 1, "bytes": size}


def paper_sizes() -> list[tuple[str, str, float]]:
    """(backbone, method, checkpoint GB) from the parameter counts of the Qwen3 shapes."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shapes = {  # the published Qwen3 configs (hidden, intermediate, layers, heads, kv heads, tied embeddings)
        "Qwen3-0.6B": (1024, 3072, 28, 16, 8, True),
        "Qwen3-1.7B": (2048, 6144, 28, 16, 8, True),
        "Qwen3-4B": (2560, 9728, 36, 32, 8, True),
        "Qwen3-8B": (4096, 12288, 36, 32, 8, False),
    }
    rows = []
    for name, (hidden, inter, layers, heads, kv, tied) in shapes.items():
        cfg = Qwen3Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=tied)
        with torch.device("meta"):
            model = Qwen3ForCausalLM(cfg)
        total = sum(p.numel() for p in model.parameters())
        # LoRA r=16 on every Linear of the body (all-linear): r * (in + out) per Linear, K=8 members, + K heads.
        lora = sum(16 * (m.in_features + m.out_features) for n, m in model.model.named_modules()
                   if isinstance(m, torch.nn.Linear))
        rows += [(name, "MCD-DPO (full model)", total * 12 / 1e9),
                 (name, "ENS-LoRA (K=8, r=16)", 8 * (lora + hidden) * 12 / 1e9),
                 (name, "ENS-MLP (K=20 heads)", 20 * (128 * hidden + 16768) * 12 / 1e9),
                 (name, "BAY-LIN (MAP head)", hidden * 12 / 1e9)]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    args = parser.parse_args()
    if args.smoke:
        args.pairs, args.members = 16, 2
    os.environ.setdefault("TQDM_DISABLE", "1")

    import torch
    from omegaconf import OmegaConf

    from rewarduq_exp.data.synthetic import SyntheticWorld
    from rewarduq_exp.methods.ens_lora import EnsLoRA
    from rewarduq_exp.methods.mcd_dpo import McdDpo
    from rewarduq_exp.models.backbone import Backbone

    root = Path(__file__).resolve().parents[1]
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    try:
        backbone = Backbone(OmegaConf.load(root / "conf" / "model" / "tiny-qwen3.yaml"), cache_dir=work / "cache",
                            device="cpu")

        class Encoder:
            def __init__(self, backbone):
                self.backbone = backbone

        train = SyntheticWorld(seed=0, n_train=args.pairs, n_eval=8, n_ood=8).load("train")

        def ens_lora():
            torch.manual_seed(0)
            return EnsLoRA(encoder=Encoder(backbone), num_members=args.members, batch_size=8, seed=0, device="cpu",
                           show_progress=False).fit(train)

        def mcd_dpo():
            torch.manual_seed(0)
            return McdDpo(encoder=Encoder(backbone), batch_size=8, micro_batch_size=8, num_samples=2, seed=0,
                          device="cpu", show_progress=False).fit(train)

        rows = [("ENS-LoRA", measure(ens_lora, lambda m: m.fit_summary["steps"], work / "ens_lora")),
                ("MCD-DPO", measure(mcd_dpo, lambda m: m.fit_summary["optimizer_steps"], work / "mcd_dpo"))]
        print(f"tiny Qwen3, {args.pairs} pairs, batch 8, CPU "
              f"({torch.get_num_threads()} threads)")
        print(f"{'method':10} {'steps':>5} {'step s':>8} {'save s':>8} {'save/step':>9} {'fit overhead':>12} "
              f"{'checkpoint MB':>13}")
        for name, r in rows:
            print(f"{name:10} {r['steps']:5d} {r['step_s']:8.4f} {r['save_s']:8.4f} {r['save_s'] / r['step_s']:9.2f} "
                  f"{r['overhead']:12.1%} {r['bytes'] / 1e6:13.2f}")
        print("ratio: one checkpoint save / one training step (above); with the default schedule (every 30 minutes) "
              "a run saves a few times an hour")
        if not args.smoke:
            print("\ncheckpoint size at the paper's backbones (trainable float32 weights + AdamW moments):")
            for backbone_name, method, gb in paper_sizes():
                print(f"  {backbone_name:11} {method:22} {gb * 1e3:12.1f} MB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
