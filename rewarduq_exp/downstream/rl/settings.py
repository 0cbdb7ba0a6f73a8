"""``task=rl``'s settings, checked on the command line's config before any model loads: one line each."""

from __future__ import annotations

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.downstream.rl.objectives import CHOSEN, OBJECTIVES

ALGORITHMS = ("grpo", "rloo")


def _number_list(task, key: str, minimum: float = 0.0, allow_empty: bool = False) -> list[float]:
    values = task.get(key)
    shown = f"task.{key}={values!r}"
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        values = [values]
    try:
        out = [float(v) for v in values]
        if any(isinstance(v, bool) for v in values):
            raise TypeError
    except (TypeError, ValueError):
        raise UserError(f"{shown} is invalid: must be a list of numbers >= {minimum:g}") from None
    if (not out and not allow_empty) or not all(np.isfinite(v) and v >= minimum for v in out):
        raise UserError(f"{shown} is invalid: must be a non-empty list of finite numbers >= {minimum:g}")
    return sorted(set(out))


def _seed_list(task, key: str) -> list[int]:
    values = task.get(key)
    values = [values] if isinstance(values, int) and not isinstance(values, bool) else values
    try:
        ok = all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31 for v in values) and len(values)
    except TypeError:
        ok = False
    if not ok:
        raise UserError(f"task.{key}={task.get(key)!r} is invalid: must be a non-empty list of integers in [0, 2^31)")
    return list(dict.fromkeys(int(v) for v in values))


def check_rl_settings(task) -> dict:
    """Every task=rl setting that the bounds table does not cover (lists, names, relations), as plain values."""
    objectives = task.get("objectives")
    objectives = [objectives] if isinstance(objectives, str) else objectives
    try:
        names = [str(o) for o in objectives]
    except TypeError:
        names = []
    bad = [n for n in names if n not in OBJECTIVES]
    if not names or bad:
        raise UserError(f"task.objectives={task.get('objectives')!r} is invalid: must be a non-empty list of "
                        f"{', '.join(OBJECTIVES)}")
    if str(task.get("algorithm")) not in ALGORITHMS:
        raise UserError(f"task.algorithm={task.get('algorithm')!r} is invalid; allowed: {', '.join(ALGORITHMS)}")
    lr = task.get("learning_rate")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (0 < float(lr) <= 1):
        raise UserError(f"task.learning_rate={lr!r} is invalid: must be a number in (0, 1]")
    sft_lr = task.sft.get("lr")
    if isinstance(sft_lr, bool) or not isinstance(sft_lr, (int, float)) or not (0 < float(sft_lr) <= 1):
        raise UserError(f"task.sft.lr={sft_lr!r} is invalid: must be a number in (0, 1]")
    if int(task.eval_every) > int(task.steps):
        raise UserError(f"task.eval_every={task.eval_every} is invalid: must be at most task.steps ({task.steps}), "
                        "or the policy is measured only at its start and end")
    if not isinstance(task.get("recalibrated"), bool):
        raise UserError(f"task.recalibrated={task.get('recalibrated')!r} is invalid: must be true or false")
    out = {"objectives": list(dict.fromkeys(names)), "seeds": _seed_list(task, "seeds"),
           "select_seeds": _seed_list(task, "select_seeds"),
           "kl_coefs": _number_list(task, "kl_coefs", 0.0)}
    for grid in set(CHOSEN.values()):
        out[grid] = _number_list(task, grid, 0.0)
    if set(out["seeds"]) & set(out["select_seeds"]):
        raise UserError(f"task.select_seeds={out['select_seeds']} and task.seeds={out['seeds']} share a seed: the "
                        "coefficients must be chosen on seeds that are not reported")
    if "kl" in out["objectives"] and not [c for c in out["kl_coefs"] if c > 0]:
        raise UserError(f"task.kl_coefs={task.get('kl_coefs')!r} is invalid for the kl objective: give at least one "
                        "coefficient > 0")
    return out
