"""Reading fixed-size representations from a frozen backbone (the ``probe`` config group).

A probe chooses the layer (``-1``: the last hidden state, after the final norm; ``k``: ``hidden_states[k]``, where 0
is the embedding output) and the pooling (``last``: the last real token, i.e. the final ``\\n`` after the closing
``<|im_end|>`` for ChatML; ``mean``: the mean over real tokens). Sequences are batched so that padding stays small
(by length, or by prompt where prompts repeat), each batch's distinct prompts are run once
(:mod:`rewarduq_exp.models.shared_prefix`), and every result goes through the shared :class:`FeatureCache`, found by
keys that :class:`~rewarduq_exp.models.conversation_index.ConversationIndex` recorded: only what is computed is
rendered, so a run whose features are all cached loads neither the weights nor the tokenizer.
"""

from __future__ import annotations

import copy
import os
import time

import numpy as np
import torch

from rewarduq_exp.core import distributed
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.progress import progress
from rewarduq_exp.data.contract import render_all, render_prompt_heads, token_ids
from rewarduq_exp.models.backbone import Backbone
from rewarduq_exp.models.conversation_index import ConversationIndex
from rewarduq_exp.models.feature_cache import FeatureCache
from rewarduq_exp.models.memory_features import MemoryFeatures
from rewarduq_exp.models.shared_prefix import share_lengths, shared_prefix_hidden, token_batches
from rewarduq_exp.models.token_budget import check_setting

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

    def __init__(self, backbone: Backbone, probe, store, max_length: int, show_progress: bool = True,
                 conversations: ConversationIndex | None = None):
        """``store``: a folder (the disk :class:`FeatureCache` of runs) or a store object such as
        :class:`MemoryFeatures` (the Python API's). ``conversations``: the record of what conversations render to
        (default, with a disk store: ``<store>/conversations``; a memory store renders every call, as it only
        serves texts the caller has just rendered or scores)."""
        self.backbone = backbone
        self.probe_cfg = probe  # methods that read the backbone their own way (BoRP's contrastive probe) read it
        self.layer = int(probe.layer)
        self.pooling = str(probe.pooling)
        if self.pooling not in POOLINGS:
            raise UserError(f"probe.pooling={self.pooling!r} is invalid; allowed: {', '.join(POOLINGS)}")
        # Rows per forward: auto (as many as the token budget holds) or a number; tokens per forward: auto (from the
        # device's free memory) or a number. Run folders written before batch_tokens existed say batch_size only.
        rows = check_setting(probe.get("batch_size", "auto"), "probe.batch_size")
        self.max_rows = None if rows == "auto" else rows
        self.batch_tokens_setting = check_setting(probe.get("batch_tokens", "auto"), "probe.batch_tokens")
        self.last_batching: dict = {}
        self.max_length = int(max_length)
        self.store = store if hasattr(store, "lookup") else FeatureCache(store)
        if conversations is None and isinstance(self.store, FeatureCache):
            conversations = ConversationIndex(backbone, self.store.root / "conversations")
        self.conversations = conversations if hasattr(self.store, "lookup_keys") else None
        self.show_progress = show_progress and not os.environ.get("TQDM_DISABLE")
        self._model = None
        self._architecture = (None, None)   # (the loaded model, its Architecture): batch_tokens's per-token cost
        self.stats = {"backbone_forward_passes": 0, "cache_hits": 0, "cache_misses": 0}

    @property
    def tokenizer(self):
        return self.backbone.tokenizer

    def probe_identity(self) -> dict:
        return {"layer": self.layer, "pooling": self.pooling, "max_length": self.max_length}

    def encode(self, prompts, completions, desc: str = "features") -> torch.Tensor:
        """Features (N, d) as float32 on the CPU, in input order."""
        prompts = list(prompts)  # a pandas column is indexed by its labels, not by position
        completions = list(completions)
        if self.conversations is None:
            texts = render_all(self.tokenizer, prompts, completions)
            rendered = dict(enumerate(texts))
        else:  # the texts' keys as recorded: only what is not recorded yet is rendered
            keys, rendered = self.conversations.text_keys(prompts, completions)

        def compute(rows):
            heads = render_prompt_heads(self.tokenizer, [prompts[i] for i in rows])
            return self._extract(self._texts(rows, rendered, prompts, completions), desc, heads)

        if self.conversations is None:
            return self.cached(self.probe_identity(), texts, compute)
        return self._found(self.store.lookup_keys(self._meta(self.probe_identity()), keys, compute))

    def in_memory(self, max_bytes: int) -> FeatureEncoder:
        """This encoder, on the same loaded backbone, keeping what it computes in a bounded memory store instead:
        for texts scored once and never again (an RL policy's samples), which a shared disk cache would only fill
        with one shard per call, every later lookup listing them all."""
        self._model_or_load()
        other = copy.copy(self)
        other.store, other.conversations = MemoryFeatures(max_bytes), None
        other.stats = dict.fromkeys(self.stats, 0)
        return other

    def _texts(self, rows, rendered: dict, prompts, completions) -> list[str]:
        """The rendered texts of ``rows``, rendering those not rendered yet."""
        todo = [int(i) for i in rows if int(i) not in rendered]
        rendered.update(zip(todo, render_all(self.tokenizer, [prompts[i] for i in todo],
                                             [completions[i] for i in todo])))
        return [rendered[int(i)] for i in rows]

    def cached(self, what: dict, texts: list[str], compute_rows) -> torch.Tensor:
        """Features of ``texts`` through the store, keyed by the backbone, ``what`` (how they are read: the probe's
        identity) and the texts; ``compute_rows(indices)`` computes the rows of a miss (it adds its forward passes to
        ``stats``). Methods that read the backbone their own way (BoRP) share the store through this. With the disk
        store of a run under torchrun / accelerate each process computes a block of the rows (collective); the
        memory store computes only the calling process's own texts."""
        return self._found(self.store.lookup(self._meta(what), texts, compute_rows))

    def _meta(self, what: dict) -> dict:
        return {"backbone": self.backbone.identity(), "probe": what}

    def _found(self, found: tuple[torch.Tensor, bool]) -> torch.Tensor:
        feats, hit = found
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

    def batch_tokens(self, model, width: int, shared: bool) -> int:
        """Padded token positions per forward: ``probe.batch_tokens``, or ``auto`` = what the device's free memory
        holds at the planner's per-token cost of this forward (:mod:`rewarduq_exp.models.token_budget`)."""
        from rewarduq_exp.models.activation_memory import inference_token_bytes
        from rewarduq_exp.models.shapes import architecture_of_model
        from rewarduq_exp.models.token_budget import resolve_tokens

        if self.batch_tokens_setting != "auto":
            return int(self.batch_tokens_setting)
        device = self.backbone.device
        if self._architecture[0] is not model:   # its sizes, counted once per loaded model (every call asks)
            self._architecture = (model, architecture_of_model(self.backbone.name, model))
        per_token = inference_token_bytes(self._architecture[1], width,
                                          torch.finfo(self.backbone.dtype).bits // 8, math_kernel=device.type == "cpu",
                                          all_hidden_states=self.layer != -1, kv_cache=shared)
        return resolve_tokens("auto", "probe.batch_tokens", device, per_token)

    @torch.no_grad()  # not inference_mode: the features leave this function and feed autograd
    def _extract(self, texts: list[str], desc: str, heads: list[str] | None = None) -> torch.Tensor:
        """Features of ``texts``; ``heads[i]``, when given, is the start of ``texts[i]`` that texts with the same
        prompt share (computed once per batch).

        Batches hold a token budget (``probe.batch_tokens``; at most ``probe.batch_size`` rows where that is a
        number), sorted by length or grouped by prompt (:func:`token_batches`). On a GPU nothing waits for the
        device between batches: each batch is laid out in pinned host memory and copied asynchronously, the prompt
        bookkeeping reads host tensors, and the pooled rows stay on the device until the end (one copy back)."""
        start = time.perf_counter()
        model = self._model_or_load()
        ids = token_ids(self.tokenizer, texts)
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        if lengths.max() > self.max_length:
            raise UserError(f"a sequence of {lengths.max()} tokens exceeds max_length={self.max_length}; "
                            "filter the data first")
        cut = share_lengths(self.tokenizer, ids, heads)
        if cut is None:
            cut = np.zeros(len(ids), dtype=np.int64)
        max_tokens = self.batch_tokens(model, int(lengths.max()), bool(cut.any()))
        batches = token_batches(ids, cut, max_tokens, self.max_rows)
        self.last_batching = {"batch_tokens": max_tokens, "batches": len(batches)}
        device = self.backbone.device
        pin = device.type == "cuda"
        pad_id = self.tokenizer.pad_token_id
        out = None
        for idx in progress(batches, desc=desc, unit="batches", show=self.show_progress,
                            quiet=not distributed.is_main()):
            width = int(lengths[idx].max())
            input_ids = torch.full((len(idx), width), pad_id, dtype=torch.long, pin_memory=pin)
            attention = torch.zeros((len(idx), width), dtype=torch.long, pin_memory=pin)
            for row, i in enumerate(idx):
                input_ids[row, : lengths[i]] = torch.as_tensor(ids[i])
                attention[row, : lengths[i]] = 1
            # host tensors: shared_prefix_hidden reads them for its bookkeeping and copies them to the device
            hidden = shared_prefix_hidden(model, input_ids, attention, cut[idx],
                                          layer=None if self.layer == -1 else self.layer, stats=self.stats)
            self.stats["backbone_forward_passes"] += 1
            pooled = pool(hidden, attention.to(hidden.device, non_blocking=True), self.pooling)
            if out is None:
                out = torch.empty((len(texts), pooled.shape[1]), dtype=pooled.dtype, device=pooled.device)
            out[torch.as_tensor(idx).to(pooled.device, non_blocking=True)] = pooled
        if not torch.isfinite(out).all():
            raise RuntimeError("backbone features contain NaN/inf; check model.dtype and the inputs")
        out = out.cpu()
        # loading the backbone (first call), tokenising and the forwards, up to the features on the host
        self.stats["seconds_extracting"] = round(self.stats.get("seconds_extracting", 0.0)
                                                 + time.perf_counter() - start, 3)
        return out
