"""ENS-LoRA's memory model: what a run holds on its device in training and scoring, from the composed config alone
(``train.py ... plan=true``; the Slurm launcher's memory check), with the formulas the method sizes its micro-batch
and its scoring batches with (:mod:`rewarduq_exp.models.token_budget`, :mod:`rewarduq_exp.models.activation_memory`).

One frozen body + K adapters (LoRA on every Linear, float32) with gradients, AdamW states and the anchor's initial
copy, + K linear heads; activations of the training forward for a micro-batch of m pairs: K x 2 x m rows when all
members run in one batched forward (``mixed_adapter_training=auto``, the default on every device, or true), 2 x m
rows when each member runs its own pass (false, or auto where K members of one pair do not fit the device even
checkpointed). m and activation checkpointing are what the method's ``auto`` picks on the device's memory, or as set.
"""

from __future__ import annotations

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.models.activation_memory import inference_token_bytes, training_token_bytes
from rewarduq_exp.models.memory_plan import DTYPE_BYTES, Phase, Plan, PlanContext, attention_flops, budget_tokens
from rewarduq_exp.models.token_budget import check_setting


def plan(ctx: PlanContext) -> Plan:
    """ENS-LoRA as the method sizes itself: the micro-batch and checkpointing that ``auto`` picks on this device's
    memory for pairs of two ``max_length`` rows under K members (the batched forward), scoring batches of the token
    budget in member-tokens."""
    cfg, name, a, device, dtype = ctx.cfg, ctx.name, ctx.arch, ctx.device, ctx.dtype
    n_train, n_eval, length, mean_tokens, math_kernel = ctx.n_train, ctx.n_eval, ctx.length, ctx.mean_tokens, \
        ctx.math_kernel
    tflops = ctx.tflops
    from rewarduq_exp.models.activation_memory import lora_training_reserved
    from rewarduq_exp.models.token_budget import choose_micro_batch, fits_in_memory

    m = cfg.method
    wb = DTYPE_BYTES[dtype]
    act = wb   # bf16 autocast on a bf16 backbone, float32 otherwise
    k, rank, batch = int(m.num_members), int(m.lora_rank), min(int(m.batch_size), n_train)
    if m.get("target_modules", "all-linear") != "all-linear":
        raise UserError("plan: ENS-LoRA is planned for method.target_modules=all-linear only")
    lora = a.lora_params(rank)
    trainable = k * (lora + a.hidden)

    def flag(key):
        value = m.get(key, "auto")
        return True if value == "auto" else bool(value)

    mixed_training, mixed_scoring = flag("mixed_adapter_training"), flag("mixed_adapter_scoring")
    gc = m.get("gradient_checkpointing", "auto")
    gc = "auto" if str(gc) == "auto" else bool(gc)
    micro_setting = check_setting(m.get("micro_batch_size", "auto"), "method.micro_batch_size")
    body = a.params_body * wb
    free = ctx.memory() - body - trainable * 4
    reserved = lora_training_reserved(trainable)
    costs = [training_token_bytes(a, length, act, math_kernel, ckpt) for ckpt in (False, True)]
    if mixed_training and m.get("mixed_adapter_training", "auto") == "auto":   # as the method falls back
        mixed_training = fits_in_memory(free, reserved, 2 * length * k, costs[0 if gc is False else 1])
    item = 2 * length * (k if mixed_training else 1)
    micro, checkpointing = choose_micro_batch(batch, item, free, reserved, *costs, device, gc, micro=micro_setting)

    def training_phase(ckpt: bool) -> Phase:
        rows = (k if mixed_training else 1) * 2 * micro
        return Phase("training", {
            "frozen body": body,
            f"{k} LoRA adapters + heads (float32: weights, grads, AdamW x2, anchor copy)": 5 * trainable * 4,
            f"activations ({rows} rows x {length} tokens{', checkpointed' if ckpt else ''})":
                rows * length * costs[ckpt]})

    rows_cap = check_setting(m.get("score_batch_size", "auto"), "method.score_batch_size")
    per_text = k if mixed_scoring else 1
    per_token = inference_token_bytes(a, length, act, math_kernel, kv_cache=True)
    tokens = budget_tokens(m.get("score_batch_tokens", "auto"), "method.score_batch_tokens", cfg, device, per_token,
                           body + trainable * 4, None if rows_cap == "auto" else rows_cap * per_text, length)
    scoring = Phase("scoring", {"frozen body": body, f"{k} LoRA adapters + heads": trainable * 4,
                                f"activations (inference, batches of {tokens:,} member-tokens)": tokens * per_token})
    train_tokens = 2 * n_train * mean_tokens * float(m.num_epochs)
    per_member = 4 * a.params_body + 6 * lora + (2 * a.params_body if checkpointing else 0)
    flops = {"training": k * (per_member * train_tokens + 2 * attention_flops(a, train_tokens, mean_tokens)),
             "scoring": k * (2 * a.params_body + 2 * lora) * 2 * n_eval * mean_tokens}
    plan = Plan(name, a.name, device, dtype, a.params_body + trainable, trainable, [training_phase(checkpointing),
                scoring], flops, tflops, n_train, n_eval, length, checkpointing=checkpointing)
    plan.without_checkpointing = max(training_phase(not checkpointing).peak, scoring.peak)
    plan.notes.append(f"micro-batch of {micro} pairs x {k if mixed_training else 1} member(s) "
                      f"({'auto' if micro_setting == 'auto' else 'as set'}), activation checkpointing "
                      f"{'on' if checkpointing else 'off'}")
    return plan
