"""``python downstream.py task=rl run=<runs>``: does a reward model's uncertainty keep a policy trained on it from
overoptimizing, against the world's gold? (docs/downstream.md, "RL").

For every trained run (synthetic world): the reference policy of its world's generator (:mod:`.reference`, shared by
the runs of one generator), its samples checked against the generator; the objectives' coefficients chosen on the
selection seeds; then every objective on the report seeds (:mod:`.jobs`, :mod:`.training`); then the tables and
figures (:mod:`.analysis`, :mod:`.figures`). ``status.json`` says where the study is; the same command with
``hydra.run.dir=<the folder>`` resumes a stopped one.
"""

from __future__ import annotations

import gzip
import json
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from rewarduq_exp.core.atomic_write import write_atomic
from rewarduq_exp.core.config_dir import CONF_DIR
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.downstream.active_learning import feature_head_methods
from rewarduq_exp.downstream.overoptimization import world_settings
from rewarduq_exp.downstream.rl.jobs import Job, run_jobs
from rewarduq_exp.downstream.rl.objectives import CHOSEN, NEEDS_DRAWS, NEEDS_FEATURES
from rewarduq_exp.downstream.rl.reference import CHECK_SEED, generator_key, reference_check, train_reference
from rewarduq_exp.downstream.rl.settings import check_rl_settings
from rewarduq_exp.downstream.rl.training import RLSettings
from rewarduq_exp.downstream.rl.vader_world import check_gold_run
from rewarduq_exp.downstream.world_runs import completed_world_runs
from rewarduq_exp.runner.trained_run import run_cache_dir

log = logging.getLogger("rewarduq_exp")



def policy_config(name, run_config):
    """The policy's model config: ``conf/model/<name>.yaml``, or the run's own model when ``task.policy`` is null."""
    if name is None:
        return run_config.model
    allowed = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    if str(name) not in allowed:
        raise UserError(f"task.policy={name!r} is invalid; allowed: null (the run's model) or {', '.join(allowed)}")
    return OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")


def check_task(cfg) -> dict:
    """Every setting, before any model loads (the bounds table covers the integers)."""
    checked = check_rl_settings(cfg.task)
    policy_config(cfg.task.get("policy"), OmegaConf.create({"model": {}}))   # the name only
    return checked


def _write_status(folder: Path, **fields) -> None:
    write_atomic(folder / "status.json", json.dumps({"task": "rl", **fields}, indent=1, default=str))


def _world_config(run) -> dict:
    return OmegaConf.to_container(run.config.dataset, resolve=True)


