"""LA-LoRA's memory model: what a run holds on its device, phase by phase, from the composed config alone
(``train.py method=la_lora ... plan=true``), with the functions the run sizes its passes with.

* training: one ENS-LoRA member (:func:`~rewarduq_exp.methods.lora.memory.choose_training`, K = 1);
* curvature: the K-FAC factors of every trained Linear (lora_A: r x r and in x in, lora_B: out x out and r x r, the
  head: 1 x 1 and d x d; float32) beside the body, the weights and their gradients, and the activations of a forward +
  backward over texts (not checkpointed: the recomputation would run the curvature hooks twice), as many tokens as
  :func:`laplace_tokens` gives;
* decomposition: each factor's eigendecomposition replaces it, the largest one's float64 workspace on top;
* scoring: the eigendecompositions (the factors' size) and a forward + backward per batch of texts (the Jacobian of
  each text's reward), with each text's Jacobian of the largest block and laplace-torch's products of it.
"""

from __future__ import annotations

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.methods.lora.memory import body_trainable, planned_training, training_flops, training_phase
from rewarduq_exp.models.activation_memory import training_token_bytes
from rewarduq_exp.models.memory_plan import Phase, Plan, PlanContext
from rewarduq_exp.models.token_budget import budget_from_memory

# A text's Jacobian of one block and laplace-torch's inv_square_form on it (W, Q1^T W Q2, its scaled copy, Q1 .. Q2^T,
# the product): float32 copies of the block's weight per text, alive together.
JACOBIAN_COPIES = 5


def laplace_tokens(a, longest: int, act_bytes: int, math_kernel: bool, device_type: str, free: float,
                   reserved: float, row_bytes: float = 0.0) -> int:
    """Token positions per forward + backward of the Laplace passes (curvature, scoring): what ``free`` bytes hold
    after ``reserved`` at the training cost per token without checkpointing, plus ``row_bytes`` per text of at most
    ``longest`` tokens (its Jacobian)."""
    per_token = training_token_bytes(a, longest, act_bytes, math_kernel, False) + row_bytes / max(1, longest)
    return budget_from_memory(free, per_token, device_type, reserved)


def block_shapes(linears: list[tuple[int, int]], rank: int, hidden: int) -> list[tuple[int, int]]:
    """(out, in) of every trained weight: lora_A (r, in) and lora_B (out, r) of each LoRA-wrapped Linear (in, out),
    then the head (1, d)."""
    return [s for n_in, n_out in linears for s in ((rank, n_in), (n_out, rank))] + [(1, hidden)]


def factor_elements(shapes) -> int:
    """Elements of the Kronecker factors (out x out + in x in per block)."""
    return sum(o * o + i * i for o, i in shapes)


def qwen3_linears(a) -> list[tuple[int, int]]:
    """(in, out) of every Linear of a Qwen3-style body: q, k, v, o and the SwiGLU MLP's gate, up, down per layer."""
    d, q, kv, inter = a.hidden, a.q_dim, a.kv_dim, a.intermediate
    layer = [(d, q), (d, kv), (d, kv), (q, d), (d, inter), (d, inter), (inter, d)]
    if a.layers * sum(i + o for i, o in layer) != a.lora_fan_sum:
        raise UserError(f"plan: la_lora knows the Linear layers of Qwen3-style bodies only; model '{a.name}' has "
                        "others")
    return layer * a.layers


def plan(ctx: PlanContext) -> Plan:
    """LA-LoRA as the method sizes itself (module docstring)."""
    m, a = ctx.method, ctx.arch
    rank = int(m.lora_rank)
    choice = planned_training(ctx, 1, False, False)
    body, trainable = body_trainable(ctx, 1)
    shapes = block_shapes(qwen3_linears(a), rank, a.hidden)
    factors = 4.0 * factor_elements(shapes)
    largest = max(max(o, i) for o, i in shapes)
    ckpt = choice.gradient_checkpointing
    weights = {"frozen body": body, "LoRA adapter + head (float32 weights and gradients)": 2 * trainable * 4}
    cost = training_token_bytes(a, ctx.length, ctx.dtype_bytes, ctx.math_kernel, False)
    tokens_setting, rows_cap = m.score_batch_tokens, m.score_batch_size

    def tokens(row_bytes: float) -> int:
        if tokens_setting != "auto":
            return tokens_setting
        n = laplace_tokens(a, ctx.length, ctx.dtype_bytes, ctx.math_kernel, ctx.device,
                           ctx.memory() - body - 2 * trainable * 4 - factors, 0.0, row_bytes)
        return n if rows_cap == "auto" else min(n, rows_cap * ctx.length)

    fit_tokens = tokens(0.0)
    curvature = Phase("curvature", {**weights, "K-FAC factors (float32)": factors,
                                    f"activations ({fit_tokens:,} tokens, forward + backward)": fit_tokens * cost})
    decomposition = Phase("decomposition", {**weights, "K-FAC factors / their eigendecompositions": factors,
                                            "float64 eigendecomposition of the largest factor": 3 * 8.0 * largest ** 2})
    row_bytes = JACOBIAN_COPIES * 4.0 * max(o * i for o, i in shapes)
    score_tokens = tokens(row_bytes)
    texts = max(1, score_tokens // ctx.length)
    scoring = Phase("scoring", {**weights, "eigendecompositions (float32)": factors,
                                f"activations ({score_tokens:,} tokens, forward + backward)": score_tokens * cost,
                                f"Jacobians of {texts} texts (largest block)": texts * row_bytes})
    def training(checkpointed: bool) -> Phase:
        return training_phase(ctx, "LoRA adapter + head", 1, choice, checkpointed, 1)

    train_tokens = 2 * ctx.n_train * ctx.mean_tokens
    eval_tokens = 2 * ctx.n_eval * ctx.mean_tokens
    # per text and block (out, in): laplace-torch's Q1^T W Q2 and Q1 (.) Q2^T, four matrix products
    per_text_projection = sum(4 * (o * o * i + o * i * i) for o, i in shapes)
    flops = {"training": training_flops(ctx, 1, ckpt),
             "laplace fit": train_tokens * (6 * a.params_body + 2 * factor_elements(shapes))
             + 3 * ctx.attention_flops(train_tokens) + sum(10 * max(o, i) ** 3 for o, i in shapes),
             "scoring": eval_tokens * 4 * a.params_body + 2 * ctx.attention_flops(eval_tokens)
             + 2 * ctx.n_eval * per_text_projection}
    # (the no-grad reward pass over the training pairs, for the curvature's weights, runs under the inference token
    # budget and holds less than the curvature pass)
    plan = ctx.plan(a.params_body + trainable, trainable, [training(ckpt), curvature, decomposition, scoring],
                    flops, checkpointing=ckpt)
    plan.without_checkpointing = max(training(not ckpt).peak, curvature.peak, decomposition.peak, scoring.peak)
    micro_setting = m.micro_batch_size
    plan.notes.append(f"micro-batch of {choice.micro_batch_size} pairs "
                      f"({'auto' if micro_setting == 'auto' else 'as set'}), activation checkpointing "
                      f"{'on' if ckpt else 'off'} in training (never in the Laplace passes); K-FAC over "
                      f"{len(shapes)} weights, {factors / 2**30:.2f} GiB of factors")
    return plan
