"""MCD-DPO (RewardUQ section 4.3, eq. 13): a DPO-trained policy whose implicit reward gets MC-dropout uncertainty.

The whole causal LM is fine-tuned with the DPO loss (eq. 13) against the frozen base checkpoint as reference. A
dropout layer of rate ``p`` sits on the final hidden states (after the final norm) right before the LM head; it is
on in training (one i.i.d. mask per element, as usual) and is kept on at inference, where ``K = num_samples`` masks
give K implicit rewards

    r_k(x, y) = dpo_beta * (sum_t log p_policy,k(y_t | x, y_<t) - sum_t log p_ref(y_t | x, y_<t))

summed over the completion tokens, the chat template's tokens of the assistant turn included (as the authors do).
reward = mean_k r_k, u = unbiased std_k r_k, bounds reward ± beta * u (paper eq. 9, beta 2).

Every body forward (reference pass, training, scoring) runs each distinct prompt of a batch once: chosen and rejected
share theirs, and so do pairs that ask the same (``rewarduq_exp.models.shared_prefix``; exact, gradients included;
not under FSDP or DeepSpeed, which expect one forward per step).

The modules, one concept each:

- ``logprobs``: completion tokenisation, chunked completion log-probs, the K-mask MC log-probs and their mask seeds;
- ``weights``: the checkpoint as a causal LM, FSDP's whole weights, parameters to and from checkpoint tensors;
- ``trainer``: TRL's ``DPOTrainer`` with the head dropout, the pair-weight collator, the weighted DPO loss;
- ``gradients``: the gradient average over data-parallel processes;
- ``callbacks``: the run's checkpoint phase inside the Trainer, a progress log line;
- ``method``: :class:`McdDpo`, the method itself (fit, MC-dropout scoring, save / load).

Everything is importable from here (``rewarduq_exp.methods.mcd_dpo.McdDpo`` is what configs and the methods registry
name). Submodules import each other, never this file.
"""

from rewarduq_exp.methods.mcd_dpo.gradients import average_gradients
from rewarduq_exp.methods.mcd_dpo.logprobs import (
    completion_logps,
    draw_masks,
    mc_completion_logps,
    row_generators,
    row_seed,
    tokenize_completion,
)
from rewarduq_exp.methods.mcd_dpo.method import WEIGHTS_FILE, McdDpo
from rewarduq_exp.methods.mcd_dpo.trainer import WeightCollator, weighted_dpo_loss
from rewarduq_exp.methods.mcd_dpo.trainer import _make_trainer_class as _make_trainer_class  # private; tests use it
from rewarduq_exp.methods.mcd_dpo.weights import full_weights, load_causal_lm

# The class's public path, as the methods registry and conf/method/mcd_dpo.yaml name it: a saved method's method.json
# records the class's module as its "class", and loading refuses a "class" the registry does not list.
McdDpo.__module__ = __name__

__all__ = [
    "WEIGHTS_FILE",
    "McdDpo",
    "WeightCollator",
    "average_gradients",
    "completion_logps",
    "draw_masks",
    "full_weights",
    "load_causal_lm",
    "mc_completion_logps",
    "row_generators",
    "row_seed",
    "tokenize_completion",
    "weighted_dpo_loss",
]
