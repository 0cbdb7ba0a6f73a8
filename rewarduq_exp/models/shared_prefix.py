"""One forward of a batch whose rows start with the same tokens: each distinct prefix (the prompt) is run once.

Preference data repeats prompts: chosen and rejected share theirs, K completions share one, and a dataset may ask
the same instruction thousands of times (VADER's four prompts behind the default system prompt of SmolLM2: 40 of a
text's 67 tokens). A plain right-padded forward runs the prompt once per row. :func:`shared_prefix_hidden` runs a
batch in two passes of the same model instead:

1. the batch's distinct prefixes (right-padded), with ``use_cache=True``;
2. every row's remainder (its suffix, right-padded) on that cache, whose rows are picked from the distinct prefixes
   (``Cache.batch_select_indices`` with an index that repeats), with ``position_ids = P_b + offset`` (the positions
   of a plain forward) and the 2D mask ``[prefix mask | suffix mask]``, so no row sees another prefix's padding.

The hidden states of both passes are put back into the ``(B, L, H)`` layout of the plain forward, so a caller
(pooling, completion log-probs, the DPO loss) gets the same tensor, equal to float rounding; gradients flow through
the cache into the prefix pass, so training is exact too. Work drops from ``B * L`` token positions to
``U * P + B * S`` (``U`` distinct prefixes of ``P`` tokens, suffixes of ``S``).

Where it does not apply the plain forward runs: every prefix in the batch distinct (nothing to share), attention
other than sdpa/eager (the mask has holes, which e.g. flash-attention's unpadding does not take), or activation
checkpointing in training (transformers turns the cache off there).
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import numpy as np
import torch

from rewarduq_exp.data.contract import token_ids

PACKED_ATTENTION = ("sdpa", "eager")  # attention that takes a custom mask (with holes, or 4D)


@lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    """The forward keyword that takes a KV cache: transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old
    name warns on every call and goes in 5.40); earlier 5.x releases know only ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _with_cache(model, cache) -> dict:
    # A PEFT wrapper forwards **kwargs to its base model: the keyword is the base model's.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {_cache_keyword(type(base)): cache}


