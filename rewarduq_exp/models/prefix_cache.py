"""Suffix-only scoring: hidden states at the final token of ``prefix + suffix_i`` for many suffixes per prefix.

BoRP (section 3.4, "Suffix-Only Probing") scores one conversation under several prompt suffixes (the positive and
the negative probe of eq. 1, rubrics, a judge prompt). The conversation (the *prefix*) is the long part and is the
same for every suffix, so it is run once and its KV cache is reused by every suffix: the cost drops from
``N (L + s)`` token positions to ``L + N s`` for ``N`` suffixes of ``s`` tokens after a prefix of ``L`` tokens.

How (transformers 5.x, ``DynamicCache``):

1. A batch of prefixes runs once with ``use_cache=True``. Prefixes of different lengths are **right**-padded in one
   batch; pad positions are excluded by the attention mask and never read.
2. The suffixes run in **one** more forward on that cache, with explicit ``position_ids = L_b + offset`` (the
   positions a from-scratch run would give; by default the model would number the suffix from the *padded* width,
   which is what makes padded prefixes correct), in one of two layouts (``mode``):

   * ``packed`` (default where the attention takes a custom mask, i.e. sdpa and eager): one row per prefix holds
     all ``N`` suffixes one after the other, with a 4D attention mask in which suffix ``j`` sees the prefix's real
     tokens and itself (causally), never the other suffixes; each suffix restarts at position ``L_b``. The prefix
     cache is used as it is: nothing is copied per suffix, so the work really is ``L + N s`` (plus the attention
     of the ``N s`` suffix queries over ``L + N s`` keys). The same layout as SGLang's multi-item scoring
     (``Engine.score`` with ``enable_mis``).
   * ``repeat`` (any attention; the notes' recipe): the cache is repeated ``N`` times along the batch
     (``batch_repeat_interleave``) so that row ``b * N + j`` holds prefix ``b`` for suffix ``j``; the suffixes are
     right-padded rows; the mask covers ``[prefix mask | suffix mask]``. Costs ``N`` copies of the prefix's KV cache
     (memory and bandwidth: ~150 kB per token for Qwen3-8B in bf16).
3. The hidden states of that forward cover the suffix tokens only; the final real token of each suffix is read at
   every requested layer.

:func:`full_recompute` runs every ``prefix + suffix`` from scratch (right-padded batches of the concatenated ids,
same batching budget) and is the reference of the equality test and the baseline of ``scripts/bench_probe.py``.

Token boundary. Prefix and suffix are tokenised **separately** and their ids concatenated, in both paths, so the
prefix ids (and so the cache) are identical whatever suffix follows; BPE merges across the boundary cannot occur.
Rendered with a chat template the boundary is clean anyway: the prefix ends with the end-of-turn marker
(``<|im_end|>\\n``) and the suffix begins with the next turn's special token (``<|im_start|>``).

Layers follow the ``probe.layer`` convention of :mod:`rewarduq_exp.models.features`: ``k`` is
``hidden_states[k]`` (0 = the embedding output, ``k`` = the output of block ``k``, ``num_layers`` = the last hidden
state **after** the final norm), and negative values index from the end as in Python (``-1`` = ``num_layers``).

Everything runs under ``torch.no_grad`` on the model's own device and dtype; results come back as float32 tensors
on the CPU, in input order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.contract import render
from rewarduq_exp.models.shared_prefix import (  # noqa: F401  (packed_supported: part of this API)
    PACKED_ATTENTION,
    _cache_keyword,
    _returned_cache,
    _with_cache,
    batch_order,
    packed_supported,
    shared_pass,
)

THINK_MODES = ("auto", "always", "never")
SUFFIX_MODES = ("auto", "packed", "repeat")
EMPTY_THINK = "<think>\n\n</think>\n\n"
SYSTEM_PROMPT_MODES = ("keep", "drop")  # a template's default system prompt: as the template renders it | without
_PROBE_SYSTEM = {"role": "system", "content": "S"}  # a stand-in system turn, to find where the template's own text ends


def _without_system_block(tokenizer, messages: list[dict], **kwargs) -> str:
    """``messages`` rendered with no system block at all: rendered after a stand-in system turn (which replaces any
    default system prompt), minus what that turn alone renders to."""
    alone = tokenizer.apply_chat_template([_PROBE_SYSTEM], tokenize=False)
    full = tokenizer.apply_chat_template([_PROBE_SYSTEM, *messages], tokenize=False, **kwargs)
    if not full.startswith(alone):
        raise UserError("the chat template renders a system turn differently when more turns follow, so its "
                        "default system prompt cannot be separated; use probe.default_system_prompt=keep")
    return full[len(alone):]


# ---------------------------------------------------------------------------------------------------- rendering
def render_prefix(tokenizer, prompt: list[dict], response: list[dict], system_prompt: str = "keep") -> str:
    """The conversation (prompt + response) as the backbone's chat template renders a finished conversation: the
    same text every other method scores (:func:`rewarduq_exp.data.contract.render`).

    It is rendered on its own, not as the history of the longer conversation that ends with the probe turn: that is
    what makes it a shareable, cacheable prefix. (Qwen3's template renders the *last* assistant turn with the empty
    ``<think>`` tags and drops them from earlier turns, so "history + new user turn" would re-render the response;
    here the response keeps the form it has as a finished conversation.)

    ``system_prompt``: a template that adds a default system prompt when the conversation has none (SmolLM2,
    Qwen2.5) keeps it (``keep``: the model sees its usual input) or renders the conversation without it (``drop``).
    """
    if system_prompt not in SYSTEM_PROMPT_MODES:
        raise UserError(f"probe.default_system_prompt={system_prompt!r} is invalid; allowed: "
                        f"{', '.join(SYSTEM_PROMPT_MODES)}")
    messages = [*prompt, *response]
    if system_prompt == "drop" and not any(m["role"] == "system" for m in messages):
        return _without_system_block(tokenizer, messages)
    return render(tokenizer, prompt, response)


def render_suffix(tokenizer, user_text: str, answer: str = "", think: str = "auto") -> str:
    """A further user turn holding ``user_text``, the assistant generation prefix, then ``answer`` (the start of the
    assistant's reply; may be empty).

    ``think``: ``auto`` asks the template for its non-thinking generation prefix (``enable_thinking=False``, which for
    Qwen3 gives the empty ``<think>\\n\\n</think>\\n\\n`` block the BoRP paper's prompts use, appendix A; templates
    without thinking ignore it); ``always`` appends that block when the template did not; ``never`` renders the
    plain generation prefix (``enable_thinking=True`` for Qwen3).

    A template that puts a default system prompt before a lone user turn (SmolLM2, Qwen2.5) is handled: the turn is
    rendered after a stand-in system turn and cut after it, so no system text lands in the middle of the
    conversation.
    """
    if think not in THINK_MODES:
        raise UserError(f"probe think={think!r} is invalid; allowed: {', '.join(THINK_MODES)}")
    if not str(user_text).strip():
        raise UserError("the probe prompt (user turn) is empty; give the instruction text of the probe template")
    turn = [{"role": "user", "content": str(user_text)}]
    kwargs = {"enable_thinking": think == "never"}
    text = _without_system_block(tokenizer, turn, add_generation_prompt=True, **kwargs)
    if think == "always" and not text.endswith(EMPTY_THINK):
        text += EMPTY_THINK
    return text + str(answer)


def tokenize_pieces(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text on its own, without special tokens added by the tokenizer (the template has them)."""
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


# ---------------------------------------------------------------------------------------------------- layers
def num_layers_of(model) -> int:
    return int(model.config.num_hidden_layers)


def normalize_layers(layers: Sequence[int], num_layers: int, what: str = "probe layer") -> list[int]:
    """Layer indices into ``hidden_states`` (0..num_layers), from indices that may be negative (``-1`` = last)."""
    out = []
    for layer in layers:
        k = int(layer)
        if not -(num_layers + 1) <= k <= num_layers:
            raise UserError(f"{what}={layer} is out of range for a model with {num_layers} layers; allowed "
                            f"0..{num_layers} (0 = embeddings, {num_layers} = last, after the final norm) or "
                            f"-{num_layers + 1}..-1 from the end")
        out.append(k % (num_layers + 1))
    if not out:
        raise UserError(f"no {what} given; allowed 0..{num_layers} or negative indices from the end")
    return out


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _check_ids(name: str, ids: Sequence[Sequence[int]]) -> None:
    if len(ids) == 0:
        raise UserError(f"no {name} given")
    empty = [i for i, x in enumerate(ids) if len(x) == 0]
    if empty:
        raise UserError(f"{name} {empty[:5]} have no tokens; every {name[:-1]} needs at least one token")


def _right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def _gather_last(hidden_states, layers: list[int], last: torch.Tensor) -> torch.Tensor:
    """(rows, n_layers, d) at the position ``last[row]`` of each row, float32 on the CPU."""
    rows = torch.arange(len(last), device=last.device)
    return torch.stack([hidden_states[k][rows, last] for k in layers], 1).float().cpu()


def _prefix_order(prefix_ids) -> list[int]:
    # Longest first: batches of similar lengths pad little, and an out-of-memory shows up in the first batch.
    return sorted(range(len(prefix_ids)), key=lambda i: -len(prefix_ids[i]))


# ---------------------------------------------------------------------------------------------------- scoring
def _packed_mask(pre_mask: torch.Tensor, suffix_ids, dtype: torch.dtype, boolean: bool) -> torch.Tensor:
    """(B, 1, T, P + T): a query of suffix j at offset t sees the real prefix tokens and suffix j up to offset t."""
    seg = torch.cat([torch.full((len(s),), j) for j, s in enumerate(suffix_ids)]).to(pre_mask.device)
    off = torch.cat([torch.arange(len(s)) for s in suffix_ids]).to(pre_mask.device)
    b, p, t = pre_mask.shape[0], pre_mask.shape[1], len(seg)
    within = (seg[:, None] == seg[None, :]) & (off[None, :] <= off[:, None])
    mask = torch.cat([pre_mask.bool()[:, None, :].expand(b, t, p), within[None].expand(b, t, t)], 2)[:, None]
    if boolean:  # sdpa: True = attend
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _suffix_forward_packed(model, cache, pre_mask, suffix_ids, layers):
    """All suffixes of a prefix in ONE row after the (not repeated) prefix cache. Returns (B, N, n_layers, d)."""
    device = pre_mask.device
    b = pre_mask.shape[0]
    ids = torch.tensor([t for s in suffix_ids for t in s], dtype=torch.long, device=device)[None].repeat(b, 1)
    off = torch.cat([torch.arange(len(s)) for s in suffix_ids]).to(device)
    positions = pre_mask.sum(1)[:, None] + off[None]
    boolean = getattr(model.config, "_attn_implementation", None) == "sdpa"
    mask = _packed_mask(pre_mask, suffix_ids, next(model.parameters()).dtype, boolean)
    res = model(input_ids=ids, attention_mask=mask, position_ids=positions, **_with_cache(model, cache), use_cache=True,
                output_hidden_states=True)
    ends = torch.cumsum(torch.tensor([len(s) for s in suffix_ids]), 0).to(device) - 1
    return torch.stack([res.hidden_states[k][:, ends] for k in layers], 2).float().cpu(), ids.numel()


def _suffix_forward_repeat(model, cache, pre_mask, suffix_ids, layers, pad_id):
    """The cache repeated once per suffix, the suffixes as right-padded rows. Returns (B, N, n_layers, d)."""
    device = pre_mask.device
    b, n_suf = pre_mask.shape[0], len(suffix_ids)
    suf, suf_mask = _right_pad(suffix_ids, pad_id)
    cache.batch_repeat_interleave(n_suf)  # row b * n_suf + j: prefix b, suffix j (mutated in place, used once)
    ids = suf.repeat(b, 1).to(device)
    s_mask = suf_mask.repeat(b, 1).to(device)
    positions = pre_mask.sum(1).repeat_interleave(n_suf)[:, None] + torch.arange(ids.shape[1], device=device)[None]
    mask = torch.cat([pre_mask.repeat_interleave(n_suf, 0), s_mask], 1)
    res = model(input_ids=ids, attention_mask=mask, position_ids=positions, **_with_cache(model, cache), use_cache=True,
                output_hidden_states=True)
    h = _gather_last(res.hidden_states, layers, (s_mask.sum(1) - 1))
    return h.view(b, n_suf, len(layers), -1), ids.numel()


@torch.no_grad()
def suffix_states(model, prefix_ids: Sequence[Sequence[int]], suffix_ids: Sequence[Sequence[int]],
                  layers: Sequence[int], *, pad_id: int = 0, batch_size: int = 32, mode: str = "auto",
                  stats: dict | None = None, share_lengths: Sequence[int] | None = None) -> torch.Tensor:
    """Hidden states (n_prefixes, n_suffixes, n_layers, d) at the final token of every ``prefix + suffix``, each
    prefix run once and its KV cache reused by all suffixes (module docstring).

    ``model`` is a headless decoder (``Backbone.load_encoder()``, or ``causal_lm.model``). ``batch_size`` bounds the
    (prefix, suffix) rows of one batch: ``max(1, batch_size // n_suffixes)`` prefixes per batch. ``mode``: ``packed``
    (one row per prefix holding all suffixes, a 4D mask; sdpa/eager attention), ``repeat`` (the cache repeated per
    suffix), ``auto`` (packed where supported). ``stats`` (optional dict) is incremented with ``forward_passes`` and
    the token positions computed (``prefix_tokens``, ``suffix_tokens``, padding included).

    ``share_lengths`` (optional): per prefix, how many of its leading tokens other prefixes may share (its prompt,
    :func:`~rewarduq_exp.models.shared_prefix.common_prefix_lengths`); prefixes are then batched by prompt where that
    runs fewer positions, and each batch's distinct prompts are run once
    (:func:`~rewarduq_exp.models.shared_prefix.shared_pass`).
    """
    _check_ids("prefixes", prefix_ids)
    _check_ids("suffixes", suffix_ids)
    if mode not in SUFFIX_MODES:
        raise UserError(f"prefix-reuse mode={mode!r} is invalid; allowed: {', '.join(SUFFIX_MODES)}")
    if mode == "packed" and not packed_supported(model):
        raise UserError(f"prefix-reuse mode=packed needs attention {' or '.join(PACKED_ATTENTION)} (the model uses "
                        f"{getattr(model.config, '_attn_implementation', None)}); use mode=repeat or auto")
    packed = mode == "packed" or (mode == "auto" and packed_supported(model))
    layers = normalize_layers(layers, num_layers_of(model))
    device = _device(model)
    n_suf = len(suffix_ids)
    per_batch = max(1, int(batch_size) // n_suf)
    order = _prefix_order(prefix_ids) if share_lengths is None else batch_order(prefix_ids, share_lengths, per_batch)
    out = None
    for start in range(0, len(order), per_batch):
        idx = order[start:start + per_batch]
        pre, pre_mask = _right_pad([prefix_ids[i] for i in idx], pad_id)
        pre, pre_mask = pre.to(device), pre_mask.to(device)
        shared = None if share_lengths is None else shared_pass(model, pre, pre_mask, [share_lengths[i] for i in idx])
        if shared is None:
            cache = _returned_cache(model(input_ids=pre, attention_mask=pre_mask, use_cache=True))
            prefix_tokens = pre.numel()
        else:  # the cache of the whole conversations, prompt rows picked per row: its mask has holes
            cache, pre_mask = shared.cache, shared.mask
            prefix_tokens = shared.tokens
        if packed:
            h, n_tokens = _suffix_forward_packed(model, cache, pre_mask, suffix_ids, layers)
        else:
            h, n_tokens = _suffix_forward_repeat(model, cache, pre_mask, suffix_ids, layers, pad_id)
        if out is None:
            out = torch.empty((len(prefix_ids), n_suf, len(layers), h.shape[-1]), dtype=torch.float32)
        out[torch.as_tensor(idx)] = h
        if stats is not None:
            stats["forward_passes"] = stats.get("forward_passes", 0) + (2 if shared is None else 3)
            stats["prefix_tokens"] = stats.get("prefix_tokens", 0) + prefix_tokens
            stats["suffix_tokens"] = stats.get("suffix_tokens", 0) + n_tokens
        del cache
    return out


@torch.no_grad()
def full_recompute(model, prefix_ids: Sequence[Sequence[int]], suffix_ids: Sequence[Sequence[int]],
                   layers: Sequence[int], *, pad_id: int = 0, batch_size: int = 32, stats: dict | None = None
                   ) -> torch.Tensor:
    """The same result as :func:`suffix_states` with every ``prefix + suffix`` run from scratch (no cache): the
    reference for the equality test and the no-reuse baseline of the benchmark. Rows are batched
    ``batch_size`` at a time (whole prefixes with all their suffixes), right-padded."""
    _check_ids("prefixes", prefix_ids)
    _check_ids("suffixes", suffix_ids)
    layers = normalize_layers(layers, num_layers_of(model))
    device = _device(model)
    n_suf = len(suffix_ids)
    per_batch = max(1, int(batch_size) // n_suf)
    order = _prefix_order(prefix_ids)
    out = None
    for start in range(0, len(order), per_batch):
        idx = order[start:start + per_batch]
        rows = [list(prefix_ids[i]) + list(s) for i in idx for s in suffix_ids]
        ids, mask = _right_pad(rows, pad_id)
        ids, mask = ids.to(device), mask.to(device)
        res = model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
        h = _gather_last(res.hidden_states, layers, mask.sum(1) - 1)
        if out is None:
            out = torch.empty((len(prefix_ids), n_suf, len(layers), h.shape[-1]), dtype=torch.float32)
        out[torch.as_tensor(idx)] = h.view(len(idx), n_suf, len(layers), -1)
        if stats is not None:
            stats["forward_passes"] = stats.get("forward_passes", 0) + 1
            stats["full_tokens"] = stats.get("full_tokens", 0) + ids.numel()
    return out


@torch.no_grad()
def mean_pooled_states(model, ids: Sequence[Sequence[int]], layers: Sequence[int], *, pad_id: int = 0,
                       batch_size: int = 32, stats: dict | None = None,
                       share_lengths: Sequence[int] | None = None) -> torch.Tensor:
    """Mean over the real tokens of each sequence, (n, n_layers, d) float32 on the CPU (the mean-pooled baseline's
    features). ``stats`` counts ``forward_passes`` as in :func:`suffix_states`; ``share_lengths`` as there."""
    _check_ids("sequences", ids)
    layers = normalize_layers(layers, num_layers_of(model))
    device = _device(model)
    order = _prefix_order(ids) if share_lengths is None else batch_order(ids, share_lengths, int(batch_size))
    out = None
    for start in range(0, len(order), int(batch_size)):
        idx = order[start:start + int(batch_size)]
        x, mask = _right_pad([ids[i] for i in idx], pad_id)
        x, mask = x.to(device), mask.to(device)
        shared = None if share_lengths is None else shared_pass(model, x, mask, [share_lengths[i] for i in idx],
                                                                 hidden_states=True)
        if shared is None:
            res = model(input_ids=x, attention_mask=mask, use_cache=False, output_hidden_states=True)
            states = [res.hidden_states[k] for k in layers]
        else:
            states = [shared.states(k) for k in layers]
        if stats is not None:
            stats["forward_passes"] = stats.get("forward_passes", 0) + (1 if shared is None else 2)
        w = mask.unsqueeze(-1).float()
        pooled = torch.stack([(h.float() * w).sum(1) / w.sum(1) for h in states], 1).cpu()
        if out is None:
            out = torch.empty((len(ids), len(layers), pooled.shape[-1]), dtype=torch.float32)
        out[torch.as_tensor(idx)] = pooled
    return out
