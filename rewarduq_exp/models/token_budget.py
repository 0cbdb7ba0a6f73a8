"""Batches by a token budget: how many padded token positions one forward may hold on this device, and the split of a
batching order into batches under that budget.

A fixed row count tuned on a CPU leaves a GPU idle (32 texts of 32 tokens are 1k tokens: a few percent of an H100)
and may not fit long sequences. Here a batch is instead as many rows as fit ``max_tokens`` padded positions
(``rows x the longest row``), where ``max_tokens`` is either given (an integer setting) or ``auto``: the free memory
of the device, times :data:`MEMORY_FRACTION`, divided by what the phase holds per token
(:mod:`rewarduq_exp.models.activation_memory`, the planner's own formulas), and capped at :data:`GPU_TOKENS_CAP` /
:data:`CPU_TOKENS_CAP`. The planner (``train.py ... plan=true``) computes the same budget from the device memory it
is told, so its peak is the one a run reaches.

Rows are sorted by length before they are split (the callers' orders), so a batch pads little.
"""

from __future__ import annotations

import numpy as np

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.host_memory import available_bytes

AUTO = "auto"
# Beyond ~64k tokens a batch's GEMMs are as efficient as they get on an H100 (every projection is then a matrix of
# 64k rows), while a larger batch only costs memory and makes progress coarser.
GPU_TOKENS_CAP = 65_536
# A CPU is saturated far earlier; smaller batches keep the progress bar moving and the math attention's L x L
# matrices small.
CPU_TOKENS_CAP = 8_192
# Of the free memory, what a batch may take: the rest is the allocator's fragmentation, the phase's temporaries that
# the per-token cost does not itemise, and other processes' growth.
MEMORY_FRACTION = 0.8


def free_bytes(device) -> float:
    """Memory a new batch may use on ``device``: the GPU's free memory plus what torch's caching allocator holds
    unused (it is ours to reuse), or the host's available memory shared by this host's processes of the run."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return available_bytes()


def tokens_cap(device_type: str) -> int:
    return GPU_TOKENS_CAP if device_type == "cuda" else CPU_TOKENS_CAP


def budget_from_memory(free: float, bytes_per_token: float, device_type: str, reserved: float = 0.0) -> int:
    """Tokens per batch that ``free`` bytes hold after ``reserved`` bytes (what the phase allocates besides the
    batch's activations), at ``bytes_per_token``; at least 1, at most :func:`tokens_cap`."""
    room = MEMORY_FRACTION * (free - reserved)
    return int(max(1, min(tokens_cap(device_type), room // max(bytes_per_token, 1.0))))


def check_setting(value, key: str, allow_auto: bool = True):
    """``auto`` or an integer >= 1, else a one-line error naming ``key``."""
    if allow_auto and value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, str)):
        raise UserError(f"{key}={value!r} is invalid; allowed: auto or an integer >= 1")
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1 or str(number) != str(value).strip():
        raise UserError(f"{key}={value!r} is invalid; allowed: auto or an integer >= 1")
    return number


def resolve_tokens(setting, key: str, device, bytes_per_token: float, reserved: float = 0.0) -> int:
    """``setting`` (``auto`` or a number of tokens) as a number of tokens: ``auto`` = :func:`budget_from_memory` of
    the device's free memory now."""
    import torch

    setting = check_setting(setting, key)
    if setting != AUTO:
        return setting
    device = torch.device(device)
    return budget_from_memory(free_bytes(device), bytes_per_token, device.type, reserved)


def split_by_tokens(order, lengths, max_tokens: int, max_rows: int | None = None) -> list[np.ndarray]:
    """``order`` cut into consecutive batches of at most ``max_tokens`` padded positions (rows x the longest row of
    the batch) and at most ``max_rows`` rows; a row longer than the budget is a batch of its own."""
    order = np.asarray(order, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    batches, start, width = [], 0, 0
    limit = max_rows or len(order) or 1
    for i, row in enumerate(order):
        wider = max(width, int(lengths[row]))
        rows = i - start + 1
        if rows > 1 and (rows * wider > max_tokens or rows > limit):
            batches.append(order[start:i])
            start, wider = i, int(lengths[row])
        width = wider
    if start < len(order):
        batches.append(order[start:])
    return batches


# A micro-batch of at least this many tokens keeps an H100's GEMMs busy: below it, activation checkpointing (a third
# more compute, far less memory) with larger micro-batches is the better trade.
SATURATING_TOKENS = 16_384


def fits_in_memory(free: float, reserved: float, tokens: float, token_bytes: float) -> bool:
    """Whether ``tokens`` at ``token_bytes`` each fit the budget's share of ``free`` after ``reserved`` (no cap:
    what memory holds, not what a batch should hold)."""
    return MEMORY_FRACTION * (free - reserved) >= tokens * token_bytes


def largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


def choose_micro_batch(batch: int, item_tokens: int, free: float, reserved: float, token_bytes_plain: float,
                       token_bytes_checkpointed: float, device_type: str, checkpointing="auto",
                       divides: bool = False, micro="auto") -> tuple[int, bool]:
    """(items per micro-batch, activation checkpointing) for a training step of ``batch`` items (pairs) of
    ``item_tokens`` padded tokens each (all the rows an item runs: 2 for a pair, 2 x K for a pair under K members),
    in ``free`` bytes of which ``reserved`` go to what the step allocates besides activations (gradients, optimizer
    states), at the per-token costs without and with checkpointing.

    ``checkpointing="auto"``: off when a micro-batch without it holds the whole batch or at least
    :data:`SATURATING_TOKENS` tokens (on a CPU: whenever one item fits without it), else on (the largest micro-batch
    that fits). ``True`` / ``False``: as given, the
    micro-batch as large as fits. ``divides``: the micro-batch divides ``batch`` (a trainer that accumulates whole
    micro-batches). At least one item per micro-batch, whatever the memory says. ``micro``: a micro-batch the
    configuration gives (``auto``: chosen here); ``checkpointing="auto"`` is then on where it needs it to fit."""
    if micro != "auto":
        micro = min(int(micro), batch)
        if checkpointing == "auto":
            checkpointing = not fits_in_memory(free, reserved, micro * item_tokens, token_bytes_plain)
        return micro, bool(checkpointing)

    def items(per_token: float) -> int:
        tokens = budget_from_memory(free, per_token, device_type, reserved)
        n = max(1, min(batch, tokens // max(1, item_tokens)))
        return largest_divisor_at_most(batch, n) if divides else n

    if checkpointing != "auto":
        return items(token_bytes_checkpointed if checkpointing else token_bytes_plain), bool(checkpointing)
    plain = items(token_bytes_plain)
    fits = fits_in_memory(free, reserved, item_tokens, token_bytes_plain)   # one item, without the cap
    # A CPU is saturated by small batches: there checkpointing only costs time, unless nothing fits without it.
    busy = device_type != "cuda" or plain * item_tokens >= SATURATING_TOKENS
    if fits and (plain == batch or busy):
        return plain, False
    return items(token_bytes_checkpointed), True