def _returned_cache(output):
    """The cache a forward returned, under either release's name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def packed_supported(model) -> bool:
    """Packed suffixes need a custom 4D attention mask, which the sdpa and eager attention paths take as given."""
    return getattr(model.config, "_attn_implementation", None) in PACKED_ATTENTION


def common_prefix_lengths(full_ids, prefix_ids) -> np.ndarray:
    """Per row, how many leading tokens of ``full_ids[i]`` equal ``prefix_ids[i]`` (e.g. the prompt rendered with
    the generation prompt): the shareable part, cut where the two tokenisations diverge, and always leaving at least
    one token of the row to its suffix."""
    out = np.zeros(len(full_ids), dtype=np.int64)
    for i, (full, pre) in enumerate(zip(full_ids, prefix_ids)):
        n = 0
        for a, b in zip(full, pre):
            if a != b:
                break
            n += 1
        out[i] = min(n, len(full) - 1)
    return out


def share_lengths(tokenizer, ids, heads) -> np.ndarray | None:
    """Per tokenised text, how many leading tokens it shares with its head (its prompt rendered alone, as the text
    renders it): the part that texts with the same prompt may share; ``None`` without heads."""
    if heads is None:
        return None
    return common_prefix_lengths(ids, token_ids(tokenizer, list(heads)))


def _batch_positions(idx: np.ndarray, lengths: np.ndarray, keys: list, cut: np.ndarray) -> int:
    """Token positions that one batch runs: the cheaper of a plain forward and the shared one."""
    plain = len(idx) * int(lengths[idx].max())
    distinct = {keys[i]: int(cut[i]) for i in idx}
    if len(distinct) == len(idx):
        return plain
    return min(plain, len(distinct) * max(distinct.values()) + len(idx) * int((lengths[idx] - cut[idx]).max()))


def _positions(order: np.ndarray, lengths: np.ndarray, keys: list, cut: np.ndarray, batch_size: int) -> int:
    """Token positions that batches of ``order`` run: per batch the cheaper of a plain forward and the shared one."""
    return sum(_batch_positions(order[s:s + batch_size], lengths, keys, cut) for s in range(0, len(order), batch_size))


def _orders(ids, cut) -> tuple[np.ndarray, np.ndarray, np.ndarray, list, np.ndarray]:
    """(lengths, longest-first order, grouped-by-prefix order, prefix keys, cut) of sequences ``ids``."""
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    cut = np.asarray(cut, dtype=np.int64)
    by_length = np.argsort(-lengths, kind="stable")
    keys = [tuple(x[:c]) for x, c in zip(ids, cut)]
    rank = {k: r for r, k in enumerate(sorted(set(keys), key=lambda k: (-len(k), k)))}
    grouped = np.lexsort((-(lengths - cut), np.fromiter((rank[k] for k in keys), dtype=np.int64, count=len(keys))))
    return lengths, by_length, grouped, keys, cut


def batch_order(ids, cut, batch_size: int) -> np.ndarray:
    """The order in which to batch sequences ``ids`` (shareable prefix lengths ``cut``) in batches of ``batch_size``:
    longest first (little padding, as a plain forward wants), or grouped by prefix and longest suffix first within a
    group (rows of one batch share their prefix), whichever runs fewer token positions
    (:func:`shared_prefix_hidden`). Longest first either way, so an out-of-memory error shows in the first batch."""
    lengths, by_length, grouped, keys, cut = _orders(ids, cut)
    if _positions(grouped, lengths, keys, cut, batch_size) < _positions(by_length, lengths, keys, cut, batch_size):
        return grouped
    return by_length


def token_batches(ids, cut, max_tokens: int, max_rows: int | None = None) -> list[np.ndarray]:
    """Batches of sequences ``ids`` (shareable prefix lengths ``cut``; zeros: nothing shared) under a token budget:
    each batch holds at most ``max_tokens`` padded positions (rows x its longest row) and ``max_rows`` rows
    (:func:`rewarduq_exp.models.token_budget.split_by_tokens`), taken longest first or grouped by prefix, whichever
    runs fewer token positions (as :func:`batch_order`)."""
    from rewarduq_exp.models.token_budget import split_by_tokens

    if not len(ids):
        return []
    lengths, by_length, grouped, keys, cut = _orders(ids, cut)
    plain = split_by_tokens(by_length, lengths, max_tokens, max_rows)
    if not cut.any():
        return plain
    shared = split_by_tokens(grouped, lengths, max_tokens, max_rows)

    def cost(batches):
        return sum(_batch_positions(b, lengths, keys, cut) for b in batches)

    return shared if cost(shared) < cost(plain) else plain


def prefix_groups(input_ids: torch.Tensor, prefix_lengths, adapter_names=None) -> tuple[list, list[int]]:
    """The distinct prefixes of a batch (``(adapter name, tokens)``) and, per row, the index of its prefix among
    them. Rows under different adapters never share one: the adapter changes the prefix's keys and values."""
    ids = input_ids.tolist()
    names = adapter_names if adapter_names is not None else [None] * len(ids)
    index: dict[tuple, int] = {}
    rows = [index.setdefault((a, tuple(r[:int(p)])), len(index)) for r, p, a in zip(ids, prefix_lengths, names)]
    return list(index), rows


def _adapters(adapter_names) -> dict:
    return {} if adapter_names is None else {"adapter_names": list(adapter_names)}


def _checkpointing(model) -> bool:
    """Whether activation checkpointing is on. transformers 5.2x reads it as ``is_activation_checkpointing``; the old
    ``is_gradient_checkpointing`` (earlier releases, and PEFT's wrappers of them) now warns on every read."""
    try:
        return bool(model.is_activation_checkpointing)
    except AttributeError:
        return bool(getattr(model, "is_gradient_checkpointing", False))


def can_share(model) -> bool:
    """Whether the two-pass forward is exact for this model as it runs now (module docstring)."""
    return packed_supported(model) and not (model.training and _checkpointing(model))


