"""The generative "Score-Only" judge baseline of BoRP (appendix B, figure 8; Tables 1, 2, 5), read from one forward.

The judge is asked about the same target as the probe it is compared with: :func:`judge_instruction` turns the
probe's instruction (the generic question, or the refined probe's rubrics) into a rating request on the probe's score
scale, so the comparison measures the reading method (a probe on hidden states vs a decoded score), not two
different questions. The judge prompt is appended to the conversation as a further user turn (the same suffix
construction as the probe, :func:`~rewarduq_exp.models.prefix_cache.render_suffix`, with Qwen3's empty think block),
and instead of decoding we read the next-token distribution restricted to the score tokens "1".."5":

    p_k = softmax_k(logit(score_k)),  expected = sum_k p_k * k,  argmax = argmax_k p_k

(the restricted softmax renormalises over the score tokens; ``mass`` is the probability the unrestricted softmax puts
on them, a check that the model follows the "answer with one digit" instruction). ``argmax`` is what greedy decoding
of a single score token gives, the paper's score-only judge (it parses the decoded digit): the default score
(``JUDGE_SCORINGS``: ``digit``); ``expected``, the judgment-distribution mean (Zhu et al. 2025, cited by the paper), is
the option ``expected``.
The conversation runs once and its KV cache is reused for the judge suffix (with one suffix this saves nothing
within a call, but it is the same code path as the probe and the prefix batching applies).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.models import prefix_cache
from rewarduq_exp.models.shared_prefix import share_lengths

SCORE_ONLY_INSTRUCTION = (
    "Rate the assistant's replies in the conversation above on a scale from 1 (very poor) to 5 (excellent). "
    "Answer with a single digit and nothing else.")
JUDGE_SCORINGS = ("digit", "expected")  # the decoded digit (the paper) | the probability-weighted mean


# The judge's rating request after the probe's question; a probe config may word it for its target
# (probe.judge_scale, e.g. the sentiment probe rates the feeling of the text, not the assistant's performance).
JUDGE_SCALE = "Rate the assistant's performance on a scale from {low} ({negative}) to {high} ({positive})."


def judge_instruction(probe_instruction: str, *, low: int = 1, high: int = 5, negative: str = "very poor",
                      positive: str = "excellent", scale: str = JUDGE_SCALE) -> str:
    """The judge's request for the probe's target: the probe's instruction (its question or rubric) without "in one
    word" (the probe reads a polarity word; the judge answers with a digit), then the rating scale of the probe's
    scores (``scale``, with ``{low}``, ``{high}``, ``{negative}``, ``{positive}``), anchored by the probe's polarity
    words."""
    # A sentence that only asks for the one word goes whole ("... express? Answer in one word." -> "... express?");
    # elsewhere the phrase alone ("Judge the performance in one word." -> "Judge the performance.").
    kept = re.sub(r"\s*\bAnswer in one word\s*[.!]?", "", probe_instruction.strip(), flags=re.IGNORECASE)
    kept = re.sub(r"\s*\bin one word\b", "", kept, flags=re.IGNORECASE)
    try:
        request = scale.format(low=low, high=high, negative=negative, positive=positive)
    except (KeyError, IndexError, ValueError):
        raise UserError(f"probe.judge_scale={scale!r} is invalid: it may use only {{low}}, {{high}}, {{negative}} "
                        "and {positive}") from None
    return f"{kept}\n{request} Answer with a single digit and nothing else.".strip()


@dataclass
class JudgeResult:
    expected: np.ndarray    # (n,) sum_k p_k * score_k
    argmax: np.ndarray      # (n,) the most probable score
    probs: np.ndarray       # (n, K) over the score tokens, rows sum to 1
    mass: np.ndarray        # (n,) probability of the score tokens under the full next-token softmax

    def scores(self, scoring: str = "digit") -> np.ndarray:
        """The judge's score: the decoded digit (``digit``, default) or the probability-weighted mean."""
        if scoring not in JUDGE_SCORINGS:
            raise UserError(f"judge scoring={scoring!r} is invalid; allowed: {', '.join(JUDGE_SCORINGS)}")
        return np.asarray(self.argmax if scoring == "digit" else self.expected, dtype=float)


