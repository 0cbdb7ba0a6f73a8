"""Time the RL loop of ``downstream.py task=rl`` on the tiny offline model: TRL's GRPOTrainer trains the tiny-qwen3
policy against a reward function that scores completions with the project's reward model (an untrained ENS-MLP head
on tiny-qwen3 features, through :class:`RunScorer` as :mod:`rewarduq_exp.downstream.rl.training` does; scoring cost
does not depend on training).

    python scripts/bench_rl.py                      # 24 steps, 4 prompts x 8 generations, 32 tokens (RLSettings)
    python scripts/bench_rl.py --steps 8 --generations 16 --max-tokens 64
    python scripts/bench_rl.py --smoke              # 3 steps of 2 x 2 completions, 8 tokens: a few seconds

The policy is the tiny checkpoint itself (random init: its completions mostly run to ``--max-tokens``, the longest a
step generates). One warm-up step (the first calls of generate, backward and the optimizer) runs before the
``--steps`` timed ones and is left out of every number. Prints (1) RL steps per second; (2) the share of a step
(on_step_begin to on_step_end) spent scoring with the reward model (timed inside the reward function), generating
(the policy's ``generate``, timed around it) and the rest (TRL's batching and decoding, log-probs, loss, backward,
optimizer); (3) the reward model's time as the trainer calls it (one call per step's batch of completions) against
scoring every text the reward function saw in one call, on a fresh in-memory feature store so no cache hit flatters
it: the lower bound. TRL's own ``profiling/Time taken`` timings go only to wandb, mlflow or trackio, not to the log
history, hence the timers here. The scoring comparison is also replayed after training, per step and in one batch
alternately (``--repeats`` times, the best of each kept), so both ways meet the same machine load.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch
from omegaconf import OmegaConf

from rewarduq_exp.data.registry import CONF_DIR
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.downstream.rl.objectives import Objective, RunScorer
from rewarduq_exp.downstream.rl.training import RLSettings, trainer_arguments
from rewarduq_exp.methods.ens_mlp import EnsMLP
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.features import FeatureEncoder
from rewarduq_exp.models.memory_features import MemoryFeatures


def make_method(backbone: Backbone, probe) -> EnsMLP:
    """Untrained heads on a fresh in-memory store (as scripts/bench_downstream.py)."""
    method = EnsMLP(encoder=FeatureEncoder(backbone, probe, MemoryFeatures(2**31), 2048, show_progress=False),
                    device="cpu", show_progress=False)
    method._build(int(backbone.cfg.hidden_size))
    return method


def make_scorer(backbone: Backbone, probe, world) -> RunScorer:
    """The training path's scorer (RunScorer) around a fresh untrained method, without a calibration."""
    return RunScorer(SimpleNamespace(method=make_method(backbone, probe), calibration=None), world, knn=10,
                     recalibrated=False)


def time_scoring(backbone: Backbone, probe, world, batches: list[tuple[list, list[str]]]) -> float:
    """Seconds to score ``batches`` (prompts, texts), one call each, on a fresh scorer (empty in-memory store)."""
    scorer = make_scorer(backbone, probe, world)
    t0 = time.perf_counter()
    for prompts, texts in batches:
        scorer.objective_values(Objective("mean"), prompts, texts)
    return time.perf_counter() - t0