class SharedPass:
    """The two passes of one batch (module docstring): the hidden states in the plain forward's layout, and the KV
    cache of the whole rows (prefix rows picked per row, then the suffixes) with its 2D mask, for a caller that
    appends more tokens (BoRP's probe suffixes after a conversation)."""

    def __init__(self, first, second, pick, cut, width: int, cache, mask, tokens: int):
        self.first, self.second, self.pick = first, second, pick
        self.cache, self.mask = cache, mask
        self.tokens = tokens  # token positions the two passes ran
        p_width, s_width = first.last_hidden_state.shape[1], second.last_hidden_state.shape[1]
        # Row b's position t: from the prefix pass while t < cut_b, then from the suffix pass at t - cut_b.
        t = torch.arange(width, device=cut.device)[None]
        self.where = torch.where(t < cut[:, None], t, p_width + (t - cut[:, None]).clamp(max=s_width - 1))

    def states(self, layer: int | None = None) -> torch.Tensor:
        """(B, L, H) at ``layer`` (``None``: the last hidden state, after the final norm; ``k``: hidden_states[k],
        which needs ``output_hidden_states``)."""
        if layer is None:
            h_prefix, h_suffix = self.first.last_hidden_state, self.second.last_hidden_state
        else:
            h_prefix, h_suffix = self.first.hidden_states[layer], self.second.hidden_states[layer]
        both = torch.cat([h_prefix[self.pick], h_suffix], 1)                          # (B, P + S, H)
        return both.gather(1, self.where[..., None].expand(-1, -1, both.shape[-1]))


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def _host_and_device(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """(ids, mask) on the host, for the bookkeeping that reads them as Python values, and on the model's device.
    Callers that pass host tensors (pinned, as the feature encoder's) pay one asynchronous copy and no
    synchronisation; device tensors are copied back once."""
    device = _model_device(model)
    host_ids, host_mask = input_ids.cpu(), attention_mask.cpu()
    if input_ids.device != device:
        input_ids = input_ids.to(device, non_blocking=True)
        attention_mask = attention_mask.to(device, non_blocking=True)
    return host_ids, host_mask, input_ids, attention_mask


def _count(stats: dict | None, run: int, plain: int) -> None:
    if stats is not None:
        stats["tokens_run"] = stats.get("tokens_run", 0) + run
        stats["tokens_without_sharing"] = stats.get("tokens_without_sharing", 0) + plain


def _clipped(prefix_lengths, lengths) -> list[int]:
    """Shareable lengths within 1 .. length - 1: a prefix of at least one token, a suffix of at least one."""
    return [max(1, min(int(p), n - 1)) if n > 1 else n for p, n in zip(prefix_lengths, lengths)]


def _halves(input_ids: torch.Tensor, lengths: np.ndarray, cut: np.ndarray, adapter_names=None):
    """The rows split in two by suffix length, where two shared forwards run at most 80 % of the positions of one:
    rows in random order (a training batch) pad every suffix to the longest one. With ``adapter_names`` every
    adapter's rows split alike (the same slots in each half)."""
    batch = len(cut)
    if batch < 4:
        return None
    prefixes, rows = prefix_groups(input_ids, cut, adapter_names)
    keys = [prefixes[r] for r in rows]
    suffix = lengths - cut
    if adapter_names is None:
        order = np.argsort(suffix, kind="stable")
        halves = order[: batch // 2], order[batch // 2:]
    else:
        # Rows under adapters: split by slot (a row's rank among the rows of its adapter), each half in row order,
        # so a batch of equal contiguous member blocks (the batched multi-LoRA forward) splits into two such batches.
        slot = np.empty(batch, dtype=np.int64)
        seen: dict = {}
        for i, name in enumerate(adapter_names):
            slot[i] = seen.get(name, 0)
            seen[name] = slot[i] + 1
        longest = np.zeros(int(slot.max()) + 1, dtype=np.int64)
        np.maximum.at(longest, slot, suffix)
        if len(longest) < 2:
            return None
        first = np.isin(slot, np.argsort(longest, kind="stable")[: len(longest) // 2])
        halves = np.flatnonzero(first), np.flatnonzero(~first)
    one = _positions(np.arange(batch), lengths, keys, cut, batch)
    two = sum(_positions(h, lengths, keys, cut, len(h)) for h in halves)
    return halves if two <= 0.8 * one else None


def shared_pass(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix_lengths,
                hidden_states: bool = False, stats: dict | None = None, adapter_names=None) -> SharedPass | None:
    """Both passes of a right-padded batch, each distinct prefix run once; ``None`` where that does not apply
    (every prefix distinct, or :func:`can_share` false), for the caller to run its plain forward.

    ``prefix_lengths[b]``: how many leading tokens of row ``b`` may be shared (1 .. its length - 1; clipped to that);
    rows share a prefix when those tokens are equal. ``hidden_states``: keep every layer's states (for
    ``SharedPass.states(k)``). ``stats`` (optional dict) adds the token positions run (``tokens_run``) and those a
    plain forward runs (``tokens_without_sharing``), also when ``None`` is returned. ``adapter_names``: row ``b``
    runs under adapter ``adapter_names[b]`` (a PEFT mixed-adapter batch, or a ``MultiLoRAModel`` whose rows are
    equal member blocks): each pass gets the names of its rows, and the prefix pass's rows (one per adapter and
    prefix, in order of first appearance) stay in equal member blocks when the rows were.
    """
    host_ids, host_mask, input_ids, attention_mask = _host_and_device(model, input_ids, attention_mask)
    lengths = host_mask.sum(1).tolist()
    batch, width = input_ids.shape
    cut = _clipped(prefix_lengths, lengths)
    prefixes, row_prefix = prefix_groups(host_ids, cut, adapter_names)
    if len(prefixes) == batch or not can_share(model):
        _count(stats, batch * width, batch * width)
        return None
    device = input_ids.device
    p_width = max(len(p) for _, p in prefixes)
    pre_ids = torch.zeros((len(prefixes), p_width), dtype=torch.long)  # padding: any id, masked out
    pre_mask = torch.zeros((len(prefixes), p_width), dtype=attention_mask.dtype)
    for u, (_, p) in enumerate(prefixes):
        pre_ids[u, :len(p)] = torch.tensor(p)
        pre_mask[u, :len(p)] = 1
    pre_ids, pre_mask = pre_ids.to(device, non_blocking=True), pre_mask.to(device, non_blocking=True)
    first = model(input_ids=pre_ids, attention_mask=pre_mask, use_cache=True, output_hidden_states=hidden_states,
                  **_adapters(None if adapter_names is None else [a for a, _ in prefixes]))
    cache = _returned_cache(first)
    pick = torch.tensor(row_prefix).to(device, non_blocking=True)
    cache.batch_select_indices(pick)  # row b: its prefix's keys and values (rows may repeat one prefix)

    s_width = max(max(n - c for n, c in zip(lengths, cut)), 1)
    cut_t = torch.tensor(cut).to(device, non_blocking=True)
    suffix_len = torch.tensor(lengths).to(device, non_blocking=True) - cut_t
    offset = torch.arange(s_width, device=device)
    source = (cut_t[:, None] + offset[None]).clamp(max=width - 1)          # position in the row of suffix token j
    suf_mask = (offset[None] < suffix_len[:, None]).to(attention_mask.dtype)
    mask = torch.cat([pre_mask[pick], suf_mask], 1)
    second = model(input_ids=input_ids.gather(1, source), attention_mask=mask,
                   position_ids=cut_t[:, None] + offset[None], use_cache=True, output_hidden_states=hidden_states,
                   **_with_cache(model, cache), **_adapters(adapter_names))
    tokens = pre_ids.numel() + batch * s_width
    _count(stats, tokens, batch * width)
    return SharedPass(first, second, pick, cut_t, width, _returned_cache(second), mask, tokens)


def shared_prefix_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix_lengths,
                         layer: int | None = None, stats: dict | None = None, split: bool = True,
                         adapter_names=None) -> torch.Tensor:
    """Hidden states ``(B, L, H)`` of right-padded rows, as one plain forward of ``model`` (a headless decoder)
    gives them, with each distinct prefix computed once (:func:`shared_pass`; arguments as there). ``split``: run
    the rows in two halves by suffix length where that runs at most 80 % of the positions (:func:`_halves`).
    ``adapter_names``: the adapter of each row (:func:`shared_pass`).

    ``layer``: ``None`` = the last hidden state (after the final norm), ``k`` = ``hidden_states[k]``. Positions past
    a row's length hold an arbitrary row's state, as padding does.
    """
    host_ids, host_mask, input_ids, attention_mask = _host_and_device(model, input_ids, attention_mask)
    lengths = host_mask.sum(1).numpy()
    cut = np.asarray(_clipped(prefix_lengths, lengths.tolist()), dtype=np.int64)
    halves = _halves(host_ids, lengths, cut, adapter_names) if split and can_share(model) else None
    if halves is not None:  # two forwards of similar suffix lengths, put back in the batch's row order and width
        batch, width = input_ids.shape
        parts, counted = [], {}
        for rows in halves:
            idx = torch.as_tensor(rows)
            part_width = int(lengths[rows].max())
            names = None if adapter_names is None else [adapter_names[i] for i in rows]
            h = shared_prefix_hidden(model, host_ids[idx, :part_width], host_mask[idx, :part_width], cut[rows],
                                     layer, counted, split=False, adapter_names=names)
            parts.append(torch.nn.functional.pad(h, (0, 0, 0, width - part_width)))
        _count(stats, counted.get("tokens_run", 0), batch * width)
        inverse = torch.as_tensor(np.argsort(np.concatenate(halves))).to(input_ids.device, non_blocking=True)
        return torch.cat(parts)[inverse]
    run = shared_pass(model, input_ids, attention_mask, cut, hidden_states=layer is not None, stats=stats,
                      adapter_names=adapter_names)
    if run is not None:
        return run.states(layer)
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                output_hidden_states=layer is not None, **_adapters(adapter_names))
    return out.last_hidden_state if layer is None else out.hidden_states[layer]
