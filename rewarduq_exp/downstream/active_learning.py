"""``python downstream.py task=active_learning run=<runs>``: does uncertainty pick better pairs to label?

Each run is the template of a learner (its method, hyperparameters, backbone, probe and world). Starting from
``task.initial`` labelled pairs drawn at random from a pool (the first ``task.pool`` pairs of the world's training
split: the synthetic world's Bradley-Terry labels, or a VADER run's own training pairs, labelled by the crowd's
ratings), each round retrains the method from scratch on the labelled pairs, scores the eval split (win rate against
the labels, ECE and, in the synthetic world, ECE against the true preference probability, ``truth/ece``; human data
has no such truth, so it is NaN there) and acquires ``task.batch`` more pairs from the pool by a strategy:

- ``random``: uniformly at random (the baseline);
- ``uncertainty``: the widest margin interval, u(chosen) + u(rejected);
- ``bald``: the largest mutual information between the label and the model (Houlsby et al. 2011),
  H[mean_s p_s] - mean_s H[p_s] with p_s = sigmoid(margin under draw s): ensemble members (ENS-MLP) or Laplace
  posterior samples (BAY-LIN), the same draw for both completions of a pair;
- ``ranking_score``: the pairs RS_alpha counts as uncertain (overlapping bounds, |margin| < beta (u_c + u_r)),
  most overlapping first: the smallest |margin| / (beta (u_c + u_r)).

Every strategy reads only what is known before labelling and is symmetric in the two completions, so the pool's
chosen/rejected order (the label) never leaks into the choice. Repeats differ in the initial set; within a repeat
every strategy starts from the same one. Pool and eval features come from the disk feature cache (the runs' own
training features already are there), so a round costs a head fit, not a backbone pass.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from rewarduq_exp.analysis.text_tables import fmt_number, text_table
from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.registry import build
from rewarduq_exp.data.synthetic import SPLITS
from rewarduq_exp.downstream.figures import plot_active_learning
from rewarduq_exp.downstream.world_runs import WorldRun, completed_world_runs, world_of
from rewarduq_exp.methods.base import FeatureHeadMethod
from rewarduq_exp.methods.registry import METHOD_CLASSES
from rewarduq_exp.metrics.rewarduq import compute_metrics
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.features import FeatureEncoder
from rewarduq_exp.runner.evaluation import score_method
from rewarduq_exp.runner.trained_run import run_cache_dir, run_method_settings, run_model_config

log = logging.getLogger("rewarduq_exp")
STRATEGIES = ("random", "uncertainty", "bald", "ranking_score")
REPORTED = ("win_rate", "truth/ece", "ece", "rs_0.2")
SUMMARISED = ("win_rate", "truth/ece", "ece")


def _entropy(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return -(p * np.log(p) + (1 - p) * np.log1p(-p))


def bald_scores(chosen_samples: np.ndarray, rejected_samples: np.ndarray) -> np.ndarray:
    """Mutual information between a pair's label and the model, from (S, n) reward draws of both completions."""
    p = 0.5 * (1.0 + np.tanh(0.5 * (chosen_samples - rejected_samples)))  # sigmoid of each draw's margin
    return _entropy(p.mean(0)) - _entropy(p).mean(0)


def acquisition_scores(strategy: str, method, frame: pd.DataFrame, rng: np.random.Generator) -> np.ndarray:
    """Higher = label first. Symmetric in chosen/rejected (the pool's order is the unseen label)."""
    if strategy == "random":
        return rng.random(len(frame))
    if strategy == "bald":
        samples = method.pair_reward_samples(frame)
        return bald_scores(*samples)
    chosen, rejected = method.score_pairs(frame)
    beta = float(method.beta)
    u_sum = (chosen.upper - chosen.reward + rejected.upper - rejected.reward) / beta
    if strategy == "uncertainty":
        return u_sum
    margin = np.abs(chosen.reward - rejected.reward)
    return -margin / np.maximum(beta * u_sum, 1e-12)  # ranking_score: < -1 means the bounds do not overlap


