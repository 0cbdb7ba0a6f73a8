"""ENS-LoRA's memory model: what a run holds on its device in training and scoring, from the composed config alone
(``train.py ... plan=true``; the Slurm launcher's memory check). The micro-batch, checkpointing and batched forward
come from :func:`rewarduq_exp.methods.lora.memory.choose_training`, the very function the run sizes its training
step with, and the scoring batches from the token budget the run's ``score_tokens`` computes.

One frozen body + K adapters (LoRA on every Linear, float32) with gradients, AdamW states and the anchor's initial
copy, + K linear heads; activations of the training forward for a micro-batch of m pairs: K x 2 x m rows when all
members run in one batched forward (``mixed_adapter_training=auto``, the default on every device, or true), 2 x m
rows when each member runs its own pass (false, or auto where K members of one pair do not fit the device even
checkpointed). m and activation checkpointing are what the method's ``auto`` picks on the device's memory, or as set.
"""

from __future__ import annotations

from rewarduq_exp.methods.lora.memory import (
    body_trainable,
    inference_token_cost,
    mixed_setting,
    planned_training,
    training_flops,
    training_phase,
)
from rewarduq_exp.models.memory_plan import Phase, Plan, PlanContext


def plan(ctx: PlanContext) -> Plan:
    """ENS-LoRA as the method sizes itself: the micro-batch and checkpointing that ``auto`` picks on this device's
    memory for pairs of two ``max_length`` rows under K members (the batched forward), scoring batches of the token
    budget in member-tokens."""
    m, a = ctx.method, ctx.arch
    k = int(m.num_members)
    mixed_auto = m.mixed_adapter_training == "auto"
    choice = planned_training(ctx, k, mixed_setting(m.mixed_adapter_training, "method.mixed_adapter_training"),
                              mixed_auto)
    body, trainable = body_trainable(ctx, k)
    running = k if choice.mixed else 1

    def phase(ckpt: bool) -> Phase:
        return training_phase(ctx, f"{k} LoRA adapters + heads", running, choice, ckpt, k)

    rows_cap = m.score_batch_size
    per_text = k if mixed_setting(m.mixed_adapter_scoring, "method.mixed_adapter_scoring") else 1
    per_token = inference_token_cost(ctx)
    tokens = ctx.budget_tokens(m.score_batch_tokens, "method.score_batch_tokens", per_token,
                               body + trainable * 4, None if rows_cap == "auto" else rows_cap * per_text)
    scoring = Phase("scoring", {"frozen body": body, f"{k} LoRA adapters + heads": trainable * 4,
                                f"activations (inference, batches of {tokens:,} member-tokens)": tokens * per_token})
    lora = a.lora_params(int(m.lora_rank))
    ckpt = choice.gradient_checkpointing
    flops = {"training": training_flops(ctx, k, ckpt),
             "scoring": k * (2 * a.params_body + 2 * lora) * 2 * ctx.n_eval * ctx.mean_tokens}
    plan = ctx.plan(a.params_body + trainable, trainable, [phase(ckpt), scoring], flops, checkpointing=ckpt)
    plan.without_checkpointing = max(phase(not ckpt).peak, scoring.peak)
    micro_setting = m.micro_batch_size
    plan.notes.append(f"micro-batch of {choice.micro_batch_size} pairs x {running} member(s) "
                      f"({'auto' if micro_setting == 'auto' else 'as set'}), activation checkpointing "
                      f"{'on' if ckpt else 'off'}")
    return plan
