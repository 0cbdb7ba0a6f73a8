"""One RL run: a policy trained from the reference with TRL (GRPO by default, RLOO on request) on one objective, and
measured every ``eval_every`` steps against the world's gold.

**Which trainer.** GRPO (``GRPOTrainer``) and RLOO (``RLOOTrainer``) both take a reward *function* of the completions'
texts (TRL's ``reward_funcs``), which is what a trained run of this project is: any method, recalibrated or not,
through one API. Both estimate the advantage from a group of completions per prompt, so no value model is trained;
GRPO normalises within the group, RLOO takes the leave-one-out mean as the baseline. TRL's PPO needs a reward
*model* module with a value head scoring token ids and a value model beside the policy: a reward function of texts
does not fit it, and a value model would double what a CPU study trains. The KL penalty is the trainer's own ``beta``
(GRPO: the k3 estimate of the KL to the reference added to the loss per token; RLOO: beta times the KL in the reward),
0 for every objective but ``kl``.

**Measured.** At step 0 and every ``eval_every`` steps (and at the last), ``eval_samples`` fresh completions (slot j
answers topic j mod the world's topics, the same slots for every objective and seed, drawn with a seed of the RL seed
and step only: the objectives meet common random numbers) give per sample: the gold, the run's r and u, the objective's
own value, the KL to the reference (:mod:`.policy_samples`: exact per-token sums, and the log-ratio), the words and
fillers.

**Deterministic.** The trainer seeds everything from the RL seed when it is built, the evaluation samples under a
seeded stream of their own, and the reward model scores deterministically: a run repeated (a resumed study) gives the
same numbers.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd

from rewarduq_exp.downstream.rl.objectives import Objective, RunScorer
from rewarduq_exp.downstream.rl.policy_samples import sample, sequence_kl

log = logging.getLogger("rewarduq_exp")


@dataclass
class RLSettings:
    algorithm: str = "grpo"
    steps: int = 24
    eval_every: int = 6
    prompts_per_step: int = 4
    generations: int = 8
    eval_samples: int = 64
    max_tokens: int = 32
    learning_rate: float = 1e-3

    @classmethod
    def from_task(cls, task) -> RLSettings:
        return cls(**{k: task[k] for k in cls.__dataclass_fields__})

    def eval_steps(self) -> list[int]:
        return sorted({0, *range(self.eval_every, self.steps + 1, self.eval_every), self.steps})


def evaluate_policy(policy, reference, tokenizer, scorer: RunScorer, objective: Objective, world_text, topics,
                    settings: RLSettings, rl_seed: int, step: int) -> pd.DataFrame:
    """One row per evaluation slot: the measurements of the module docstring."""
    import torch

    was_training = policy.training
    policy.eval()
    prompts = [world_text.world.prompt(int(t)) for t in topics]
    try:
        found = sample(policy, tokenizer, prompts, settings.max_tokens, seed=1_000_003 * (rl_seed + 1) + step)
        kl, kl_log_ratio = sequence_kl(policy, reference, found)
    finally:
        if was_training:
            policy.train()
    with torch.no_grad():
        scores = scorer.score(prompts, found.texts, ("draws",) if scorer.has_draws else ())
    features = world_text.features(found.texts)
    no_filler = np.zeros(len(found.texts), dtype=np.int64)   # VADER's texts have no filler word: its feature is words
    return pd.DataFrame({
        "step": step, "slot": np.arange(len(topics)), "topic": topics,
        "gold": world_text.gold(topics, found.texts), "reward": scores["reward"], "u": scores["u"],
        "objective_value": scorer.objective_values(objective, prompts, found.texts, scores),
        "kl": kl.numpy(), "kl_log_ratio": kl_log_ratio.numpy(), "tokens": found.lengths.numpy(),
        "words": features["words"], "filler": features.get("filler", no_filler), "beyond": scorer.beyond(found.texts)})


def trainer_arguments(settings: RLSettings, objective: Objective, rl_seed: int, device: str, work_dir) -> dict:
    """The arguments of TRL's GRPOConfig / RLOOConfig for one RL run (``scripts/bench_rl.py`` times the same)."""
    return dict(output_dir=str(work_dir), max_steps=settings.steps,
                per_device_train_batch_size=settings.prompts_per_step * settings.generations,
                num_generations=settings.generations, max_completion_length=settings.max_tokens,
                learning_rate=settings.learning_rate, lr_scheduler_type="constant", beta=objective.kl_coef,
                temperature=1.0, top_k=0, top_p=1.0, logging_steps=1, report_to=[], save_strategy="no",
                disable_tqdm=True, seed=int(rl_seed), data_seed=int(rl_seed), use_cpu=device == "cpu",
                bf16=False, dataloader_num_workers=0,
                # TRL turns it on by default: it recomputes every forward in the backward, a cost a small policy
                # gains nothing from (the same gradients)
                gradient_checkpointing=False)


def train_policy(reference_dir, scorer: RunScorer, objective: Objective, world_text, settings: RLSettings,
                 rl_seed: int, device: str, work_dir) -> pd.DataFrame:
    """The per-slot measurements at every evaluation step of one RL run (``step`` 0 is the reference itself)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    world = world_text.world
    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    policy = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    if device != "cpu":
        reference, policy = reference.to(device), policy.to(device)
    for p in reference.parameters():
        p.requires_grad_(False)
    topics = np.arange(settings.eval_samples) % world.num_topics
    scorer.start_run()
    eval_steps = set(settings.eval_steps())
    frames = []

    def measure(step: int) -> None:
        frames.append(evaluate_policy(policy, reference, tokenizer, scorer, objective, world_text, topics, settings,
                                      rl_seed, step))

    class Measure(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in eval_steps:
                measure(state.global_step)

    def reward(prompts, completions, topic, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        return scorer.objective_values(objective, [world.prompt(int(t)) for t in topic], texts).tolist()

    reward.__name__ = objective.name
    n = settings.steps * settings.prompts_per_step
    rows = [{"prompt": world.prompt(int(t)), "topic": int(t)}
            for t in np.random.default_rng([rl_seed, 5]).integers(world.num_topics, size=n)]
    common = trainer_arguments(settings, objective, rl_seed, device, work_dir)
    if settings.algorithm == "rloo":
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer
    else:
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # TRL's trainers still call transformers' renamed gradient_checkpointing API: not the user's to fix
        warnings.filterwarnings("ignore", message=".*is deprecated", category=FutureWarning)
        trainer = Trainer(model=policy, reward_funcs=reward, args=Config(**common), processing_class=tokenizer,
                          train_dataset=Dataset.from_list(rows), callbacks=[Measure()])
        trainer.remove_callback(PrinterCallback)   # the trainer's per-step dicts stay in its log history, not stdout
        measure(0)   # the reference itself (the trainer is built: its seeding is done, the same on every repeat)
        trainer.train()
    out = pd.concat(frames, ignore_index=True)
    out.attrs["seconds"] = time.perf_counter() - t0
    return out
