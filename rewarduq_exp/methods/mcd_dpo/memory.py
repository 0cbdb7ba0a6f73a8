"""What MCD-DPO holds on its device, per token and in all: the sizes from which a run picks its micro-batch, its
activation checkpointing and its scoring batches (:mod:`rewarduq_exp.models.token_budget`), and which the planner
(``train.py ... plan=true``) prints. One set of formulas for both, so the plan is the run's.

The policy keeps float32 weights (AdamW on bf16 weights loses small updates) and runs under bf16 autocast on a bf16
backbone: matrix products in bf16, while the residual stream, the norms' outputs and the final hidden states stay
float32. Training holds per parameter the weight, its gradient and AdamW's two states (16 bytes) and, under the
Trainer's autocast (whose cast cache keeps the bf16 copy of every Linear weight until the forward's region ends),
2 bytes per Linear parameter. The completion log-probs go through the LM head in chunks of ``chunk`` positions
(:mod:`.logprobs`): on a GPU one checkpointed chunk of logits at a time, on a CPU every chunk's logits are kept for
backward.

Scoring holds the policy and the float32 reference, runs the policy's body (its final hidden states kept), then K
dropout masks of a chunk of completion positions through the LM head, then the reference's body (the policy's
states freed first). Its peak is the larger of the body's activations and the head's chunk: the body's activations
are gone when the head runs (measured on CPU at the Qwen3-4B widths: the head's chunk of K x c logits in float32
plus logsumexp's temporary of the same size, or the LM head's bf16 copy plus the bf16 logits).
"""

from __future__ import annotations

from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.models.activation_memory import inference_token_bytes, training_token_bytes
from rewarduq_exp.models.memory_plan import Phase, Plan, PlanContext, attention_flops, budget_tokens
from rewarduq_exp.models.shapes import Architecture

# Logit elements one chunk of the chunked log-softmax may hold (rows x positions x vocabulary): 64M float32 values,
# 256 MB. Large chunks keep the LM head's GEMM efficient on a GPU (64 positions x 152k vocabulary is a skinny one).
CHUNK_LOGITS = 2**26


