"""Fake run folders in the run-folder contract, for the selection, table and figure tests.

Only what the readers look at is written: ``.hydra/config.yaml`` (a ``method`` node with interpolations as in a
real run), ``.hydra/hydra.yaml`` (the config-group choices), ``.hydra/overrides.yaml``, ``status.json``,
``metrics.json`` and, on request, a predictions table.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml
from safetensors.torch import save_file

METHOD_DEFAULTS = {
    "ens_mlp": {"_target_": "rewarduq_exp.methods.ens_mlp.EnsMLP", "num_heads": 20, "learning_rate": 1e-3,
                "reg_lambda": 0.1, "center_gamma": 0.01, "beta": 2.0, "adam_betas": [0.9, 0.999]},
    "bay_lin": {"_target_": "rewarduq_exp.methods.bay_lin.BayLin", "learning_rate": 1e-2, "reg_lambda": 1e-2,
                "beta": 0.5, "hessian": "unweighted"},
}


def block(rs: float = 0.3, ece: float = 0.02, ebce: float = 0.005, **more) -> dict:
    """One evaluation block of metrics.json with the selection metrics set and the rest plausible."""
    out = {"win_rate": 0.7, "ct_rate": 0.4, "ut_rate": 0.3, "cf_rate": 0.05, "uf_rate": 0.25, "rs_0.0": rs - 0.05,
           "rs_0.2": rs, "rs_1.0": rs - 0.1, "ece": ece, "mce": 2 * ece, "elce": ebce, "euce": ebce, "ebce": ebce,
           "brier": 0.2, "bound_width": 0.5, "n_pairs": 100}
    out.update(more)
    return out


def predictions(seed: int = 0, n: int = 200, shift: float = 0.5) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    cr, rr = rng.normal(size=n) + shift, rng.normal(size=n)
    uc, ur = rng.gamma(2.0, 0.3, n), rng.gamma(2.0, 0.3, n)
    return pd.DataFrame({
        "id": [f"p{i}" for i in range(n)], "subset": "test", "weight": 1.0,
        "chosen_reward": cr, "chosen_lower": cr - uc, "chosen_upper": cr + uc,
        "rejected_reward": rr, "rejected_lower": rr - ur, "rejected_upper": rr + ur,
    })


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def make_run(root: Path, name: str, method: str = "ens_mlp", model: str = "qwen3-0.6b", hp: dict | None = None,
             seed: int = 0, metrics: dict | None = None, state: str = "completed", *, dataset: str = "ultrafeedback",
             error: str = "RuntimeError: CUDA out of memory\nTraceback ...", with_predictions: bool = False) -> Path:
    """Write one run folder ``root/name``.

    ``hp`` overrides the method defaults (and becomes ``method.<key>=`` overrides); ``metrics`` is the content of
    metrics.json (default: one ``ultrafeedback_test`` block). ``state`` is completed | failed | invalid | running |
    interrupted | missing; missing writes no status.json and no metrics.json; invalid is a run that failed validating
    its settings; running is owned by a live process of this host (the test's parent), interrupted by a dead one. A
    completed run gets a small saved model (``model/method.json`` and a safetensors file).
    """
    hp = dict(hp or {})
    folder = Path(root) / name
    (folder / ".hydra").mkdir(parents=True, exist_ok=True)
    method_node = {**METHOD_DEFAULTS[method], **hp, "seed": "${seed}", "device": "${device}",
                   "show_progress": "${progress}"}
    config = {"model": {"name": model}, "method": method_node, "dataset": {"name": dataset, "seed": "${seed}"},
              "seed": seed, "device": "auto", "progress": False}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    choices = {"hydra": {"runtime": {"choices": {"method": method, "model": model, "dataset": dataset,
                                                 "tuned": f"{method}/{model}"}}}}
    (folder / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(choices))
    overrides = [f"method={method}", f"model={model}", *(f"method.{k}={v}" for k, v in hp.items()), f"seed={seed}"]
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))

    if state == "missing":
        return folder
    status = {"state": state, "config_hash": f"hash-{name}", "started_at": "2026-01-01T00:00:00+0000"}
    if state in ("completed", "failed", "invalid"):
        status["finished_at"] = "2026-01-01T00:10:00+0000"
    if state == "failed":
        status.update(error=error, traceback="Traceback (most recent call last): ...", stage="running")
    if state == "invalid":
        status.update(state="failed", error=error, stage="validation")
    if state in ("running", "interrupted"):
        status.update(state="running", host=socket.gethostname(),
                      pid=os.getppid() if state == "running" else dead_pid())
    (folder / "status.json").write_text(json.dumps(status))
    if state == "completed":
        (folder / "model").mkdir(exist_ok=True)
        (folder / "model" / "method.json").write_text(json.dumps({"method": method, "hyperparameters": {}}))
        save_file({"w": torch.zeros(3)}, str(folder / "model" / "state.safetensors"))
        metrics = metrics if metrics is not None else {"ultrafeedback_test": block()}
        (folder / "metrics.json").write_text(json.dumps(metrics))
        if with_predictions:
            (folder / "predictions").mkdir(exist_ok=True)
            for i, name_ in enumerate(metrics):
                predictions(seed=seed + 10 * i).to_parquet(folder / "predictions" / f"{name_}.parquet")
    return folder