class ScoreOnlyJudge:
    """``lm`` is a causal LM (``backbone.from_pretrained(AutoModelForCausalLM)``); its decoder runs the prefix and
    the suffix, its output embedding (LM head) maps the final hidden state to logits."""

    def __init__(self, tokenizer, lm, instruction: str = SCORE_ONLY_INSTRUCTION, *, answer: str = "",
                 scores: Sequence[str] = ("1", "2", "3", "4", "5"), think: str = "auto", batch_size: int = 32,
                 reuse: bool = True):
        self.tokenizer = tokenizer
        # The LM, or a function that loads it on first use: a run whose judgments are all in the feature cache
        # never loads it.
        self._lm = lm
        self.suffix = prefix_cache.render_suffix(tokenizer, instruction, answer, think)
        self.values = np.array([float(s) for s in scores])
        self.score_ids = []
        for s in scores:
            ids = tokenizer(str(s), add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise UserError(f"judge score {s!r} is {len(ids)} tokens for this tokenizer; each score must be "
                                f"one token (allowed: single digits such as 1..5)")
            self.score_ids.append(int(ids[0]))
        if len(set(self.score_ids)) != len(self.score_ids):
            raise UserError(f"judge scores {list(scores)} must be distinct tokens")
        self.batch_size = int(batch_size)
        self.reuse = bool(reuse)
        self.stats: dict = {}  # forward passes and tokens (prefix_cache's counters)

    @classmethod
    def from_backbone(cls, backbone, instruction: str = SCORE_ONLY_INSTRUCTION, **kwargs):
        from transformers import AutoModelForCausalLM

        def load():
            lm = backbone.from_pretrained(AutoModelForCausalLM, "causal LM", dtype=backbone.dtype)
            return lm.requires_grad_(False).eval().to(backbone.device)

        return cls(backbone.tokenizer, load, instruction, **kwargs)

    @property
    def lm(self):
        if callable(self._lm) and not isinstance(self._lm, torch.nn.Module):
            self._lm = self._lm()
        return self._lm

    def identity(self) -> dict:
        """What determines the judgments besides the backbone and the conversations (the feature-cache key)."""
        return {"kind": "score_only_judge", "suffix": self.suffix, "score_ids": self.score_ids}

    def judge(self, prompts, responses) -> JudgeResult:
        prefixes = [prefix_cache.render_prefix(self.tokenizer, p, r) for p, r in zip(prompts, responses)]
        heads = [prefix_cache.render_prefix(self.tokenizer, p, []) for p in prompts]
        return self.result(self.raw(prefixes, heads))

    @torch.no_grad()
    def raw(self, prefixes: Sequence[str], heads: Sequence[str] | None = None) -> torch.Tensor:
        """(n, K + 1) float32: the logits of the K score tokens after each rendered conversation + the judge suffix,
        then the log of the probability the full softmax puts on them (what :meth:`result` needs, and all the cache
        keeps). ``heads[i]``: the start of ``prefixes[i]`` shared by conversations with the same prompt."""
        pre_ids = prefix_cache.tokenize_pieces(self.tokenizer, prefixes)
        suf_ids = prefix_cache.tokenize_pieces(self.tokenizer, [self.suffix])
        decoder = self.lm.get_decoder()
        if self.reuse:
            h = prefix_cache.suffix_states(decoder, pre_ids, suf_ids, [-1], pad_id=self.tokenizer.pad_token_id,
                                           batch_size=self.batch_size, stats=self.stats,
                                           share_lengths=share_lengths(self.tokenizer, pre_ids, heads))
        else:
            h = prefix_cache.full_recompute(decoder, pre_ids, suf_ids, [-1], pad_id=self.tokenizer.pad_token_id,
                                            batch_size=self.batch_size, stats=self.stats)
        head = self.lm.get_output_embeddings()
        logits = head(h[:, 0, 0].to(head.weight.device, head.weight.dtype)).float().cpu()
        log_mass = torch.logsumexp(torch.log_softmax(logits, -1)[:, self.score_ids], -1, keepdim=True)
        return torch.cat([logits[:, self.score_ids], log_mass], 1)

    def result(self, raw) -> JudgeResult:
        raw = torch.as_tensor(raw, dtype=torch.float32)
        probs = torch.softmax(raw[:, :-1], -1).numpy()
        return JudgeResult(expected=probs @ self.values, argmax=self.values[probs.argmax(1)], probs=probs,
                           mass=raw[:, -1].exp().numpy())