def auto_chunk(vocab: int, rows: int = 1) -> int:
    """Completion positions per chunk: :data:`CHUNK_LOGITS` over the vocabulary times the masked copies (``rows``:
    1 in training, K at scoring), within 8 .. 4096."""
    return int(min(4096, max(8, CHUNK_LOGITS // max(1, vocab * rows))))


def linear_params(a: Architecture) -> int:
    """Parameters of the Linear layers of the body and the LM head (what autocast casts to bf16)."""
    return sum_linear_weights(a) + a.vocab * a.hidden


def sum_linear_weights(a: Architecture) -> int:
    """Weights of every Linear of a Qwen3 body: q, k, v, o and the SwiGLU MLP's three, per layer."""
    return a.layers * (a.hidden * (a.q_dim + 2 * a.kv_dim) + a.q_dim * a.hidden + 3 * a.hidden * a.intermediate)


def training_reserved(a: Architecture, bf16: bool, chunk: int, cuda: bool) -> float:
    """Bytes a training step allocates besides the weights (loaded before the budget is measured) and the
    activations: gradients and AdamW's states (12 bytes a parameter), autocast's bf16 copies of the Linear weights,
    and on a GPU one checkpointed chunk of logits with its log-softmax."""
    reserved = 12.0 * a.params_causal_lm
    if bf16:
        reserved += 2.0 * linear_params(a)
    if cuda:
        reserved += 3.0 * chunk * a.vocab * 4
    return reserved


def training_token(a: Architecture, length: int, bf16: bool, math_kernel: bool, checkpointing: bool) -> float:
    """Bytes kept for backward per token of a training micro-batch (every row at ``length`` tokens): the body's
    activations in the compute dtype with a float32 residual stream, and on a CPU the completion logits and their
    log-softmax that every chunk keeps for backward (every token counted as completion: an upper bound)."""
    act = 2 if bf16 else 4
    per_token = training_token_bytes(a, length, act, math_kernel, checkpointing, residual_bytes=4)
    if math_kernel:   # a CPU: no chunk checkpoint
        per_token += 2 * a.vocab * 4
    return per_token


def scoring_token(a: Architecture, length: int, math_kernel: bool) -> float:
    """Bytes per token of a scoring batch: one body forward's activations (float32 residual stream, the shared-prompt
    KV cache counted) and the final hidden states kept for the head (float32, with the completion positions
    gathered from them)."""
    return inference_token_bytes(a, length, 4, math_kernel, kv_cache=True) + 2 * a.hidden * 4


def scoring_head(a: Architecture, num_samples: int, chunk: int, bf16: bool) -> float:
    """Bytes of the K-mask head step on one chunk: the larger of the float32 logits with logsumexp's temporary and the
    head's bf16 weight copy with the bf16 logits, plus the masks and the masked inputs."""
    logits = num_samples * chunk * a.vocab
    head = max(8.0 * logits, (2.0 * a.vocab * a.hidden + 2.0 * logits) if bf16 else 0.0)
    return head + 3.0 * 4 * num_samples * chunk * a.hidden


def plan(ctx: PlanContext) -> Plan:
    """MCD-DPO as the method sizes itself (:mod:`rewarduq_exp.methods.mcd_dpo.memory`): the micro-batch and
    checkpointing that ``auto`` picks on this device's memory for pairs of two ``max_length`` rows, and scoring
    batches of the token budget."""
    cfg, name, a, device, dtype = ctx.cfg, ctx.name, ctx.arch, ctx.device, ctx.dtype
    n_train, n_eval, length, mean_tokens, math_kernel = ctx.n_train, ctx.n_eval, ctx.length, ctx.mean_tokens, \
        ctx.math_kernel
    tflops = ctx.tflops
    from rewarduq_exp.models.token_budget import choose_micro_batch

    m = cfg.method
    if a.classifier and not a.tied:
        raise UserError(f"plan: model '{a.name}' is a sequence classifier without tied embeddings: it has no LM head "
                        "and method=mcd_dpo refuses it")
    p = a.params_causal_lm
    bf16 = dtype == "bfloat16"
    cuda = device == "cuda"
    k = int(m.num_samples)
    chunk_setting = m.logprob_chunk
    chunk = auto_chunk(a.vocab, 1) if chunk_setting == "auto" else chunk_setting
    score_chunk = auto_chunk(a.vocab, k) if chunk_setting == "auto" else chunk_setting
    gc = m.gradient_checkpointing
    micro_setting = m.micro_batch_size
    batch = min(int(m.batch_size), n_train)
    memory = ctx.memory()
    weights = p * 4.0
    free = memory - weights
    reserved = training_reserved(a, bf16, chunk, cuda)
    costs = [training_token(a, length, bf16, math_kernel, ckpt) for ckpt in (False, True)]
    micro, checkpointing = choose_micro_batch(batch, 2 * length, free, reserved, *costs, device, gc, divides=True,
                                              micro=micro_setting)

    def training_phase(ckpt: bool) -> Phase:
        rows = 2 * micro
        parts = {"policy weights (float32)": weights, "gradients (float32)": p * 4.0,
                 "AdamW states (2 x float32)": 2 * p * 4.0,
                 f"activations ({rows} rows x {length} tokens{', checkpointed' if ckpt else ''})":
                     rows * length * costs[ckpt]}
        rest = reserved - 12.0 * p
        if rest > 0:
            parts[f"autocast's bf16 weight copies{' + one chunk of logits' if cuda else ''}"] = rest
        return Phase("training", parts)

    rows_cap = m.score_batch_size
    head = scoring_head(a, k, score_chunk, bf16)
    per_token = scoring_token(a, length, math_kernel)
    tokens = budget_tokens(m.score_batch_tokens, "method.score_batch_tokens", cfg, device, per_token,
                           2 * weights + head, None if rows_cap == "auto" else rows_cap, length)
    scoring = Phase("scoring", {"policy weights (float32)": weights, "reference weights (float32)": weights,
                                f"activations (inference, batches of {tokens:,} tokens)": tokens * per_token,
                                f"{k} masked chunks of {score_chunk} positions through the LM head": head})
    completion = float(OmegaConf.select(cfg, "plan.completion_fraction", default=1.0) or 1.0)
    train_tokens = 2 * n_train * mean_tokens * float(m.num_epochs)
    eval_tokens = 2 * n_eval * mean_tokens
    v = a.vocab
    flops = {"reference pass": 2 * p * train_tokens + attention_flops(a, train_tokens, mean_tokens),
             "training": (8 if checkpointing else 6) * p * train_tokens
             + 3 * attention_flops(a, train_tokens, mean_tokens),
             "scoring": 2 * 2 * p * eval_tokens + 2 * (k - 1) * a.hidden * v * eval_tokens * completion}
    plan = Plan(name, a.name, device, dtype, p, p, [training_phase(checkpointing), scoring], flops, tflops, n_train,
                n_eval, length, checkpointing=checkpointing)
    plan.without_checkpointing = max(training_phase(not checkpointing).peak, scoring.peak)
    plan.notes.append(f"micro-batch of {micro} pairs ({'auto' if micro_setting == 'auto' else 'as set'}), "
                      f"{batch // micro} accumulation steps, activation checkpointing "
                      f"{'on' if checkpointing else 'off'}, log-prob chunks of {chunk} positions")
    return plan