def prepare_references(runs, cfg, out_dir: Path, device: str, show: bool) -> tuple[dict, pd.DataFrame]:
    """{run label: (reference folder, pool file)} and the reference check table (one block per reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rewarduq_exp.downstream.rl.policy_samples import sample
    from rewarduq_exp.downstream.rl.vader_world import rl_world
    from rewarduq_exp.models.backbone import Backbone

    sft = OmegaConf.to_container(cfg.task.sft, resolve=True)
    found, checks, done = {}, [], {}
    for run in runs:
        model_cfg = policy_config(cfg.task.get("policy"), run.config)
        cache = cfg.paths.get("cache_dir") or run_cache_dir(run.path, str(run.config.paths.cache_dir))
        world, text_gold = rl_world(run.config, run.path / ".hydra" / "config.yaml", cfg.task.get("gold_run"),
                                    device=device, cache_dir=cfg.paths.get("cache_dir"),
                                    batch_size=cfg.task.get("batch_size"),
                                    trust_remote_code=bool(cfg.get("trust_remote_code", False)))
        source = Backbone(model_cfg, cache_dir=cache, device="cpu").source
        key = generator_key(_world_config(run), f"{model_cfg.get('name')}:{source}", sft)
        folder = out_dir / "reference" / key
        if key not in done:
            t0 = time.perf_counter()
            train_reference(world, source, folder, sft, device, show)
            pool_file = folder / "pool.csv"
            if not pool_file.is_file():
                policy = AutoModelForCausalLM.from_pretrained(folder).eval()
                tokenizer = AutoTokenizer.from_pretrained(folder)
                topics = np.arange(int(cfg.task.check_samples)) % world.num_topics
                samples = sample(policy, tokenizer, [world.prompt(int(t)) for t in topics], int(cfg.task.max_tokens),
                                 seed=CHECK_SEED)
                write_atomic(pool_file, pd.DataFrame({"topic": topics, "text": samples.texts}).to_csv(index=False))
            pool = pd.read_csv(pool_file)
            check = reference_check(world, text_gold, pool.text.fillna("").tolist(), pool.topic.to_numpy(),
                                    world.training_feature_max())
            checks.append(check.assign(reference=key, world=int(run.config.dataset.seed),
                                       seconds=time.perf_counter() - t0))
            done[key] = (str(folder), str(pool_file))
        found[run.label] = done[key]
    return found, pd.concat(checks, ignore_index=True)


def _supported(method: str, objective: str) -> bool:
    """Whether ``objective`` can use a run of ``method``: draws (members, indices, posterior samples) for
    worst_case and filter, a feature space for knn; asked of the method's class (any head on frozen features has the
    feature space; knn and ddu have no draws, sngp draws from its posterior), never a list of names."""
    if objective in NEEDS_DRAWS:
        return method in feature_head_methods(with_draws=True)
    if objective in NEEDS_FEATURES:
        return method in feature_head_methods()
    return True


def print_plan(cfg, runs) -> dict:
    """``task.plan=true``: the plan of one RL run of the first run's policy and reward model; nothing loads."""
    from rewarduq_exp.downstream.rl.memory_plan import plan_rl
    from rewarduq_exp.runner.plan import format_plan

    run = runs[0]
    cache = cfg.paths.get("cache_dir") or run_cache_dir(run.path, str(run.config.paths.cache_dir))
    device = "cpu" if str(cfg.device) in ("auto", "cpu") else str(cfg.device)
    plan = plan_rl(cfg.task, policy_config(cfg.task.get("policy"), run.config), run.config.model, device, cache)
    print(format_plan(plan), flush=True)
    return {"plan": plan}


def rl(cfg, out_dir: Path) -> dict:
    checked = check_task(cfg)
    task = cfg.task
    show = bool(cfg.progress)
    runs = completed_world_runs(cfg.run)
    if task.get("plan"):
        return print_plan(cfg, runs)
    check_gold_run([r.config for r in runs], task.get("gold_run"))   # VADER runs: before the status and any model
    started = time.time()
    _write_status(out_dir, state="running", started=started, runs=[str(r.path) for r in runs])
    try:
        result = _study(cfg, checked, runs, out_dir, show)
    except BaseException as err:
        from rewarduq_exp.core.job_signals import TrainingInterrupted

        state = "interrupted" if isinstance(err, (TrainingInterrupted, KeyboardInterrupt)) else "failed"
        _write_status(out_dir, state=state, started=started, ended=time.time(), error=str(err)[:500])
        if isinstance(err, TrainingInterrupted):
            err.message = err.message or (f"the rl task stopped; the RL runs it finished are kept in {out_dir}/rl_runs:"
                                          f" the same command with hydra.run.dir={out_dir} resumes")
        raise
    _write_status(out_dir, state="completed", started=started, ended=time.time(),
                  seconds=time.time() - started, rl_runs=result["jobs"])
    return result


