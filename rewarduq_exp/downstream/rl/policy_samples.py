"""Samples of a causal-LM policy and their KL to a reference policy.

**The KL.** KL(pi || pi_ref) of whole completions is E_y[sum_t log pi(y_t | x, y_<t) - log pi_ref(y_t | x, y_<t)].
Two unbiased estimates come from the same samples y ~ pi:

- ``kl``: the sum over the sampled prefixes of the *exact* per-token KL, sum_t KL(pi(. | x, y_<t) || pi_ref(. | x,
  y_<t)) over the whole vocabulary. Its expectation is the sequence KL (the chain rule of the KL, taken along the
  sampled path), and it has a lower variance than the log-ratio because each token's own draw is integrated out.
  A small policy's vocabulary (2048 tokens for the tiny model, 49k for SmolLM2) makes the full sums cheap; this is
  the one the tables and figures use;
- ``kl_log_ratio``: the plain sum of log pi(y_t) - log pi_ref(y_t) (k1), kept beside it as a check.

Both are tested against the exact KL of a small policy whose every completion is enumerated. The sampling is at
temperature 1 without top-k or top-p, so the samples are draws of the policy the KL is about. A completion ends with
its end-of-sequence token (its probability counts) or at ``max_new_tokens`` (both policies are cut alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Samples:
    input_ids: torch.Tensor        # (N, Lp + Lc): left-padded prompt, then the completion (right-padded)
    attention_mask: torch.Tensor   # (N, Lp + Lc)
    prompt_width: int              # Lp
    completion_mask: torch.Tensor  # (N, Lc): the completion's tokens, its end-of-sequence token included
    texts: list[str]               # the completions, decoded without special tokens

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(1)


def render_prompts(tokenizer, prompts: list[list[dict]]) -> list[str]:
    return [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch (as ``generate`` computes them), so a forward pass sees what sampling saw."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def sample(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, seed: int) -> Samples:
    """One completion per prompt (repeat a prompt for several), drawn at temperature 1 under its own seeded stream
    (``fork_rng``: the caller's random state, e.g. a trainer's, is left as it was)."""
    tokenizer.padding_side = "left"
    batch = tokenizer(render_prompts(tokenizer, prompts), return_tensors="pt", padding=True, add_special_tokens=False)
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(int(seed))
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=int(max_new_tokens), eos_token_id=eos, pad_token_id=pad)
    width = batch["input_ids"].shape[1]
    completion = out[:, width:]
    is_eos = completion == eos
    # the tokens up to and including the first end-of-sequence token
    before_end = (is_eos.long().cumsum(1) - is_eos.long()) == 0
    completion_mask = before_end.long()
    attention = torch.cat([batch["attention_mask"], completion_mask], dim=1)
    texts = tokenizer.batch_decode(completion.masked_fill(completion_mask == 0, pad), skip_special_tokens=True)
    return Samples(out, attention, width, completion_mask, [t.strip() for t in texts])


def completion_log_probs(model, samples: Samples, rows: slice) -> torch.Tensor:
    """log pi(. | x, y_<t) over the vocabulary at each completion position of ``rows``: (n, Lc, V), float64."""
    ids, mask = samples.input_ids[rows], samples.attention_mask[rows]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
    width = samples.prompt_width
    return torch.log_softmax(logits[:, width - 1:-1].double(), dim=-1)


@torch.no_grad()
def sequence_kl(policy, reference, samples: Samples, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact per-token sums, log-ratio sums), each (N,): the two estimates of the module docstring."""
    exact, log_ratio = [], []
    n = samples.input_ids.shape[0]
    for start in range(0, n, chunk):   # chunks: a 49k vocabulary x 64 samples x 32 tokens is 800 MB in float64
        rows = slice(start, start + chunk)
        lp, lq = completion_log_probs(policy, samples, rows), completion_log_probs(reference, samples, rows)
        mask = samples.completion_mask[rows].double()
        per_token = (lp.exp() * (lp - lq)).sum(-1)
        tokens = samples.input_ids[rows, samples.prompt_width:].unsqueeze(-1)
        ratio = (lp.gather(-1, tokens) - lq.gather(-1, tokens)).squeeze(-1)
        exact.append((per_token * mask).sum(1))
        log_ratio.append((ratio * mask).sum(1))
    return torch.cat(exact).cpu(), torch.cat(log_ratio).cpu()
