"""MCD-DPO data-parallel training (torchrun / accelerate launch / a multi-task Slurm job) averages the gradients.

The Trainer wraps the policy in DDP, but MCD-DPO's loss calls the unwrapped body and LM head, so DDP's reducer never
runs; the method averages the gradients itself. Two forked ranks (gloo on CPU, as ``torchrun --nproc_per_node 2``)
must hold the very same weights after training, and their training must be the one-process training on the same
global batches.

How the batches line up: both runs draw the same global order of pairs (accelerate's seedable sampler, seeded by the
method's seed). One process takes micro-batches 0, 1, 2, ... of that order and accumulates 4 per optimizer step; under
two processes rank r takes micro-batches r, r + 2, r + 4, ... and accumulates 2, so optimizer step s of both runs sees
micro-batches 4s .. 4s + 3. 20 pairs in micro-batches of 2 give 10 micro-batches: steps of 4, 4 and 2 (the last one is
the epoch's end, where the Trainer steps with fewer micro-batches). Dropout is 0 for the comparison with one process:
the ranks draw their own masks (seed + rank), which one process cannot reproduce.

This file is also the script each rank runs (``__main__`` below), in the fork server's children of ``run_ranks``.
"""

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from entry_points import run_ranks

GRAD = "grad."
SETTINGS = {"learning_rate": 1e-3, "dpo_beta": 0.1, "dropout": 0.0, "num_samples": 2, "batch_size": 8,
            "micro_batch_size": 2, "num_epochs": 1, "device": "cpu", "show_progress": False, "score_batch_size": 8,
            "logprob_chunk": 16, "seed": 0, "max_grad_norm": 1.0}
N_PAIRS, STEPS = 20, 3


def _grad_recorder(store: dict):
    """A callback keeping every optimizer step's gradients as the optimizer sees them: after the average over the
    processes and after clipping (so averaging after clipping would show as a difference from one process)."""
    from transformers import TrainerCallback

    class GradRecorder(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            for name, p in model.named_parameters():
                store[f"{GRAD}{state.global_step}.{name}"] = p.grad.detach().clone()

    return GradRecorder()


def train_and_save(cache_dir: str, out: Path) -> None:
    """Train the tiny model's MCD-DPO on ``N_PAIRS`` synthetic pairs and write this process's trained weights, its
    recorded gradients (``rank<r>.safetensors``) and its history (``rank<r>.json``) to ``out``."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    from rewarduq_exp.core import distributed
    from rewarduq_exp.data.synthetic import SyntheticWorld
    from rewarduq_exp.methods.mcd_dpo import McdDpo
    from rewarduq_exp.models.backbone import Backbone

    distributed.setup("cpu")
    root = Path(__file__).resolve().parents[1]
    backbone = Backbone(OmegaConf.load(root / "conf" / "model" / "tiny-qwen3.yaml"), cache_dir=cache_dir, device="cpu")
    grads: dict[str, torch.Tensor] = {}

    class Recording(McdDpo):
        def _make_trainer(self, train, output_dir):
            trainer = super()._make_trainer(train, output_dir)
            trainer.add_callback(_grad_recorder(grads))
            return trainer

    method = Recording(encoder=types.SimpleNamespace(backbone=backbone), **SETTINGS)
    method.fit(SyntheticWorld(n_train=N_PAIRS, n_eval=4, n_ood=4).load("train"))
    weights = {name: p.detach().clone() for name, p in method.policy.named_parameters()}
    r = distributed.rank()
    save_file({**weights, **grads}, str(out / f"rank{r}.safetensors"))
    (out / f"rank{r}.json").write_text(json.dumps({"history": method.history, "summary": method.fit_summary,
                                                   "world_size": distributed.world_size()}))


def _load(path: Path) -> tuple[dict, dict, dict]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    grads = {k: v for k, v in tensors.items() if k.startswith(GRAD)}
    weights = {k: v for k, v in tensors.items() if not k.startswith(GRAD)}
    return weights, grads, json.loads(path.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def runs(tiny_backbone, tmp_path_factory):
    """(one process, rank 0, rank 1): each a (weights, gradients, record) triple."""
    one, two = tmp_path_factory.mktemp("one_process"), tmp_path_factory.mktemp("two_processes")
    train_and_save(str(tiny_backbone.cache_dir), one)        # in this process, as a plain `python train.py` does
    proc = run_ranks(Path(__file__), [str(tiny_backbone.cache_dir), str(two)], two, nprocs=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return _load(one / "rank0.safetensors"), _load(two / "rank0.safetensors"), _load(two / "rank1.safetensors")


def test_both_ranks_end_with_the_same_weights_and_gradients(runs):
    _, (w0, g0, rec0), (w1, g1, rec1) = runs
    assert rec0["world_size"] == rec1["world_size"] == 2
    assert rec0["summary"]["optimizer_steps"] == rec1["summary"]["optimizer_steps"] == STEPS
    assert w0.keys() == w1.keys() and g0.keys() == g1.keys()
    assert len(g0) == STEPS * len(w0)     # every parameter, every optimizer step
    for name in g0:   # every step: the one averaged gradient, bit for bit (each rank's own differ by ~5e-2)
        assert torch.equal(g0[name], g1[name]), name
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name


def test_two_processes_train_as_one_process_on_the_same_global_batches(runs, tiny_backbone):
    (w, g, rec), (w2, g2, rec2), _ = runs
    assert g.keys() == g2.keys()
    for step in range(STEPS):
        names = [k for k in g if k.startswith(f"{GRAD}{step}.")]
        one, two = torch.cat([g[k].flatten() for k in names]), torch.cat([g2[k].flatten() for k in names])
        # clipping was active (max_grad_norm 1: the recorded gradients are the clipped ones), so the average came
        # before the clip, as in one process
        assert one.norm().item() == pytest.approx(1.0, rel=1e-4)
        # the same gradient up to the order of float sums (micro-batch losses / 4 summed vs / 2 summed and halved):
        # ~1e-6 of the largest component; each rank's own gradient is off by ~1
        assert (two - one).abs().max().item() <= 1e-4 * one.abs().max().item(), f"step {step}"
    # AdamW's first steps are ~lr * sign(gradient), so a gradient component near 0 may move by up to ~lr on a
    # rounding difference: the weights are compared as updates (without the average, the ranks' weights differ from
    # one process's by about as much as the whole update)
    from transformers import AutoModelForCausalLM

    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_backbone.source).named_parameters())
    update = torch.cat([(w[k] - initial[k].detach()).flatten() for k in w])
    diff = torch.cat([(w2[k] - w[k]).flatten() for k in w])
    assert update.norm().item() > 0.1
    assert diff.norm().item() <= 1e-3 * update.norm().item()    # seen: 2e-6 (each rank's own gradients: 1)
    # the logged loss and reward metrics are the global batch's (gathered over the ranks), as in one process
    assert [h["step"] for h in rec2["history"]] == [h["step"] for h in rec["history"]] == list(range(1, STEPS + 1))
    for key in ("loss", "rewards/margins", "rewards/accuracies"):
        np.testing.assert_allclose([h[key] for h in rec2["history"]], [h[key] for h in rec["history"]], rtol=1e-4,
                                   atol=1e-5, err_msg=key)


if __name__ == "__main__":   # one rank of run_ranks: <cache dir> <output folder>
    train_and_save(sys.argv[1], Path(sys.argv[2]))