def _study(cfg, checked: dict, runs, out_dir: Path, show: bool) -> dict:
    from rewarduq_exp.downstream.rl.analysis import analyse
    from rewarduq_exp.downstream.rl.figures import plot_rl

    task = cfg.task
    device = "cpu" if str(cfg.device) == "auto" else str(cfg.device)
    if str(cfg.device) == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    references, check = prepare_references(runs, cfg, out_dir, device, show)
    write_atomic(out_dir / "reference_check.csv", check.to_csv(index=False))
    settings = tuple(sorted(vars(RLSettings.from_task(task)).items()))

    def job(run, objective: str, coef: float, seed: int, role: str) -> Job:
        if objective in ("conservative", "knn") and coef == 0:
            objective = "mean"   # k = 0 is the mean objective: the same RL run
        tags = {"method": run.record.method, **world_settings(run.config)}
        return Job(str(run.path), run.label, tuple(sorted(tags.items())), *references[run.label], objective,
                   float(coef), int(seed), role, settings, device, cfg.paths.get("cache_dir"), task.get("batch_size"),
                   bool(task.recalibrated), int(task.knn), bool(cfg.get("trust_remote_code", False)),
                   (("gold_run", str(task.gold_run)),) if task.get("gold_run") else ())

    objectives = checked["objectives"]
    select_plan = [(run, name, coef, seed) for run in runs for name in objectives if name in CHOSEN
                   and _supported(run.record.method, name) for coef in checked[CHOSEN[name]]
                   for seed in checked["select_seeds"]]
    report_count = sum(len(checked["seeds"]) * (len(checked["kl_coefs"]) if name == "kl" else 1) for run in runs
                       for name in objectives if _supported(run.record.method, name))
    bar = tqdm(total=len(select_plan) + report_count, desc="rl runs", unit="run", disable=not show)
    workers = int(task.workers)
    select_frames = run_jobs([job(*p, "select") for p in select_plan], out_dir, workers, bar)
    select = pd.concat([f.assign(objective=p[1], coef=p[2], role="select") for p, f in zip(select_plan, select_frames)],
                       ignore_index=True) if select_frames else pd.DataFrame()
    choices = choose_coefficients(select)
    report_plan = []
    for run in runs:
        for name in objectives:
            if not _supported(run.record.method, name):
                continue
            if name in CHOSEN:
                coefs = [choices.get((run.label, name), 0.0)]
            elif name == "kl":
                coefs = [c for c in checked["kl_coefs"] if c > 0]
            else:
                coefs = [0.0]
            report_plan += [(run, name, coef, seed) for coef in coefs for seed in checked["seeds"]]
    report_frames = run_jobs([job(*p, "report") for p in report_plan], out_dir, workers, bar)
    bar.close()
    report = pd.concat([f.assign(objective=p[1], coef=p[2], role="report") for p, f in zip(report_plan, report_frames)],
                       ignore_index=True)
    samples = pd.concat([select, report], ignore_index=True)
    write_atomic(out_dir / "samples.csv.gz", gzip.compress(samples.to_csv(index=False).encode(), mtime=0))
    tables = analyse(samples, choices_table(select, choices), int(task.draws), int(task.seed))
    for name, table in tables.items():
        write_atomic(out_dir / f"{name}.csv", table.to_csv(index=False))
    plot_rl(tables, out_dir)
    from rewarduq_exp.downstream.rl.analysis import summary_lines

    for line in summary_lines(tables, check):
        print(line, flush=True)
    print(f"tables and figures in {out_dir}", flush=True)
    return {**tables, "reference_check": check, "jobs": len(select_plan) + len(report_plan)}


def _final_gold(select: pd.DataFrame) -> pd.DataFrame:
    last = select[select.step == select.step.max()]
    return last.groupby(["run", "objective", "coef"], as_index=False).gold.mean()


def choose_coefficients(select: pd.DataFrame) -> dict:
    """{(run, objective): the coefficient whose policies end with the highest mean gold on the selection seeds
    (the smallest on a tie)}."""
    if select.empty:
        return {}
    found = {}
    for (run, name), group in _final_gold(select).groupby(["run", "objective"]):
        best = group.gold.max()
        found[(run, name)] = float(group[group.gold >= best - 1e-12].coef.min())
    return found


def choices_table(select: pd.DataFrame, choices: dict) -> pd.DataFrame:
    if select.empty:
        return pd.DataFrame(columns=["run", "objective", "coef", "final_gold", "chosen"])
    table = _final_gold(select).rename(columns={"gold": "final_gold"})
    table["chosen"] = [choices.get((r, o)) == c for r, o, c in zip(table.run, table.objective, table.coef)]
    return table
