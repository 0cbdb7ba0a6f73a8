"""MCD-DPO's log-prob math: completion tokenisation, summed completion log-probs from final hidden states (chunked,
optionally with dropout before the LM head), and the K-mask MC-dropout log-probs of scoring with their per-sequence
mask seeds.

Nothing here holds a (B, L, V) or (K, B, L, V) logits tensor: only the positions that predict a completion token go
through the LM head, a chunk of them at a time.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from rewarduq_exp.core.errors import UserError


# ---------------------------------------------------------------------------------------------------- tokenisation
def _messages(value) -> list[dict]:
    """Plain list of {role, content} dicts (parquet round trips give numpy arrays of dicts)."""
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in list(value)]


def _template_ids(tokenizer, messages, **kw) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def tokenize_completion(tokenizer, prompt, completion) -> tuple[list[int], int]:
    """(ids of prompt + completion, index of the first completion token).

    The same split as TRL's DPO tokenisation (which training uses): the prompt is rendered with the generation prompt
    and the completion starts where that and the full conversation diverge, so the completion holds everything the
    template adds for the assistant turn (e.g. Qwen3's empty think block and the closing ``<|im_end|>\\n``).
    """
    prompt_ids = _template_ids(tokenizer, prompt, add_generation_prompt=True)
    full = _template_ids(tokenizer, list(prompt) + list(completion))
    start = 0
    for a, b in zip(prompt_ids, full):
        if a != b:
            break
        start += 1
    if start >= len(full):
        raise UserError("a completion renders to no tokens after its prompt; check the data's assistant turns")
    return full, max(start, 1)  # the first token has no prediction; a completion never starts at position 0


# ---------------------------------------------------------------------------------------------------- log-probs
def _target_positions(completion_mask: torch.Tensor):
    """Rows/positions whose hidden state predicts a completion token: h[:, t] predicts input_ids[:, t + 1]."""
    shifted = completion_mask[:, 1:].bool()
    rows, cols = shifted.nonzero(as_tuple=True)
    return rows, cols


def _token_logps(h: torch.Tensor, lm_head, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) for hidden states ``h`` (..., H) and ``targets`` (...); logits only for this chunk."""
    logits = lm_head(h).float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def completion_logps(hidden: torch.Tensor, lm_head, input_ids: torch.Tensor, completion_mask: torch.Tensor,
                     chunk: int, dropout: float = 0.0, training: bool = False,
                     generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """Summed completion log-probs (B,) from final hidden states (B, L, H), in chunks of ``chunk`` positions.

    With ``training`` the chunk's dropout + LM head are re-run in the backward pass (activation checkpointing), so
    training also never keeps more than one chunk's logits. The dropout masks of row ``b`` are draws of
    ``generators[b]`` when given (:func:`step_seed`: a row's masks then depend on the row and the optimizer step, not
    on which micro-batch or process it lands in), else of torch's global RNG.
    """
    rows, cols = _target_positions(completion_mask)
    h = hidden[rows, cols]                       # (N, H): only positions that predict a completion token
    targets = input_ids[rows, cols + 1]
    out = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
    drop = dropout > 0 and training
    kept = _row_keep_masks(generators, rows, h.shape[-1], dropout, h.device) if drop and generators else None

    def piece(hc, tc, keep):
        return _token_logps(hc if keep is None else hc * keep, lm_head, tc)

    for s in range(0, len(h), chunk):
        hc, tc = h[s:s + chunk], targets[s:s + chunk]
        # The mask is drawn outside the checkpointed function, so the backward recomputation reuses the very same
        # mask without torch's RNG-state preservation (which costs ~10x the chunk's work on CPU).
        keep = None
        if kept is not None:
            keep = kept[s:s + chunk].to(hc.dtype) / (1.0 - dropout)
        elif drop:
            keep = (torch.rand_like(hc) >= dropout).to(hc.dtype) / (1.0 - dropout)
        if training and torch.is_grad_enabled() and hc.is_cuda:  # CPU: checkpoint costs ~10x here, memory is no issue
            lp = checkpoint(piece, hc, tc, keep, use_reentrant=False, preserve_rng_state=False)
        else:
            lp = piece(hc, tc, keep)
        out = out.index_add(0, rows[s:s + chunk], lp)
    return out


def _row_keep_masks(generators, rows: torch.Tensor, hidden_size: int, p: float, device) -> torch.Tensor:
    """Boolean keep-masks (N, H) of the completion positions ``rows`` (row-major, as :func:`_target_positions`
    gives them): each row's positions are consecutive draws of its own generator."""
    counts = torch.bincount(rows, minlength=len(generators)).tolist()
    if len(counts) > len(generators):
        raise ValueError(f"{len(generators)} generators for {len(counts)} rows")
    parts = [torch.rand((n, hidden_size), generator=generators[b], device=device) >= p
             for b, n in enumerate(counts) if n]
    return torch.cat(parts) if parts else torch.zeros((0, hidden_size), dtype=torch.bool, device=device)


def step_seed(row: int, step: int) -> int:
    """The training-mask seed of one sequence at one optimizer step: its :func:`row_seed` and the step, hashed, so
    each epoch (each step a row is seen at) draws new masks, and a resumed run draws the very masks it would have."""
    digest = hashlib.blake2b(int(step).to_bytes(8, "little", signed=True), digest_size=8,
                             key=int(row).to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def draw_masks(generator: torch.Generator, n_tokens: int, num_samples: int, hidden_size: int, p: float,
               device, dtype) -> torch.Tensor:
    """Scaled keep-masks (num_samples, n_tokens, H), drawn token-major.

    Token-major order means the masks of consecutive tokens are consecutive draws of the generator, so on CPU the
    masks do not depend on how the positions are chunked (the test compares chunked with one-shot computation).
    """
    keep = torch.rand((n_tokens, num_samples, hidden_size), generator=generator, device=device) >= p
    return (keep.to(dtype) / (1.0 - p)).transpose(0, 1)


def row_seed(seed: int, token_ids) -> int:
    """The dropout-mask seed of one scored sequence: the method's seed and a hash of the sequence's token ids.

    Seeding per sequence (not once per call) makes a completion's MC-dropout score a function of that completion
    alone: the same under any batch, order or company of other texts (an RL loop scores each sample once, in
    whatever batch the trainer forms)."""
    digest = hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=8,
                             key=int(seed).to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def row_generators(seeds, device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


@torch.no_grad()
def mc_completion_logps(hidden: torch.Tensor, lm_head, input_ids: torch.Tensor, completion_mask: torch.Tensor,
                        num_samples: int, p: float, generators: list[torch.Generator], chunk: int) -> torch.Tensor:
    """(K, B) summed completion log-probs under K dropout masks on the final hidden states.

    ``hidden`` comes from ONE forward of the transformer body. Per chunk of ``chunk`` completion positions the K
    masked copies go through the LM head at once: (K, chunk, V) logits at most, never (K, B, L, V). Row b's masks are
    consecutive draws of ``generators[b]`` (see :func:`row_seed`), so they do not depend on the chunking nor on the
    other rows of the batch.
    """
    if len(generators) != hidden.shape[0]:
        raise ValueError(f"{len(generators)} generators for {hidden.shape[0]} rows")
    rows, cols = _target_positions(completion_mask)
    h = hidden[rows, cols]
    targets = input_ids[rows, cols + 1]
    out = torch.zeros(num_samples, hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, len(h), chunk):
        hc, tc, rc = h[s:s + chunk], targets[s:s + chunk], rows[s:s + chunk]
        # Positions come row-major (nonzero), so a chunk holds a few runs of rows; each run draws from its row's
        # generator. The loop is over the rows of a chunk, the K masks of a run are one draw.
        row_ids, counts = torch.unique_consecutive(rc, return_counts=True)
        masks = torch.cat([draw_masks(generators[int(r)], int(c), num_samples, hidden.shape[-1], p, hidden.device,
                                      hidden.dtype) for r, c in zip(row_ids.tolist(), counts.tolist())], dim=1)
        lp = _token_logps(hc.unsqueeze(0) * masks, lm_head, tc.unsqueeze(0).expand(num_samples, -1))  # (K, c)
        out.index_add_(1, rc, lp)
    return out
