"""Reading fixed-size representations from a frozen backbone (the ``probe`` config group).

A probe chooses the layer (``-1``: the last hidden state, after the final norm; ``k``: ``hidden_states[k]``, where 0
is the embedding output) and the pooling (``last``: the last real token, i.e. the final ``\\n`` after the closing
``<|im_end|>`` for ChatML; ``mean``: the mean over real tokens). Sequences are batched so that padding stays small
(by length, or by prompt where prompts repeat), each batch's distinct prompts are run once
(:mod:`rewarduq_exp.models.shared_prefix`), and every result goes through the shared :class:`FeatureCache`.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from rewarduq_exp.core import distributed
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.progress import progress
from rewarduq_exp.data.contract import render_all, render_prompt_heads
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.feature_cache import FeatureCache
from rewarduq_exp.models.shared_prefix import batch_order, share_lengths, shared_prefix_hidden

POOLINGS = ("last", "mean")


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Pool (B, L, d) hidden states of right-padded sequences into (B, d)."""
    if pooling == "last":
        last = attention_mask.sum(1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if pooling == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)
    raise UserError(f"probe.pooling={pooling!r} is invalid; allowed: {', '.join(POOLINGS)}")




class FeatureEncoder:
    """Maps (prompt, completion) conversations to backbone features, through the cache.

    ``stats`` counts backbone forward passes and cache hits, so a run (and a test) can show that a second run on
    the same backbone and data did no backbone work at all.
    """

    def __init__(self, backbone: Backbone, probe, store, max_length: int, show_progress: bool = True):
        """``store``: a folder (the disk :class:`FeatureCache` of runs) or a store object such as
        :class:`MemoryFeatures` (the Python API's)."""
        self.backbone = backbone
        self.probe_cfg = probe  # methods that read the backbone their own way (BoRP's contrastive probe) read it
        self.layer = int(probe.layer)
        self.pooling = str(probe.pooling)
        self.batch_size = int(probe.batch_size)
        if self.pooling not in POOLINGS:
            raise UserError(f"probe.pooling={self.pooling!r} is invalid; allowed: {', '.join(POOLINGS)}")
        if self.batch_size < 1:
            raise UserError(f"probe.batch_size={self.batch_size} is invalid: must be an integer >= 1")
        self.max_length = int(max_length)
        self.store = store if hasattr(store, "lookup") else FeatureCache(store)
        self.show_progress = show_progress and not os.environ.get("TQDM_DISABLE")
        self._model = None
        self.stats = {"backbone_forward_passes": 0, "cache_hits": 0, "cache_misses": 0}

    @property
    def tokenizer(self):
        return self.backbone.tokenizer

    def probe_identity(self) -> dict:
        return {"layer": self.layer, "pooling": self.pooling, "max_length": self.max_length}

    def encode(self, prompts, completions, desc: str = "features") -> torch.Tensor:
        """Features (N, d) as float32 on the CPU, in input order."""
        prompts = list(prompts)  # a pandas column is indexed by its labels, not by position
        texts = render_all(self.tokenizer, prompts, completions)

        def compute(rows):
            heads = render_prompt_heads(self.tokenizer, [prompts[i] for i in rows])
            return self._extract([texts[i] for i in rows], desc, heads)

        return self.cached(self.probe_identity(), texts, compute)

    def cached(self, what: dict, texts: list[str], compute_rows) -> torch.Tensor:
        """Features of ``texts`` through the store, keyed by the backbone, ``what`` (how they are read: the probe's
        identity) and the texts; ``compute_rows(indices)`` computes the rows of a miss (it adds its forward passes to
        ``stats``). Methods that read the backbone their own way (BoRP) share the store through this. With the disk
        store of a run under torchrun / accelerate each process computes a block of the rows (collective); the
        memory store computes only the calling process's own texts."""
        meta = {"backbone": self.backbone.identity(), "probe": what}
        feats, hit = self.store.lookup(meta, texts, compute_rows)
        self.stats["cache_hits" if hit else "cache_misses"] += 1
        return feats.float()

    def encode_pairs(self, frame, desc: str = "features") -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen and rejected features of a preference frame, extracted as one cache entry."""
        n = len(frame)
        feats = self.encode(list(frame["prompt"]) * 2, list(frame["chosen"]) + list(frame["rejected"]), desc)
        return feats[:n], feats[n:]

    # ------------------------------------------------------------------------------------------------------
    def _model_or_load(self):
        if self._model is None:
            self._model = self.backbone.load_encoder()
            n_layers = int(self._model.config.num_hidden_layers)
            if not -1 <= self.layer <= n_layers:
                raise UserError(f"probe.layer={self.layer} is invalid for model '{self.backbone.name}': "
                                f"allowed -1 (last, after the final norm) or 0..{n_layers}")
        return self._model

    @torch.no_grad()  # not inference_mode: the features leave this function and feed autograd
    def _extract(self, texts: list[str], desc: str, heads: list[str] | None = None) -> torch.Tensor:
        """Features of ``texts``; ``heads[i]``, when given, is the start of ``texts[i]`` that texts with the same
        prompt share (computed once per batch)."""
        model = self._model_or_load()
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        if lengths.max() > self.max_length:
            raise UserError(f"a sequence of {lengths.max()} tokens exceeds max_length={self.max_length}; "
                            "filter the data first")
        cut = share_lengths(self.tokenizer, ids, heads)
        if cut is None:
            cut = np.zeros(len(ids), dtype=np.int64)
        order = batch_order(ids, cut, self.batch_size)
        device = self.backbone.device
        pad_id = self.tokenizer.pad_token_id
        out = None
        batches = range(0, len(order), self.batch_size)
        for start in progress(batches, desc=desc, unit="batches", show=self.show_progress,
                              quiet=not distributed.is_main()):
            idx = order[start : start + self.batch_size]
            width = int(lengths[idx].max())
            input_ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                input_ids[row, : lengths[i]] = torch.as_tensor(ids[i])
                attention[row, : lengths[i]] = 1
            input_ids, attention = input_ids.to(device), attention.to(device)
            hidden = shared_prefix_hidden(model, input_ids, attention, cut[idx],
                                          layer=None if self.layer == -1 else self.layer, stats=self.stats)
            self.stats["backbone_forward_passes"] += 1
            pooled = pool(hidden, attention, self.pooling).to("cpu")
            if out is None:
                out = torch.empty((len(texts), pooled.shape[1]), dtype=pooled.dtype)
            out[torch.as_tensor(idx)] = pooled
        if not torch.isfinite(out.float()).all():
            raise RuntimeError("backbone features contain NaN/inf; check model.dtype and the inputs")
        return out
