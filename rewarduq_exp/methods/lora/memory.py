"""What a LoRA fine-tune holds on its device: the ONE choice of micro-batch, activation checkpointing and batched
forward that a run makes on its device's free memory (``LoRARewardMethod._training_batches``) and that the planner
makes on the device memory it is told (``plan_memory`` of ENS-LoRA and LA-LoRA), and the plan's parts built from
the same sizes, so the plan cannot drift from the run.

One frozen body (the backbone's dtype) + K LoRA adapters and K linear heads (float32) with their gradients, AdamW's
two states and the anchor's initial copy; the activations of one micro-batch of m pairs: 2 x m rows under each member
that runs (K x 2 x m rows when all members run in one batched forward). m and checkpointing are what
:func:`~rewarduq_exp.models.token_budget.choose_micro_batch` picks, or as set.
"""

from __future__ import annotations

from dataclasses import dataclass

from rewarduq_exp.core.checks import check_auto_flag
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.models.activation_memory import (
    inference_token_bytes,
    lora_training_reserved,
    training_token_bytes,
)
from rewarduq_exp.models.memory_plan import DTYPE_BYTES, Phase, PlanContext, attention_flops
from rewarduq_exp.models.token_budget import choose_micro_batch, fits_in_memory


def mixed_setting(value, key: str) -> bool:
    """A ``mixed_adapter_*`` setting as a bool: true/false as given, ``auto`` (the default) as True: all members in
    one batched forward (in training ``auto`` may still fall back to one member per pass, :func:`choose_training`)."""
    choice = check_auto_flag(value, key)
    return True if choice == "auto" else choice


@dataclass(frozen=True)
class TrainingChoice:
    """What a training step runs as: pairs per micro-batch, activation checkpointing, all members in one batched
    forward, and the bytes kept per token (without, with checkpointing) and besides the activations."""

    micro_batch_size: int
    gradient_checkpointing: bool
    mixed: bool
    token_bytes: tuple[float, float]
    reserved: float


def choose_training(a, longest: int, act_bytes: int, math_kernel: bool, device_type: str, free: float,
                    trainable: int, batch: int, members: int = 1, mixed: bool = False, mixed_auto: bool = False,
                    checkpointing="auto", micro="auto") -> TrainingChoice:
    """The micro-batch (pairs), checkpointing and batched forward of a training step of ``batch`` pairs whose rows
    are at most ``longest`` tokens, in ``free`` bytes (the body and the trainable weights already allocated), for
    ``members`` adapters of ``trainable`` float32 parameters in all (adapters + heads).

    ``mixed`` with ``mixed_auto`` (``mixed_adapter_training=auto``): the batched forward of all K members, unless K
    members of one pair do not fit even checkpointed (checkpointing off if it is set off): then one member per pass,
    which holds K x fewer activations. ``checkpointing`` / ``micro``: the settings (``auto`` or a value)."""
    costs = tuple(training_token_bytes(a, longest, act_bytes, math_kernel, ckpt) for ckpt in (False, True))
    reserved = lora_training_reserved(trainable)
    if mixed and mixed_auto:
        mixed = fits_in_memory(free, reserved, 2 * longest * members, costs[0] if checkpointing is False else costs[1])
    item = 2 * longest * (members if mixed else 1)
    size, ckpt = choose_micro_batch(batch, item, free, reserved, *costs, device_type, checkpointing, micro=micro)
    return TrainingChoice(size, bool(ckpt), bool(mixed), costs, reserved)


def body_trainable(ctx: PlanContext, members: int) -> tuple[float, int]:
    """(bytes of the frozen body on the device, trainable parameters of ``members`` LoRA adapters + heads) of a run
    of ``ctx`` (LoRA on every Linear of the body: the only targets the planner knows the shapes of)."""
    m, a = ctx.method, ctx.arch
    if m.target_modules != "all-linear":
        raise UserError(f"plan: {ctx.name} is planned for method.target_modules=all-linear only")
    return a.params_body * DTYPE_BYTES[ctx.dtype], members * (a.lora_params(int(m.lora_rank)) + a.hidden)


def planned_training(ctx: PlanContext, members: int, mixed: bool, mixed_auto: bool) -> TrainingChoice:
    """:func:`choose_training` as the planner sees a run of ``ctx``: rows of ``max_length`` tokens, the device's
    memory less the body and the trainable weights, the method's settings."""
    m = ctx.method
    body, trainable = body_trainable(ctx, members)
    return choose_training(ctx.arch, ctx.length, ctx.dtype_bytes, ctx.math_kernel, ctx.device,
                           ctx.memory() - body - trainable * 4, trainable, min(int(m.batch_size), ctx.n_train),
                           members, mixed, mixed_auto,
                           m.gradient_checkpointing, m.micro_batch_size)


def training_phase(ctx: PlanContext, label: str, members_running: int, choice: TrainingChoice, ckpt: bool,
                   members: int) -> Phase:
    """The training phase of a plan: the frozen body, ``members`` adapters + heads with gradients, AdamW states and
    the anchor copy (``label`` names them), and the activations of a micro-batch under ``members_running`` members
    at once, checkpointed or not."""
    body, trainable = body_trainable(ctx, members)
    rows = members_running * 2 * choice.micro_batch_size
    return Phase("training", {
        "frozen body": body,
        f"{label} (float32: weights, grads, AdamW x2, anchor copy)": 5 * trainable * 4,
        f"activations ({rows} rows x {ctx.length} tokens{', checkpointed' if ckpt else ''})":
            rows * ctx.length * choice.token_bytes[ckpt]})


def inference_token_cost(ctx: PlanContext) -> float:
    """Bytes per token of a scoring forward (the shared prompts' KV cache counted), as ``score_tokens`` counts."""
    return inference_token_bytes(ctx.arch, ctx.length, ctx.dtype_bytes, ctx.math_kernel, kv_cache=True)


def training_flops(ctx: PlanContext, members: int, checkpointing: bool) -> float:
    """FLOPs of training ``members`` adapters on the body over ``num_epochs`` of the pairs."""
    a = ctx.arch
    lora = a.lora_params(int(ctx.method.lora_rank))
    tokens = 2 * ctx.n_train * ctx.mean_tokens * float(ctx.method.num_epochs)
    per_member = 4 * a.params_body + 6 * lora + (2 * a.params_body if checkpointing else 0)
    return members * (per_member * tokens + 2 * attention_flops(a, tokens, ctx.mean_tokens))