def check_settings(task) -> list[str]:
    strategies = [str(s) for s in task.strategies]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise UserError(f"task.strategies={strategies} is invalid; allowed: {', '.join(STRATEGIES)}")
    for key, minimum in (("initial", 2), ("batch", 1), ("rounds", 0), ("repeats", 1), ("pool", 2)):
        check_positive(task[key], f"task.{key}", integer=True, minimum=minimum, inclusive=True)
    needed = int(task.initial) + int(task.rounds) * int(task.batch)
    if needed > int(task.pool):
        raise UserError(f"task.initial + task.rounds * task.batch = {needed} exceeds task.pool={task.pool}")
    if str(task.eval_split) not in SPLITS:
        raise UserError(f"task.eval_split={task.eval_split} is invalid; allowed: {', '.join(SPLITS)}")
    return strategies


def check_learner(method, label: str, strategies: list[str]) -> None:
    """Refuse, before any work, a learner this task cannot retrain cheaply or that lacks the draws bald needs."""
    if not isinstance(method, FeatureHeadMethod):
        raise UserError(f"task=active_learning retrains the learner every round and supports frozen-backbone "
                        f"methods (ens_mlp, bay_lin); {label} is not one")
    if "bald" in strategies and type(method)._sample_features is FeatureHeadMethod._sample_features:
        raise UserError(f"task.strategies includes bald, which needs draws of the model; {label} has none "
                        "(ENS-MLP and BAY-LIN have): drop bald or that run")


def _learner(run: WorldRun, cfg):
    """A fresh, untrained method built from the run's config (its settings, ``task.method`` on top), reading
    features through the disk cache of the run (or ``paths.cache_dir``). The run's config is a file someone may
    have handed over: the class comes from the method registry by name, the run's settings are checked (settings of
    that method, plain values), and a backbone asking for remote code needs ``trust_remote_code=true``."""
    rc = run.config
    config_path = run.path / ".hydra" / "config.yaml"
    name, settings = run_method_settings(rc, config_path)
    model_cfg = run_model_config(rc, config_path, trust_remote_code=cfg.get("trust_remote_code", False))
    cache = Path(cfg.paths.cache_dir) if cfg.paths.get("cache_dir") else run_cache_dir(run.path,
                                                                                        str(rc.paths.cache_dir))
    backbone = Backbone(model_cfg, cache_dir=cache, device=str(cfg.device))
    encoder = FeatureEncoder(backbone, rc.probe, cache / "features", int(rc.max_length), show_progress=False)
    # The _target_ is the registry's, never the run's; task.method is the user's own command line.
    method_cfg = OmegaConf.merge({"_target_": METHOD_CLASSES[name]}, settings, cfg.task.get("method") or {},
                                 {"show_progress": False, "device": str(cfg.device)})

    def make(seed: int):
        return build(OmegaConf.merge(method_cfg, {"seed": int(seed)}), "method", encoder=encoder)

    return make