def run_grpo(policy_dir: str, scorer: RunScorer, world, settings: RLSettings, work_dir: str) -> dict:
    """One warm-up step, then ``settings.steps`` timed GRPO steps, as training.train_policy builds them (objective
    ``mean``, no evaluation): the wall time of the timed steps (from the warm-up's end to the end of ``train()``),
    and per timed step its time, its scoring and generation time, and the prompts and texts the reward scored."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    objective = Objective("mean")
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    keys = ("step", "scoring", "generate", "calls", "texts", "prompts")
    timing = {k: [] for k in keys}
    current = {}
    warm_end = []

    generate = policy.generate

    @functools.wraps(generate)
    def timed_generate(*args, **kwargs):   # the trainer calls the unwrapped policy's generate (no vLLM on a CPU)
        t0 = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            current["generate"] += time.perf_counter() - t0

    policy.generate = timed_generate

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.update(scoring=0.0, generate=0.0, calls=0, texts=[], prompts=[], t0=time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if state.global_step == 1:   # the warm-up: first calls of generate, backward, the optimizer
                warm_end.append(now)
                return
            current["step"] = now - current["t0"]
            for key in keys:
                timing[key].append(current[key])

    def reward(prompts, completions, topic, **kwargs) -> list[float]:   # training.py's reward function, timed
        t0 = time.perf_counter()
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        prompts = [world.prompt(int(t)) for t in topic]
        out = scorer.objective_values(objective, prompts, texts).tolist()
        current["scoring"] += time.perf_counter() - t0
        current["calls"] += 1
        current["texts"] += texts
        current["prompts"] += prompts
        return out

    reward.__name__ = objective.name
    n = (settings.steps + 1) * settings.prompts_per_step
    rows = [{"prompt": world.prompt(int(t)), "topic": int(t)}
            for t in np.random.default_rng([0, 5]).integers(world.num_topics, size=n)]
    # the study's own trainer arguments, one warm-up step more
    arguments = trainer_arguments(settings, objective, 0, "cpu", work_dir)
    config = GRPOConfig(**arguments | {"max_steps": settings.steps + 1})
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list(rows), callbacks=[StepTimer()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    timing["wall"] = time.perf_counter() - warm_end[0]
    return timing


def main() -> None:
    defaults = RLSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--generations", type=int, default=defaults.generations)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--repeats", type=int, default=2, help="timings of the scoring comparison (the best kept)")
    parser.add_argument("--smoke", action="store_true", help="3 steps of 2 prompts x 2 generations, 8 tokens, 1 repeat")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.prompts_per_step, args.generations, args.max_tokens, args.repeats = 3, 2, 2, 8, 1
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    if args.generations < 2:
        parser.error("--generations must be >= 2 (GRPO normalises within a prompt's group)")
    settings = RLSettings(steps=args.steps, prompts_per_step=args.prompts_per_step, generations=args.generations,
                          max_tokens=args.max_tokens)

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model_cfg = OmegaConf.load(CONF_DIR / "model" / "tiny-qwen3.yaml")
    probe = OmegaConf.load(CONF_DIR / "probe" / "last_token.yaml")
    world = SyntheticWorld(n_train=8, n_eval=8, n_ood=8)
    with tempfile.TemporaryDirectory() as cache:
        backbone = Backbone(model_cfg, cache_dir=cache, device="cpu")
        policy_dir = backbone.source   # the tiny checkpoint (ensure_tiny_qwen3 under the temp cache): the policy
        scorer = make_scorer(backbone, probe, world)
        # loads the backbone's weights, outside every timing (a text no policy writes: no cache hit later)
        scorer.objective_values(Objective("mean"), [world.prompt(0)], ["warm up"])
        timing = run_grpo(policy_dir, scorer, world, settings, str(cache) + "/trainer")

        per_step = list(zip(timing["prompts"], timing["texts"]))
        prompts = [p for step in timing["prompts"] for p in step]
        texts = [t for step in timing["texts"] for t in step]
        replayed, one_batch = [], []
        for _ in range(args.repeats):   # alternated, each on a fresh store: every text is a backbone pass again
            replayed.append(time_scoring(backbone, probe, world, per_step))
            one_batch.append(time_scoring(backbone, probe, world, [(prompts, texts)]))
        t_replay, t_one = min(replayed), min(one_batch)

    steps = len(timing["step"])
    step, scoring, generate = (float(np.sum(timing[k])) for k in ("step", "scoring", "generate"))
    rest = step - scoring - generate
    print(f"GRPO on tiny-qwen3 (CPU, {torch.get_num_threads()} threads): {steps} timed steps after 1 warm-up step, "
          f"{settings.prompts_per_step} prompts x {settings.generations} generations, up to {settings.max_tokens} "
          "tokens; reward: untrained ENS-MLP on tiny-qwen3 features")
    print(f"  steps/s: {steps / timing['wall']:.3f} ({timing['wall']:.2f} s for {steps} steps; "
          f"{step / steps:.3f} s per step from on_step_begin to on_step_end, median {np.median(timing['step']):.3f} s, "
          f"slowest {max(timing['step']):.3f} s)")
    print("  share of a step's time:")
    print(f"    scoring (reward model):                                       {100 * scoring / step:5.1f}%  "
          f"({scoring / steps:.3f} s per step)")
    print(f"    generating (policy.generate):                                 {100 * generate / step:5.1f}%  "
          f"({generate / steps:.3f} s per step)")
    print(f"    rest (TRL's batching, log-probs, loss, backward, optimizer): {100 * rest / step:5.1f}%  "
          f"({rest / steps:.3f} s per step)")
    calls = int(np.sum(timing["calls"]))
    print(f"reward model on the {len(texts)} completions the reward function saw in the timed steps:")
    best = f"best of {args.repeats}"
    print(f"  per step, as the trainer calls it ({calls} calls, in the loop): {scoring:8.3f} s "
          f"({len(texts) / scoring:.0f} texts/s)")
    print(f"  per step, replayed after training (fresh store, {best}):  {t_replay:8.3f} s "
          f"({len(texts) / t_replay:.0f} texts/s)")
    print(f"  all in one batch (fresh store, {best}; the lower bound):   {t_one:8.3f} s "
          f"({len(texts) / t_one:.0f} texts/s)")
    print(f"ratio: per-step scoring / one-batch scoring = {scoring / t_one:.2f}x "
          f"(replayed per step / one batch, same conditions: {t_replay / t_one:.2f}x)")

if __name__ == "__main__":
    main()
