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
every strategy starts from the same one and retrains with the same model seed. Pool and eval features come from the
disk feature cache (the runs' own training features already are there), so a round costs a head fit, not a
backbone pass.

The comparison with random is therefore PAIRED by repeat: a repeat's initial set moves every strategy's curve
together, so the spread of the levels over repeats says little about the gap between strategies. For each metric of
``SUMMARISED`` and each ``kind`` (``final``: the last round; ``auc``: the mean over rounds), ``summary.csv`` holds
the mean over repeats (``<metric>_<kind>``) and, for every strategy but random, the paired differences
d_r = strategy - random of the same run and repeat: their mean (``<metric>_<kind>_vs_random``), the 95 % paired
t-interval mean ± t_{0.975, R-1} sd(d_r) / sqrt(R) (``..._vs_random_lo`` / ``..._vs_random_hi``; NaN for R < 2),
the two-sided paired t-test p-value (``..._vs_random_p``) and ``<metric>_<kind>_higher``, "k/R": the repeats where
the strategy's value is higher than random's (d_r > 0) out of those with both values, whichever way is better (for
the win rate higher is better, for ECE worse); ``repeats`` counts the repeats averaged over.
Random's own row has NaN there, and without random in ``task.strategies`` these columns are absent.
``paired.csv`` is the long table of every d_r (run, method, strategy, metric, kind, repeat, value, random, diff);
``active_learning.png`` draws the levels (band: min..max over repeats) over the paired differences per round
(band: 95 % paired t-interval), see :mod:`.active_learning_figure`.

Scores here are raw, never recalibrated (``task.recalibrated`` may only be false): a run's ``calibration.json``
(its temperature T and interval scale s) was fitted to the model trained on the run's whole training set, and every
round here trains a new model on a few hundred pairs, whose scale and spread of u differ; applying the run's T and s
to it would be wrong, and refitting one per round would need a calibration split held out of the labelled pairs the
strategies compete for. Nor would one T and s per model change an acquisition: uncertainty and ranking_score rank
pairs by u and by |margin| / (beta u), which they rescale alike, and BALD reads the posterior's draws.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from rewarduq_exp.analysis.text_tables import DASH, fmt_number, text_table
from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.checks import check_positive
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.registry import build
from rewarduq_exp.data.synthetic import SPLITS
from rewarduq_exp.downstream.overoptimization import world_settings
from rewarduq_exp.downstream.statistics import over_worlds_interval, paired_t_interval
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
KINDS = ("final", "auc")  # the last round; the mean over rounds (area under the learning curve)
PAIRED_COLUMNS = ("run", "method", "strategy", "metric", "kind", "repeat", "value", "random", "diff")


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
    beta = check_positive(float(method.beta), "method.beta")
    u_sum = chosen.u + rejected.u
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
    recalibrated = task.get("recalibrated", False)
    if recalibrated is not False:
        shown = str(recalibrated).lower() if isinstance(recalibrated, bool) else repr(recalibrated)
        raise UserError(f"task.recalibrated={shown} is invalid for active learning: allowed: "
                        "false (each round retrains the model, and a run's calibration.json was fitted to the run's "
                        "own model, not to these)")
    if str(task.eval_split) not in SPLITS:
        raise UserError(f"task.eval_split={task.eval_split} is invalid; allowed: {', '.join(SPLITS)}")
    return strategies


def check_learner(method, label: str, strategies: list[str]) -> None:
    """Refuse, before any work, a learner this task cannot retrain cheaply or that lacks the draws bald needs."""
    if not isinstance(method, FeatureHeadMethod):
        raise UserError(f"task=active_learning retrains the learner every round and supports the heads on frozen "
                        f"backbone features ({', '.join(feature_head_methods())}); {label} is not one")
    if "bald" in strategies and type(method)._sample_features is FeatureHeadMethod._sample_features:
        raise UserError(f"task.strategies includes bald, which needs draws of the model; {label} has none "
                        f"({', '.join(feature_head_methods(with_draws=True))} have): drop bald or that run")


def feature_head_methods(with_draws: bool = False) -> list[str]:
    """The reward methods that are heads on frozen features (that give draws of the model: ``with_draws``)."""
    from rewarduq_exp.methods.registry import method_class, method_names

    out = []
    for name in method_names():
        cls = method_class(name)
        if issubclass(cls, FeatureHeadMethod) and (not with_draws or
                                                    cls._sample_features is not FeatureHeadMethod._sample_features):
            out.append(name)
    return out


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


def check_pool(run: WorldRun, task, n_train: int | None = None):
    """The run's world, once ``task.pool`` is known to fit its training pairs: ``n_train`` counted, else the size its
    config sets (``dataset.n_train``: checked before anything is read, downloaded or loaded)."""
    world = world_of(run.config, run.path / ".hydra" / "config.yaml")
    have = n_train if n_train is not None else getattr(world, "sizes", {}).get("train")
    if isinstance(have, int) and have < int(task.pool):
        raise UserError(f"task.pool={task.pool} exceeds the {have} training pairs of {run.label} "
                        f"({run.path}); lower task.pool to at most {have} or train the run on more pairs "
                        "(dataset.n_train)")
    return world


def pool_and_eval(run: WorldRun, task) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The run's pool (the first ``task.pool`` training pairs of its world) and eval pairs; one line when the
    world holds fewer training pairs than ``task.pool``."""
    world = check_pool(run, task)
    train = world.load("train")
    check_pool(run, task, len(train))   # a world whose size its config does not set (all of a corpus)
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


def repeat_values(curves: pd.DataFrame) -> pd.DataFrame:
    """Long table of each run, strategy and repeat: every metric of ``SUMMARISED`` at the run's last round
    (``kind=final``) and its mean over rounds (``kind=auc``)."""
    metrics = [m for m in SUMMARISED if m in curves.columns]
    keys = ["run", "method", "strategy", "repeat"] if "method" in curves.columns else ["run", "strategy", "repeat"]
    frames = []
    for _, part in curves.groupby("run", sort=False):
        last = part[part["round"] == part["round"].max()]
        for kind, rows in (("final", last), ("auc", part)):
            per = rows.groupby(keys, sort=False)[metrics].mean().reset_index()  # auc: one row per round
            frames.append(per.melt(id_vars=keys, var_name="metric", value_name="value").assign(kind=kind))
    return pd.concat(frames, ignore_index=True)


def paired_differences(values: pd.DataFrame) -> pd.DataFrame | None:
    """Every strategy but random against random of the same run and repeat (``values`` from
    :func:`repeat_values`): ``diff`` = value - random, the d_r of the paired comparison. None without random."""
    if "random" not in set(values.strategy):
        return None
    keys = ["run", "repeat", "metric", "kind"]
    base = values.loc[values.strategy == "random", [*keys, "value"]].rename(columns={"value": "random"})
    paired = values[values.strategy != "random"].merge(base, on=keys, how="left")
    paired["diff"] = paired["value"] - paired["random"]
    return paired[[c for c in PAIRED_COLUMNS if c in paired.columns]]


def summary_rows(curves: pd.DataFrame, paired: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per run and strategy: each metric at the last round and its mean over rounds (area under the learning
    curve), averaged over repeats, and for every strategy but random the paired difference to random (mean over
    repeats, 95 % paired t-interval, p-value, repeats higher); see the module's docstring. ``paired``: the
    :func:`paired_differences` of ``curves`` when already computed."""
    values = repeat_values(curves)
    if paired is None:
        paired = paired_differences(values)
    metrics = list(dict.fromkeys(values.metric))
    means = values.groupby(["run", "strategy", "metric", "kind"], sort=False)["value"].mean()
    compared = {}
    if paired is not None:
        for key, part in paired.groupby(["run", "strategy", "metric", "kind"], sort=False):
            iv = paired_t_interval(part["diff"].to_numpy())
            compared[key] = {"_vs_random": float(iv.mean), "_vs_random_lo": float(iv.lo),
                             "_vs_random_hi": float(iv.hi), "_vs_random_p": float(iv.p),
                             "_higher": f"{int(iv.wins)}/{int(iv.n)}" if iv.n else np.nan}   # wins: d > 0
    columns = ["run", "strategy", "labels_final", "repeats"]
    columns += [f"{m}_{kind}" for m in metrics for kind in KINDS]
    if paired is not None:
        columns += [f"{m}_{kind}{suffix}" for kind in KINDS for m in metrics
                    for suffix in ("_vs_random", "_vs_random_lo", "_vs_random_hi", "_vs_random_p", "_higher")]
    rows = []
    for (run, strategy), part in curves.groupby(["run", "strategy"], sort=False):
        end = part[part["round"] == part["round"].max()]
        row = {"run": run, "strategy": strategy, "labels_final": int(end["labels"].iloc[0]),
               "repeats": int(part["repeat"].nunique())}
        for m in metrics:
            for kind in KINDS:
                row[f"{m}_{kind}"] = float(means[(run, strategy, m, kind)])
                for suffix, value in compared.get((run, strategy, m, kind), {}).items():
                    row[f"{m}_{kind}{suffix}"] = value
        rows.append(row)
    return pd.DataFrame(rows).reindex(columns=columns)


def _versus_random(row, metric: str, kind: str) -> str:
    """``+0.046 [+0.031, +0.061] 3/3``: the mean paired difference, its interval (one repeat: none) and the repeats
    where the strategy's value is higher than random's."""
    mean = row.get(f"{metric}_{kind}_vs_random", np.nan)
    if pd.isna(mean):
        return DASH
    text = f"{mean:+.3f}"
    if pd.notna(row[f"{metric}_{kind}_vs_random_lo"]):
        text += f" [{row[f'{metric}_{kind}_vs_random_lo']:+.3f}, {row[f'{metric}_{kind}_vs_random_hi']:+.3f}]"
    return f"{text} {row[f'{metric}_{kind}_higher']}"


def summary_table(summary: pd.DataFrame) -> str:
    """The printed summary: per run and strategy, win rate and calibration (truth/ece where the world has it, else
    ece) at the last round, and the paired differences to random with their 95 % intervals and the repeats where
    the strategy's value is higher (the win rate's also averaged over rounds); the rest is in summary.csv."""
    cal = "truth/ece" if summary.get("truth/ece_final", pd.Series(dtype=float)).notna().any() else "ece"
    header = ["run", "strategy", "labels", "win_rate", "win_rate - random", "win_rate auc - random", cal,
              f"{cal} - random"]
    rows = [[r.run, r.strategy, str(r.labels_final), fmt_number(r["win_rate_final"], 3),
             _versus_random(r, "win_rate", "final"), _versus_random(r, "win_rate", "auc"),
             fmt_number(r[f"{cal}_final"], 3), _versus_random(r, cal, "final")] for _, r in summary.iterrows()]
    note = ("'- random': the mean over repeats of strategy - random within each repeat [its 95 % paired t-interval] "
            "and k/R: in how many of the R repeats the strategy's value is higher than random's (for the win rate "
            "better, for ECE worse); final: the last round, auc: the mean over rounds; p-values in "
            "summary.csv")
    return f"{text_table(header, rows)}\n{note}"


def active_learning(cfg, out_dir: Path) -> dict:
    strategies = check_settings(cfg.task)
    runs = completed_world_runs(cfg.run)
    for r in runs:   # the pool against each world's size, before any learner, data or model
        check_pool(r, cfg.task)
    # A sweep folder may hold fine-tuning runs too: they are left out (said in the log), not an error, as long as
    # some run remains; a learner that lacks what a strategy needs is an error before any work.
    makers = {r.label: _learner(r, cfg) for r in runs}
    learners = [r for r in runs if isinstance(makers[r.label](0), FeatureHeadMethod)]
    for r in runs:
        if r not in learners:
            log.warning("skipping %s: active learning retrains the heads on frozen features only (%s)", r.label,
                        ", ".join(feature_head_methods()))
    for r in learners or runs[:1]:  # none left: the first run's refusal says why
        check_learner(makers[r.label](0), r.label, strategies)
    data = {r.label: pool_and_eval(r, cfg.task) for r in learners}  # every pool checked before any training
    curves = pd.concat([learning_curves(r, cfg, strategies, makers[r.label], *data[r.label]) for r in learners],
                       ignore_index=True)
    from rewarduq_exp.downstream.active_learning_figure import plot_active_learning  # matplotlib, when drawn

    paired = paired_differences(repeat_values(curves))
    summary = summary_rows(curves, paired)
    worlds = {r.label: world_settings(r.config)["world"] for r in learners}
    summary.insert(1, "world", summary.run.map(worlds))
    summary.insert(2, "worlds", summary.groupby(summary.run.map({r.label: r.record.method for r in learners}))
                   .world.transform("nunique").astype(int))
    over = over_worlds_rows(summary, {r.label: r.record.method for r in learners})
    if paired is None:  # no random to pair with: the header alone
        paired = pd.DataFrame(columns=list(PAIRED_COLUMNS))
    write_atomic(out_dir / "curves.csv", curves.to_csv(index=False))
    write_atomic(out_dir / "summary.csv", summary.to_csv(index=False))
    write_atomic(out_dir / "paired.csv", paired.to_csv(index=False))
    write_atomic(out_dir / "over_worlds.csv", over.to_csv(index=False))
    plot_active_learning(curves, out_dir / "active_learning.png")
    print(summary_table(summary), flush=True)
    if not over.empty:
        print("over worlds (each run's paired difference to random, mean over the worlds, 95 % t-interval over "
              "them):", *over_worlds_lines(over), sep="\n", flush=True)
    print(f"learning curves, summary, paired differences and figure in {out_dir}", flush=True)
    return {"curves": curves, "summary": summary, "paired": paired, "over_worlds": over}


def over_worlds_rows(summary: pd.DataFrame, methods: dict) -> pd.DataFrame:
    """Where a method's runs span two worlds or more: per method, strategy, metric and kind, the mean over worlds of
    the runs' paired differences to random (``<metric>_<kind>_vs_random``; runs of one world averaged first) with
    the t-interval over the worlds (:func:`~.statistics.over_worlds_interval`), ``worlds`` and ``per_world``. A
    run's own interval (over its repeats) is about its world; this row is about the world generator."""
    rows = []
    columns = [c for c in summary.columns if c.endswith("_vs_random")]
    frame = summary.assign(method=summary.run.map(methods))
    for (method, strategy), part in frame.groupby(["method", "strategy"], sort=False):
        if part.world.nunique() < 2:
            continue
        by_world = part.groupby("world", sort=True)[columns].mean()
        for column in columns:
            values = by_world[column].to_numpy(float)
            if not np.isfinite(values).any():
                continue
            found = over_worlds_interval(values)
            rows.append({"method": method, "strategy": strategy, "statistic": column,
                         "worlds": int(np.isfinite(values).sum()), "estimate": found.estimate, "lo": found.lo,
                         "hi": found.hi, "note": found.note,
                         "per_world": ",".join(f"{w}:{v:+.3f}" for w, v in zip(by_world.index, values)
                                               if np.isfinite(v))})
    return pd.DataFrame(rows, columns=["method", "strategy", "statistic", "worlds", "estimate", "lo", "hi", "note",
                                       "per_world"])


def over_worlds_lines(over: pd.DataFrame) -> list[str]:
    return [f"{r.method} {r.strategy} {r.statistic.removesuffix('_vs_random')} - random over {r.worlds} worlds: "
            f"{r.estimate:+.3f} [{r.lo:+.3f}, {r.hi:+.3f}]" + (f" (no level promised: {r.note})" if r.note else "")
            for r in over.itertuples()]
