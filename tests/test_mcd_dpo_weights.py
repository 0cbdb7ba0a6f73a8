"""MCD-DPO pair weights (weighting must equal repetition) in the DPO loss of eq. 13."""

import numpy as np
import pytest
import torch
from test_mcd_dpo import _method

from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.methods import mcd_dpo as mod


@pytest.fixture(scope="module")
def frame():
    return SyntheticWorld(n_train=12, n_eval=4, n_ood=4).load("train")


@pytest.fixture(scope="module")
def trainer(tiny_backbone, frame, tmp_path_factory):
    """A trainer with TRL's pre-computed reference log-probs, whose policy is then moved away from the reference (so
    the pairs' margins differ; at the reference every margin is 0 and any weighting gives log 2)."""
    method = _method(tiny_backbone, dropout=0.0)       # dropout 0: compute_loss is deterministic
    trainer = method._make_trainer(frame, str(tmp_path_factory.mktemp("trainer")))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return trainer


def _batch(trainer, rows, weights=None):
    examples = [dict(trainer.train_dataset[i]) for i in rows]
    for e, w in zip(examples, weights or [1.0] * len(rows)):
        e["weight"] = float(w)
    return trainer.data_collator(examples)


def _loss(trainer, inputs):
    return trainer.compute_loss(trainer.model, inputs)


def test_weight_column_reaches_the_training_batches(trainer):
    assert "weight" in trainer.train_dataset.column_names
    batch = _batch(trainer, [0, 1, 2], [1.0, 2.5, 0.0])
    assert batch["weight"].dtype == torch.float32 and batch["weight"].tolist() == [1.0, 2.5, 0.0]
    assert batch["input_ids"].shape[0] == 6     # [chosen; rejected], untouched by the wrapper


def test_unit_weights_give_exactly_the_unweighted_loss(trainer):
    with torch.no_grad():
        batch = _batch(trainer, [0, 1, 2, 3])
        weighted = _loss(trainer, batch)
        plain = _loss(trainer, {k: v for k, v in batch.items() if k != "weight"})
        chosen, rejected = mod.completion_logps(
            trainer.model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            .last_hidden_state, trainer.model.lm_head, batch["input_ids"], batch["completion_mask"], 16).chunk(2)
        margin = trainer.beta * ((chosen - batch["ref_chosen_logps"]) - (rejected - batch["ref_rejected_logps"]))
    assert torch.equal(weighted, plain)
    assert torch.equal(plain, -torch.nn.functional.logsigmoid(margin).mean())   # the previous eq. 13 loss


def test_weight_two_equals_the_pair_repeated(trainer):
    with torch.no_grad():
        weighted = _loss(trainer, _batch(trainer, [0, 1, 2], [1.0, 2.0, 1.0]))
        repeated = _loss(trainer, _batch(trainer, [0, 1, 1, 2]))
        uniform = _loss(trainer, _batch(trainer, [0, 1, 2]))
    assert abs(weighted.item() - repeated.item()) < 1e-6
    assert abs(weighted.item() - uniform.item()) > 1e-4     # the weight matters (the margins differ)


def test_zero_weight_pair_contributes_nothing(trainer):
    def loss_and_grad(rows, weights):
        trainer.model.zero_grad(set_to_none=True)
        loss = _loss(trainer, _batch(trainer, rows, weights))
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        trainer.model.zero_grad(set_to_none=True)
        return loss.item(), grad

    l1, g1 = loss_and_grad([0, 1, 2], [1.0, 0.0, 1.0])
    l2, g2 = loss_and_grad([0, 5, 2], [1.0, 0.0, 1.0])     # other data in the zero-weight slot
    l3, g3 = loss_and_grad([0, 2], [1.0, 1.0])             # the pair left out altogether
    assert abs(l1 - l2) < 1e-6 and abs(l1 - l3) < 1e-6
    scale = g3.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(g1, g3, atol=1e-6 * scale, rtol=1e-5)
    torch.testing.assert_close(g2, g3, atol=1e-6 * scale, rtol=1e-5)
    # all weights 0: loss 0 and no NaN
    assert loss_and_grad([0, 1], [0.0, 0.0])[0] == 0.0


def test_fit_feeds_each_pair_weight_once_per_epoch(tiny_backbone, frame, monkeypatch):
    """End to end: the frame's weight column reaches compute_loss (one epoch: each pair's weight exactly once)."""
    seen = []
    original = mod._make_trainer_class

    def spying_class():
        class Spy(original()):
            def compute_loss(self, model, inputs, *args, **kwargs):
                seen.extend(inputs["weight"].tolist())
                return super().compute_loss(model, inputs, *args, **kwargs)
        return Spy

    monkeypatch.setattr(mod.method, "_make_trainer_class", spying_class)  # where McdDpo looks it up
    weighted = frame.assign(weight=np.tile([0.5, 2.0, 1.0, 0.0], len(frame) // 4))
    method = _method(tiny_backbone, num_epochs=1, batch_size=4, micro_batch_size=4)
    summary = method.fit(weighted).fit_summary
    assert summary["optimizer_steps"] == 3 and np.isfinite(summary["final_train_loss"])
    assert sorted(seen) == sorted(weighted["weight"].tolist())
