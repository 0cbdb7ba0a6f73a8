"""The reference policy: a causal LM fine-tuned (SFT, TRL's ``SFTTrainer``) on the world's own best-of-n candidates,
so that KL = 0 means "the pool best-of-n draws from", and checked against that generator.

The world's candidate generator (:meth:`SyntheticWorld.candidates`: words from the training distribution, a rare,
heavy-tailed share stuffed with the filler) is a distribution over texts; the reference is the policy that imitates it.
One is trained per generator and policy (the worlds of one seed at every filler strength share their generator:
the strength only changes the training *labels*), into the task folder, and reused by every objective and RL seed,
and by a resumed call. :func:`reference_check` compares its samples with fresh draws of the generator: the gold's mean,
sd and quantiles, the length, the filler count and the share beyond the training range (``reference_check.csv``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import ks_2samp

from rewarduq_exp.core.atomic_write import atomic_dir

log = logging.getLogger("rewarduq_exp")

SFT_SEED = 31_337       # the candidates the reference imitates: a stream of their own, apart from best-of-n's (seed 0)
CHECK_SEED = 41_414     # fresh generator draws for the check


def generator_key(world_config: dict, policy_identity: str, sft: dict) -> str:
    """Identifies a reference: the world's generator settings (not its labels), the policy and the SFT settings."""
    generator = {k: v for k, v in world_config.items()
                 if k not in {"filler_bias", "length_bias", "n_train", "n_eval", "n_ood", "n_cal", "name",
                              "train_split", "eval_splits", "_target_"}}
    blob = json.dumps({"generator": generator, "policy": policy_identity, "sft": sft}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def sft_examples(world, n: int, seed: int = SFT_SEED) -> list[dict]:
    per_prompt = max(1, int(np.ceil(n / world.num_topics)))
    c = world.candidates("eval", world.num_topics, per_prompt, seed=seed)
    drawn = min(len(group) for group in c.texts)   # a world may hold fewer (VADER's smallest corpus)
    examples = [{"prompt": c.prompts[p], "completion": [{"role": "assistant", "content": group[i]}]}
                for i in range(drawn) for p, group in enumerate(c.texts)]
    return examples[:n]


def train_reference(world, source: str, folder: Path, sft: dict, device: str, progress: bool) -> Path:
    """SFT of the policy at ``source`` on the generator's candidates into ``folder`` (atomically); kept if there."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import SFTConfig, SFTTrainer

    if not progress:   # datasets' own bars (tokenising the SFT examples) follow the task's progress setting
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    examples = sft_examples(world, int(sft["examples"]))
    tokenizer = AutoTokenizer.from_pretrained(source)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(sft["seed"]))
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        with atomic_dir(folder) as tmp, warnings.catch_warnings():
            # TRL's trainers still pass transformers' renamed settings (gradient_checkpointing): not the user's to fix
            warnings.filterwarnings("ignore", message=".*is deprecated", category=FutureWarning)
            if int(sft["steps"]) == 0:   # no SFT: the policy itself (a Trainer would read max_steps=0 as one step)
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                return folder
            config = SFTConfig(output_dir=str(tmp / "trainer"), max_steps=int(sft["steps"]),
                               per_device_train_batch_size=int(sft["batch_size"]), learning_rate=float(sft["lr"]),
                               lr_scheduler_type="cosine", warmup_steps=0, logging_steps=max(1, int(sft["steps"]) // 5),
                               save_strategy="no", report_to=[], seed=int(sft["seed"]), data_seed=int(sft["seed"]),
                               use_cpu=device == "cpu", disable_tqdm=not progress, completion_only_loss=True,
                               dataloader_num_workers=0, bf16=False)
            trainer = SFTTrainer(model=model, args=config, processing_class=tokenizer,
                                 train_dataset=Dataset.from_list(examples))
            trainer.remove_callback(PrinterCallback)
            trainer.train()
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            log.info("reference policy: SFT of %d steps on %d generator candidates, loss %.3f -> %.3f",
                     int(sft["steps"]), len(examples), losses[0] if losses else float("nan"),
                     losses[-1] if losses else float("nan"))
            trainer.model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            import shutil

            shutil.rmtree(tmp / "trainer", ignore_errors=True)
    return folder


def reference_check(world, text_gold, samples_texts: list[str], topics: np.ndarray, train_max: dict,
                    seed: int = CHECK_SEED) -> pd.DataFrame:
    """The reference's samples against as many fresh draws of the generator (same topics): one row per statistic
    with both values, and the two-sample Kolmogorov-Smirnov statistic and p-value of the gold and each feature."""
    n = len(samples_texts)
    per_topic = max(1, int(np.ceil(n / world.num_topics)))
    c = world.candidates("eval", world.num_topics, per_topic, seed=seed)
    gen_texts = [t for group in c.texts for t in group]
    gen_topics = np.repeat(c.topic, [len(group) for group in c.texts])
    gen = {"gold": text_gold.gold(gen_topics, gen_texts), **{k: v.astype(float) for k, v in
                                                             text_gold.features(gen_texts).items()}}
    ref = {"gold": text_gold.gold(topics, samples_texts), **{k: v.astype(float) for k, v in
                                                             text_gold.features(samples_texts).items()}}
    rows = []
    for name in gen:
        a, b = ref[name], gen[name]
        ks = ks_2samp(a, b)
        rows.append({"statistic": name, "reference_mean": a.mean(), "generator_mean": b.mean(),
                     "reference_sd": a.std(ddof=1), "generator_sd": b.std(ddof=1),
                     "reference_q10": np.quantile(a, 0.1), "generator_q10": np.quantile(b, 0.1),
                     "reference_q90": np.quantile(a, 0.9), "generator_q90": np.quantile(b, 0.9),
                     "ks": float(ks.statistic), "ks_p": float(ks.pvalue), "n_reference": a.size, "n_generator": b.size})
        if name in train_max:
            rows[-1]["reference_beyond_train"] = float((a > train_max[name]).mean())
            rows[-1]["generator_beyond_train"] = float((b > train_max[name]).mean())
    return pd.DataFrame(rows)