def pool_and_eval(run: WorldRun, task) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The run's pool (the first ``task.pool`` training pairs of its world) and eval pairs; one line when the
    world holds fewer training pairs than ``task.pool``."""
    world = world_of(run.config, run.path / ".hydra" / "config.yaml")
    train = world.load("train")
    if len(train) < int(task.pool):
        raise UserError(f"task.pool={task.pool} exceeds the {len(train)} training pairs of {run.label} "
                        f"({run.path}); lower task.pool to at most {len(train)} or train the run on more pairs "
                        "(dataset.n_train)")
    return train.iloc[: int(task.pool)].reset_index(drop=True), world.load(str(task.eval_split))


def learning_curves(run: WorldRun, cfg, strategies: list[str], make, pool: pd.DataFrame,
                    evaluation: pd.DataFrame) -> pd.DataFrame:
    """The learning curves of ``make`` (seed -> fresh method built from the run) under every strategy, acquiring
    from ``pool`` and scored on ``evaluation``."""
    task = cfg.task
    rows = []
    total = int(task.repeats) * len(strategies) * (int(task.rounds) + 1)
    bar = tqdm(total=total, desc=f"active learning {run.label}", disable=not bool(cfg.progress))
    for repeat in range(int(task.repeats)):
        start = np.random.default_rng([int(task.seed), repeat]).choice(len(pool), int(task.initial), replace=False)
        for strategy in strategies:
            rng = np.random.default_rng([int(task.seed), repeat, STRATEGIES.index(strategy)])
            labelled = list(start)
            for round_ in range(int(task.rounds) + 1):
                method = make(int(task.seed) + repeat).fit(pool.iloc[labelled])
                metrics = compute_metrics(score_method(method, evaluation), alphas=(0.2,))
                rows.append({"run": run.label, "method": run.record.method, "strategy": strategy,
                             "repeat": repeat, "round": round_, "labels": len(labelled),
                             **{m: metrics.get(m, np.nan) for m in REPORTED}})
                bar.update()
                if round_ == int(task.rounds):
                    break
                rest = np.setdiff1d(np.arange(len(pool)), labelled)
                scores = acquisition_scores(strategy, method, pool.iloc[rest], rng)
                if scores is None or not np.isfinite(scores).all():
                    raise UserError(f"acquisition by {strategy} gave no finite scores for {run.label}")
                labelled += rest[np.argsort(-scores, kind="stable")[: int(task.batch)]].tolist()
    bar.close()
    return pd.DataFrame(rows)


def summary_rows(curves: pd.DataFrame) -> pd.DataFrame:
    """Per run and strategy: each metric at the last round and its mean over rounds (area under the learning
    curve), averaged over repeats, and the difference to random."""
    last = curves[curves["round"] == curves["round"].max()]
    rows = []
    for (run, strategy), part in curves.groupby(["run", "strategy"], sort=False):
        end = last[(last.run == run) & (last.strategy == strategy)]
        row = {"run": run, "strategy": strategy, "labels_final": int(end["labels"].iloc[0])}
        for m in SUMMARISED:
            row[f"{m}_final"] = float(end[m].mean())
            row[f"{m}_auc"] = float(part.groupby("round")[m].mean().mean())
        rows.append(row)
    table = pd.DataFrame(rows)
    for m in [f"{m}_{kind}" for kind in ("final", "auc") for m in SUMMARISED]:
        base = table[table.strategy == "random"].set_index("run")[m] if "random" in set(table.strategy) else None
        if base is not None:
            table[f"{m}_vs_random"] = table[m] - table.run.map(base)
    return table


def active_learning(cfg, out_dir: Path) -> dict:
    strategies = check_settings(cfg.task)
    runs = completed_world_runs(cfg.run)
    # A sweep folder may hold fine-tuning runs too: they are left out (said in the log), not an error, as long as
    # some run remains; a learner that lacks what a strategy needs is an error before any work.
    makers = {r.label: _learner(r, cfg) for r in runs}
    learners = [r for r in runs if isinstance(makers[r.label](0), FeatureHeadMethod)]
    for r in runs:
        if r not in learners:
            log.warning("skipping %s: active learning retrains frozen-backbone methods (ens_mlp, bay_lin) only",
                        r.label)
    for r in learners or runs[:1]:  # none left: the first run's refusal says why
        check_learner(makers[r.label](0), r.label, strategies)
    data = {r.label: pool_and_eval(r, cfg.task) for r in learners}  # every pool checked before any training
    curves = pd.concat([learning_curves(r, cfg, strategies, makers[r.label], *data[r.label]) for r in learners],
                       ignore_index=True)
    summary = summary_rows(curves)
    write_atomic(out_dir / "curves.csv", curves.to_csv(index=False))
    write_atomic(out_dir / "summary.csv", summary.to_csv(index=False))
    plot_active_learning(curves, out_dir / "active_learning.png")
    cols = [c for c in summary.columns if c not in ("run", "strategy")]
    print(text_table(["run", "strategy", *cols],
                     [[r.run, r.strategy, *(fmt_number(r[c], 4) for c in cols)] for _, r in summary.iterrows()]),
          flush=True)
    print(f"learning curves, summary and figure in {out_dir}", flush=True)
    return {"curves": curves, "summary": summary}
