"""A GPU benchmark of the four methods' heavy paths at the paper's backbone shapes, against the planner.

    python scripts/bench_gpu.py                                  # on a GPU: Qwen3-0.6B and Qwen3-4B shapes, bf16
    python scripts/bench_gpu.py --shapes qwen3-4b --batch 8 --length 1024 --members 8 --masks 20
    python scripts/bench_gpu.py --smoke                          # tiny sizes (what a machine without a GPU runs)

The backbones are random-init Qwen3 models built from their shape files (``conf/model/shapes/<name>.json``, the same
configs :mod:`rewarduq_exp.models.shapes` builds on the meta device for the planner): nothing is downloaded. Per
shape, in one process, each measured after a warm-up as the median of ``--repeats`` runs (``torch.cuda.synchronize``
around each), with its peak memory (``torch.cuda.max_memory_allocated``, reset before each measurement, so it counts
what is alive then: the measured phase's weights included):

* extraction: the frozen body (backbone dtype) over ``--batch`` x ``--length`` tokens (the old fixed batch), then
  over the batch the token budget picks (``probe.batch_tokens=auto``: the device's free memory now over the
  planner's per-token cost, capped at 64k tokens), last-token pooling, as the feature encoder runs it; tokens/s and
  model FLOPs utilisation (MFU = achieved FLOPs / the GPU's dense bf16 peak: H100 SXM and H200 989 TFLOPS, A100
  312; FLOPs = 2 x non-embedding parameters per token + the causal attention term of the planner). Planned:
  ENS-MLP / BAY-LIN's extraction phase (which counts the KV cache that shared prompts keep; these rows share none).
* ENS-LoRA (the K members as one batched multi-LoRA module, ``rewarduq_exp.models.multi_lora``; LoRA weights drawn
  at random so every update is non-zero): scoring ``--batch`` rows (``EnsLoRA.member_rewards_ids``) with all K
  members in one batched forward of K x ``--batch`` rows, against one pass of ``--batch`` rows per member, and
  against the same weights as a PEFT model routed by PEFT's mixed-adapter batch (``adapter_names=``, ENS-LoRA's
  previous implementation); tokens/s counts member-tokens (K x the batch's), the printed ratio batched / extraction
  is per member-token (aim: >= 0.8), and the largest reward difference against the batched path is printed (bf16
  rounding). Planned: the scoring phase with ``mixed_adapter_scoring`` true / false. Batched scoring again at the
  batch ``score_batch_tokens=auto`` picks, with its tokens/s per member-token over the planned extraction's (the
  target: >= 0.8). Then one training step of all K members on ``--lora-pairs`` pairs (2 x that many rows of
  ``--length`` tokens each member; activation checkpointing where the planner's auto turns it on), batched and one
  pass per member: forward, the eq. 11 loss, backward into the float32
  LoRA weights and heads, per-member clipping and an AdamW step (``EnsLoRA._backward_step``, ``_clip_per_member``).
  FLOPs: the forward (and its recomputation when checkpointed), the frozen body's backward without weight gradients
  (its linears 1x the forward, attention 2x), LoRA 3x its forward. Planned: the training phase at ``batch_size`` =
  ``--lora-pairs``.
* MCD-DPO: one training step of the policy (float32 weights, bf16 autocast on a bf16 backbone, activation
  checkpointing where ``gradient_checkpointing=auto`` turns it on for this micro-batch, log-prob chunks of
  ``logprob_chunk=auto``, each row's dropout masks from its own generator) on ``--mcd-pairs`` pairs (2 x that many
  rows of ``--length`` tokens): the body, the chunked completion log-probs with head dropout (``completion_logps``),
  the DPO loss against fixed reference log-probs, backward, gradient clipping and an AdamW step: the work of
  ``compute_loss`` and the optimizer step, without the Trainer around it. Planned: the training phase at
  ``micro_batch_size`` = ``--mcd-pairs``. Then, with the trained policy's parameters frozen as after ``McdDpo.fit``,
  scoring ``--batch`` rows with K = ``--masks`` dropout masks on one body forward (``mc_completion_logps``,
  ``row_generators``) against K full forward passes with full logits (``naive`` of scripts/bench_mcd.py), and one
  whole scoring batch as ``sample_rewards`` runs it (``McdDpo.mask_rewards_ids``: the policy with K masks + the
  float32 reference copy, under the method's own autocast). Planned: the scoring phase (the K full passes: n/a, no
  configuration runs them).
* BAY-LIN: the Laplace posterior precision and its Cholesky factor (``FullPosterior.fit``)
  at the backbone's hidden size over ``--pairs`` training pairs (default: UltraFeedback's 62,135), features on the
  device. Planned: the training phase with every feature cached (``plan.features_cached=true``).

The planned peaks come from the planner itself (``rewarduq_exp.runner.plan.make_plan`` on the composed config of the
same method, model, max_length, batch sizes, K and device). The table prints each measurement and the ratios measured
in this run: K sequential passes / batched multi-LoRA, K full passes / shared backbone, measured / planned peak. The
JSON (``--out``) holds the same numbers, every sample time and every planned phase.

Without a GPU (or with ``--smoke``) the same code runs at the offline tiny shape (``conf/model/tiny-qwen3.yaml``,
built by ``ensure_tiny_qwen3``) on the CPU in float32 at tiny sizes, as a smoke test: MFU is n/a there, and memory is
the process's peak resident set (``VmHWM``, reset before each measurement), which counts the interpreter and its
libraries, so measured / planned is n/a on a CPU. The CPU runs one torch thread unless ``--threads`` says otherwise
(on a busy machine more threads than free cores make every kernel many times slower).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs without install

import argparse  # noqa: E402
import copy  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_measure import (  # noqa: E402
    Encoder,
    Memory,
    Planner,
    RandomBackbone,
    autocast,
    checkpointing_on,
    free,
    oom,
    peak_tflops,
    random_checkpoint,
    random_model,
    timed,
)

GPU_SHAPES = "qwen3-0.6b,qwen3-4b"
TINY = "tiny-qwen3"
# Sizes when none are given: (GPU, smoke)
DEFAULTS = {"batch": (8, 4), "length": (512, 32), "members": (8, 4), "masks": (20, 4), "repeats": (5, 2),
            "pairs": (None, 2048), "mcd_pairs": (16, 2), "lora_pairs": (4, 2)}
DROPOUT, LORA_RANK, DPO_BETA = 0.1, 16, 0.1


# ---------------------------------------------------------------------------------------------------- one shape
class ShapeBench:
    def __init__(self, name: str, args, device: torch.device, memory: Memory, tflops: float | None, cache_dir: str):
        from omegaconf import OmegaConf
        from transformers import AutoConfig

        from rewarduq_exp.data.registry import CONF_DIR
        from rewarduq_exp.models.backbone import DTYPES
        from rewarduq_exp.models.shapes import architecture, shape_config
        from rewarduq_exp.runner.plan import backbone_dtype

        self.name, self.args, self.device, self.memory, self.tflops = name, args, device, memory, tflops
        model_cfg = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
        if model_cfg.get("builder") == "tiny-qwen3":
            from rewarduq_exp.models.tiny_qwen3 import ensure_tiny_qwen3

            ensure_tiny_qwen3(cache_dir, **dict(model_cfg.build))   # its config.json is the tiny shape
        self.arch = architecture(model_cfg, cache_dir)
        fields = shape_config(model_cfg, cache_dir)
        fields.pop("architectures", None)
        self.config = AutoConfig.for_model(fields.pop("model_type", "qwen3"), **fields)
        self.dtype = DTYPES[backbone_dtype(OmegaConf.create({"model": model_cfg}), device.type)]
        self.checkpointing = False   # per measurement, as the planner's auto decides it
        self.planner = Planner(name, device.type, args.length, args.pairs, cache_dir)
        self.results: dict[str, dict] = {}
        self.ratios: dict[str, float] = {}
        self.budgets: dict[str, dict] = {}   # the token budgets picked now, as a run would (auto)
        g = torch.Generator().manual_seed(0)
        b, n = args.batch, args.length
        self.ids = torch.randint(3, self.arch.vocab, (b, n), generator=g).to(device)
        self.attn = torch.ones_like(self.ids)
        self.comp = torch.zeros_like(self.ids)
        self.comp[:, n // 2:] = 1            # the second half of each sequence is its completion
        self.n_completion = int(self.comp[:, 1:].sum())

    # FLOPs ------------------------------------------------------------------------------------------------
    def body_flops(self, tokens: float) -> float:
        from rewarduq_exp.runner.plan import _attention_flops

        a = self.arch
        return 2 * (a.params_body - a.params_embedding) * tokens + _attention_flops(a, tokens, self.args.length)

    def head_flops(self, positions: float) -> float:
        return 2 * self.arch.vocab * self.arch.hidden * positions

    # one measurement ---------------------------------------------------------------------------------------
    def measure(self, key: str, label: str, fn, *, tokens: float | None = None, flops: float | None = None,
                planned: tuple[float | None, str | None] = (None, "no plan"), repeats: int | None = None) -> None:
        """Time ``fn`` (median after a warm-up) with its peak memory, into ``self.results[key]``."""
        self.memory.reset()
        row = {"label": label}
        try:
            times = timed(fn, repeats or self.args.repeats, self.device)
        except torch.cuda.OutOfMemoryError as err:
            row.update(error=oom(err))
            times = None
        if times is None:   # out of the except block: its traceback no longer holds the failed call's tensors
            free(self.device)
            row.update(self._planned(None, planned))
            self.results[key] = row
            return
        peak = self.memory.peak()
        median = statistics.median(times)
        row.update(median_s=median, times_s=times, peak_bytes=peak, memory=self.memory.kind)
        if tokens:
            row["tokens_per_s"] = tokens / median
        if flops:
            row["flops"] = flops
            row["achieved_tflops"] = flops / median / 1e12
            row["mfu"] = flops / median / (self.tflops * 1e12) if self.tflops else None
        row.update(self._planned(peak, planned))
        self.results[key] = row

    def _planned(self, peak, planned) -> dict:
        planned_peak, why = planned
        out = {"planned_peak_bytes": planned_peak, "planned_note": why}
        cuda = self.device.type == "cuda"
        out["measured_over_planned"] = peak / planned_peak if (cuda and peak and planned_peak) else None
        return out

    # the methods ---------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.bay_lin_hessian()
        self.extraction_and_lora()
        free(self.device)
        self.mcd_dpo()
        free(self.device)

    def bay_lin_hessian(self) -> None:
        from rewarduq_exp.methods.bay_lin import BayLin
        from rewarduq_exp.methods.posteriors import FullPosterior

        n, d = self.args.pairs, self.arch.hidden
        planned = self.planner.phase("bay_lin_hessian", ["method=bay_lin", "plan.features_cached=true"], "training")
        method = BayLin(device=str(self.device), show_progress=False)
        state = {}
        try:
            g = torch.Generator(device=self.device).manual_seed(0)
            state["zc"] = torch.randn(n, d, generator=g, device=self.device)
            state["zr"] = torch.randn(n, d, generator=g, device=self.device)
            state["w"] = torch.ones(n, device=self.device)
        except torch.cuda.OutOfMemoryError as err:
            self.results["bay_lin_hessian"] = {"label": "BAY-LIN Hessian", "error": oom(err)}
            return

        def hessian():   # stage 2 of BayLin._fit_features (hessian=unweighted)
            dz = state["zc"] - state["zr"]
            method.posterior = FullPosterior.fit(dz, state["w"].double(), method.reg_lambda)

        self.measure("bay_lin_hessian", f"BAY-LIN Hessian + Cholesky (n={n:,}, d={d})", hessian,
                     flops=None, planned=planned)
        self.results["bay_lin_hessian"]["flops_float64"] = 2 * n * d * d + d**3 / 3

    def extraction_and_lora(self) -> None:
        from transformers import AutoModel

        from rewarduq_exp.models.features import pool

        b, n = self.args.batch, self.args.length
        tokens = b * n
        try:
            if self.args.weights_cache and self.config.model_type == "qwen3" and self.name != TINY \
                    and self.dtype == torch.bfloat16:   # the random weights the mission of gpu_check.py loads too
                path = random_checkpoint(self.name, self.args.weights_cache, self.device)
                body = AutoModel.from_pretrained(path, dtype=self.dtype, device_map=self.device)
            else:
                body = random_model(AutoModel, self.config, self.dtype, self.device)
            body = body.eval().requires_grad_(False)
        except torch.cuda.OutOfMemoryError as err:
            self.results["extraction"] = {"label": "extraction", "error": oom(err)}
            return

        @torch.no_grad()
        def extract():
            hidden = body(input_ids=self.ids, attention_mask=self.attn, use_cache=False).last_hidden_state
            return pool(hidden, self.attn, "last").to("cpu")

        planned = self.planner.phase("extraction", ["method=bay_lin", f"probe.batch_size={b}"], "extraction")
        self.measure("extraction", f"extraction ({b} x {n} tokens)", extract, tokens=tokens,
                     flops=self.body_flops(tokens), planned=planned)
        self.extraction_at_the_planned_batch(body)
        free(self.device)
        self.ens_lora(body)

    def budget_rows(self, key: str, per_token: float, reserved: float = 0.0, per_row: int = 1) -> int:
        """Rows of ``--length`` tokens in the batch a run picks now (``auto``: the token budget of the device's free
        memory at ``per_token``), ``per_row`` token rows each (K members); recorded under ``key``."""
        from rewarduq_exp.models.token_budget import resolve_tokens

        tokens = resolve_tokens("auto", key, self.device, per_token, reserved)
        rows = max(1, tokens // (self.args.length * per_row))
        self.budgets[key] = {"tokens": tokens, "rows": rows}
        return rows

    def rows_of(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, self.arch.vocab, (rows, self.args.length), generator=g).to(self.device)
        return ids, torch.ones_like(ids)

    def extraction_at_the_planned_batch(self, body) -> None:
        """Extraction at the batch the planner's token budget picks (``probe.batch_tokens=auto``; texts without a
        shared prompt, so no KV cache is kept): what ENS-MLP and BAY-LIN run."""
        from rewarduq_exp.models.activation_memory import inference_token_bytes
        from rewarduq_exp.models.features import pool

        n, cpu = self.args.length, self.device.type != "cuda"
        wb = torch.finfo(self.dtype).bits // 8
        rows = self.budget_rows("extraction", inference_token_bytes(self.arch, n, wb, cpu))
        try:
            ids, attn = self.rows_of(rows)
        except torch.cuda.OutOfMemoryError as err:
            self.results["extraction_planned"] = {"label": "extraction (planner's batch)", "error": oom(err)}
            return

        @torch.no_grad()
        def extract():
            hidden = body(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
            return pool(hidden, attn, "last")   # stays on the device, as the encoder keeps it until the end

        planned = self.planner.phase("extraction_planned", ["method=bay_lin", f"probe.batch_tokens={rows * n}"],
                                     "extraction")
        self.measure("extraction_planned", f"extraction, planner's batch ({rows} x {n} tokens)", extract,
                     tokens=rows * n, flops=self.body_flops(rows * n), planned=planned)
        self._throughput_ratio("extraction_planned_over_fixed", "extraction_planned", "extraction")

    def ens_lora(self, body) -> None:
        """ENS-LoRA's scoring (batched, one pass per member, PEFT's mixed batch) and training step (module docstring);
        ``body`` is wrapped in place by the multi-LoRA module, and at the end given to PEFT."""
        from rewarduq_exp.methods.ens_lora import EnsLoRA
        from rewarduq_exp.runner.plan import _attention_flops

        b, n, k = self.args.batch, self.args.length, self.args.members
        tokens = b * n
        method = EnsLoRA(encoder=Encoder(RandomBackbone(self.name, self.dtype, body)), num_members=k,
                         lora_rank=LORA_RANK, lora_alpha=2 * LORA_RANK, score_batch_size=b, device=str(self.device),
                         show_progress=False)
        try:
            method._build()
        except torch.cuda.OutOfMemoryError as err:
            self.results["lora_batched"] = {"label": "ENS-LoRA scoring", "error": oom(err)}
            return
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(0)
            for p in method.model.lora_parameters():   # PEFT starts B at 0: every member would be the base model
                p.normal_(0, 0.02)
        lora_flops = 2 * self.arch.lora_params(LORA_RANK)   # per member-token, forward
        flops = k * (self.body_flops(tokens) + lora_flops * tokens)
        lora = ["method=ens_lora", f"method.num_members={k}", f"method.lora_rank={LORA_RANK}",
                f"method.score_batch_size={b}"]
        rewards = {}
        for key, mixed in (("lora_batched", True), ("lora_sequential", False)):
            planned = self.planner.phase(key, [*lora, f"method.mixed_adapter_scoring={str(mixed).lower()}"],
                                         "scoring")
            label = (f"ENS-LoRA scoring, K={k} batched ({k * b} rows)" if mixed
                     else f"ENS-LoRA scoring, K={k} sequential passes")

            @torch.no_grad()
            def score(mixed=mixed):
                rewards[mixed] = method.member_rewards_ids(self.ids, self.attn, mixed=mixed)

            self.measure(key, label, score, tokens=k * tokens, flops=flops, planned=planned)
        if True in rewards and False in rewards:
            self.results["lora_sequential"]["max_abs_reward_diff_vs_batched"] = \
                float((rewards[False] - rewards[True]).abs().max())
        self._ratio("lora_sequential_over_batched", "lora_sequential", "lora_batched")
        extraction, batched = self.results.get("extraction", {}), self.results.get("lora_batched", {})
        if "tokens_per_s" in extraction and "tokens_per_s" in batched:
            self.ratios["lora_batched_over_extraction"] = batched["tokens_per_s"] / extraction["tokens_per_s"]
        free(self.device)
        self.ens_lora_scoring_at_the_planned_batch(method)
        free(self.device)
        self.ens_lora_train_steps(method, _attention_flops)
        free(self.device)
        self.ens_lora_peft_mixed(method, flops)

    def ens_lora_scoring_at_the_planned_batch(self, method) -> None:
        """K=``--members`` batched scoring at the batch ``score_batch_tokens=auto`` picks (member-tokens), against
        extraction at its own planned batch: the tokens/s ratio per member-token."""
        n, k = self.args.length, self.args.members
        rows = max(1, method.score_tokens(n, shared=False) // (k * n))
        self.budgets["lora_scoring"] = {"member_tokens": rows * k * n, "rows": rows}
        try:
            ids, attn = self.rows_of(rows)
        except torch.cuda.OutOfMemoryError as err:
            self.results["lora_batched_planned"] = {"label": "ENS-LoRA scoring (planner's batch)", "error": oom(err)}
            return

        @torch.no_grad()
        def score():
            return method.member_rewards_ids(ids, attn, mixed=True)

        flops = k * (self.body_flops(rows * n) + 2 * self.arch.lora_params(LORA_RANK) * rows * n)
        overrides = ["method=ens_lora", f"method.num_members={k}", f"method.lora_rank={LORA_RANK}",
                     f"method.score_batch_tokens={rows * k * n}"]
        self.measure("lora_batched_planned", f"ENS-LoRA scoring, K={k} batched, planner's batch ({k * rows} rows)",
                     score, tokens=k * rows * n, flops=flops,
                     planned=self.planner.phase("lora_batched_planned", overrides, "scoring"))
        self._throughput_ratio("lora_batched_planned_over_extraction_planned", "lora_batched_planned",
                               "extraction_planned")

    def ens_lora_train_steps(self, method, attention_flops) -> None:
        """One optimizer step of all K members, batched and one pass per member; the optimizer lives only here."""
        pairs, n, k = self.args.lora_pairs, self.args.length, self.args.members
        rows = self.ids.repeat(-(-2 * pairs // len(self.ids)), 1)[:2 * pairs].tolist()   # full-length rows
        chosen, rejected = rows[:pairs], rows[pairs:]
        weight = torch.full((pairs,), 1.0 / pairs, device=self.device)
        lora = method.model.lora_parameters()
        for p in lora:
            p.requires_grad_(True)
        method.head.requires_grad_(True)
        method._lora0 = [p.detach().clone() for p in lora]
        method._head0 = method.head.detach().clone()
        base = ["method=ens_lora", f"method.num_members={k}", f"method.lora_rank={LORA_RANK}",
                f"method.batch_size={pairs}", f"method.micro_batch_size={pairs}"]
        self.planner.phase("lora_train_batched", base, "training")   # checkpointing as auto decides it here
        self.checkpointing = bool(self.planner.plans.get("lora_train_batched", {}).get("checkpointing", False))
        if self.checkpointing:
            method.model.checkpointing(True)
        method.model.train()
        opt = torch.optim.AdamW([*lora, method.head], lr=1e-6, fused=self.device.type == "cuda")
        member_tokens = k * 2 * pairs * n
        a = self.arch
        linear = 2 * (a.params_body - a.params_embedding) * member_tokens
        attention = attention_flops(a, member_tokens, n)
        lora_fwd = 2 * a.lora_params(LORA_RANK) * member_tokens
        c = int(self.checkpointing)
        flops = (1 + c) * (linear + attention + lora_fwd) + linear + 2 * attention + 2 * lora_fwd
        for key, mixed in (("lora_train_batched", True), ("lora_train_sequential", False)):
            def step(mixed=mixed):
                method._backward_step(list(range(pairs)), chosen, rejected, weight, mixed, 1, None)
                method._clip_per_member()
                opt.step()
                opt.zero_grad(set_to_none=True)

            overrides = [*base, f"method.mixed_adapter_training={str(mixed).lower()}",
                         f"method.gradient_checkpointing={str(self.checkpointing).lower()}"]
            planned = self.planner.phase(key, overrides, "training")
            label = (f"ENS-LoRA training step, K={k} {'batched' if mixed else 'sequential'} ({pairs} pairs"
                     f"{', checkpointed' if self.checkpointing else ''})")
            self.measure(key, label, step, tokens=member_tokens, flops=flops, planned=planned)
        self._ratio("lora_train_sequential_over_batched", "lora_train_sequential", "lora_train_batched")
        if self.checkpointing:
            method.model.checkpointing(False)
        method._finish_model()
        method.head.requires_grad_(False)

    def ens_lora_peft_mixed(self, method, flops: float) -> None:
        """The same weights as a PEFT model (on the same body, in place), K x ``--batch`` rows routed by PEFT's
        ``adapter_names=``: ENS-LoRA's previous implementation."""
        b, k = self.args.batch, self.args.members
        with torch.no_grad():   # the weights as trained by the training steps: the reference for PEFT's rewards
            batched = method.member_rewards_ids(self.ids, self.attn, mixed=True)
        try:
            peft_model = method.model.to_peft()
        except torch.cuda.OutOfMemoryError as err:
            self.results["lora_peft_mixed"] = {"label": "ENS-LoRA scoring, PEFT mixed", "error": oom(err)}
            return
        names = [name for name in method.member_names for _ in range(b)]
        out = {}

        @torch.no_grad()
        def score():
            with method._autocast():
                h = peft_model(input_ids=self.ids.repeat(k, 1), attention_mask=self.attn.repeat(k, 1), use_cache=False,
                               adapter_names=names).last_hidden_state
            z = h[:, -1].float().view(k, b, -1)   # every row is full length: the last token is the last position
            out["r"] = (z * method.head[:, None, :]).sum(-1)

        self.measure("lora_peft_mixed", f"ENS-LoRA scoring, K={k} PEFT mixed-adapter batch", score,
                     tokens=k * b * self.args.length, flops=flops, planned=(None, "the planner plans the batched "
                                                                            "module (the same rows)"))
        if "r" in out:
            self.results["lora_peft_mixed"]["max_abs_reward_diff_vs_batched"] = float((out["r"] - batched).abs().max())
        self._ratio("lora_peft_mixed_over_batched", "lora_peft_mixed", "lora_batched")

    def mcd_dpo(self) -> None:
        from transformers import AutoModelForCausalLM

        from rewarduq_exp.methods.mcd_dpo import McdDpo, row_generators
        from rewarduq_exp.methods.mcd_dpo.memory import auto_chunk

        b, n, k, pairs = self.args.batch, self.args.length, self.args.masks, self.args.mcd_pairs
        if pairs < 1:
            raise SystemExit("--mcd-pairs must be at least 1")
        tokens = b * n
        # the run's own choices: checkpointing as auto decides it for this micro-batch, chunks of logprob_chunk=auto
        mcd = ["method=mcd_dpo", f"method.micro_batch_size={pairs}", f"method.batch_size={pairs}",
               f"method.num_samples={k}", f"method.score_batch_size={b}", f"method.dropout={DROPOUT}",
               f"plan.completion_fraction={self.n_completion / tokens}"]
        self.planner.phase("mcd_train_step", mcd, "training")
        self.checkpointing = bool(self.planner.plans.get("mcd_train_step", {}).get("checkpointing", False))
        try:
            policy = random_model(AutoModelForCausalLM, self.config, torch.float32, self.device)
        except torch.cuda.OutOfMemoryError as err:
            self.results["mcd_train_step"] = {"label": "MCD-DPO training step", "error": oom(err)}
            return
        cast = autocast(self.device, self.dtype)
        self.mcd_train_step(policy, cast, mcd)   # its optimizer states are gone when it returns
        # scoring: the trained policy (no optimizer states, no gradients, parameters frozen as McdDpo.fit leaves
        # them) and a float32 reference copy
        policy.zero_grad(set_to_none=True)
        policy.requires_grad_(False)
        if self.checkpointing:
            checkpointing_on(policy, False)
        policy.eval()
        free(self.device)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_mcd import naive, shared

        chunk = auto_chunk(self.arch.vocab, k)

        @torch.no_grad()
        def k_masks():
            with cast:
                return shared(policy, self.ids, self.attn, self.comp, k, DROPOUT, chunk)

        @torch.no_grad()
        def k_passes():
            with cast:
                return naive(policy, self.ids, self.attn, self.comp, k, DROPOUT)

        head = self.head_flops(self.n_completion)
        self.measure("mcd_k_masks", f"MCD-DPO scoring, K={k} masks, shared backbone", k_masks, tokens=tokens,
                     flops=self.body_flops(tokens) + k * head,
                     planned=(None, "policy only: the planned scoring phase holds the reference too (next row)"))
        self.measure("mcd_k_passes", f"MCD-DPO scoring, K={k} full passes", k_passes, tokens=tokens,
                     flops=k * (self.body_flops(tokens) + self.head_flops(b * (n - 1))),
                     planned=(None, "no configuration runs K full passes"))
        self._ratio("mcd_passes_over_masks", "mcd_k_passes", "mcd_k_masks")
        try:
            reference = copy.deepcopy(policy).requires_grad_(False)
        except torch.cuda.OutOfMemoryError as err:
            self.results["mcd_scoring"] = {"label": "MCD-DPO scoring batch", "error": oom(err)}
            return
        method = McdDpo(encoder=Encoder(RandomBackbone(self.name, self.dtype, policy)), dpo_beta=DPO_BETA,
                        dropout=DROPOUT, num_samples=k, score_batch_size=b, device=str(self.device),
                        show_progress=False)
        method.policy, method.reference = policy, reference
        starts = [n // 2] * b   # each row's first completion token

        def scoring_batch():   # McdDpo.sample_rewards on one batch
            return method.mask_rewards_ids(self.ids, self.attn, self.comp, row_generators(range(b), self.device),
                                           starts)

        planned = self.planner.phase("mcd_scoring", mcd, "scoring")
        self.measure("mcd_scoring", f"MCD-DPO scoring batch (K={k} masks + reference)", scoring_batch,
                     tokens=tokens, flops=2 * self.body_flops(tokens) + (k + 1) * head, planned=planned)

    def mcd_train_step(self, policy, cast, mcd: list[str]) -> None:
        """One optimizer step of ``compute_loss`` + AdamW on ``--mcd-pairs`` pairs, timed; the optimizer lives only
        in here."""
        from rewarduq_exp.methods.mcd_dpo import completion_logps, row_generators, weighted_dpo_loss
        from rewarduq_exp.methods.mcd_dpo.memory import auto_chunk

        pairs, n = self.args.mcd_pairs, self.args.length
        chunk = auto_chunk(self.arch.vocab)
        rows = 2 * pairs   # [chosen; rejected]
        tokens = rows * n
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, self.arch.vocab, (rows, n), generator=g).to(self.device)
        attn = torch.ones_like(ids)
        comp = torch.zeros_like(ids)
        comp[:, n // 2:] = 1   # the scoring rows' layout: the second half is the completion
        n_completion = int(comp[:, 1:].sum())
        if self.checkpointing:
            checkpointing_on(policy, True)
        policy.train()
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=self.device.type == "cuda")
        ref = torch.zeros(rows, device=self.device)   # reference log-probs: precomputed once per pair in the method
        generators = row_generators(range(rows), self.device)   # each row's masks its own, as in training

        def step():
            with cast:
                hidden = policy.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
                logps = completion_logps(hidden, policy.lm_head, ids, comp, chunk, DROPOUT, training=True,
                                         generators=generators)
            chosen, rejected = logps.float().chunk(2)
            ref_c, ref_r = ref.chunk(2)
            weighted_dpo_loss(DPO_BETA * ((chosen - ref_c) - (rejected - ref_r)), None).backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        planned = self.planner.phase("mcd_train_step", mcd, "training")   # the same plan as chose checkpointing
        passes = 3 + self.checkpointing   # forward, backward (2x), + the recomputation when checkpointed
        flops = passes * (self.body_flops(tokens) + self.head_flops(n_completion))
        label = f"MCD-DPO training step ({pairs} pairs{', checkpointed' if self.checkpointing else ''})"
        self.measure("mcd_train_step", label, step, tokens=tokens, flops=flops, planned=planned)

    def _throughput_ratio(self, name: str, a: str, b: str) -> None:
        """tokens/s of measurement ``a`` over that of ``b`` (batches of different sizes)."""
        ra, rb = self.results.get(a, {}), self.results.get(b, {})
        if ra.get("tokens_per_s") and rb.get("tokens_per_s"):
            self.ratios[name] = ra["tokens_per_s"] / rb["tokens_per_s"]

    def _ratio(self, name: str, slow: str, fast: str) -> None:
        s, f = self.results.get(slow, {}), self.results.get(fast, {})
        if "median_s" in s and "median_s" in f:
            self.ratios[name] = s["median_s"] / f["median_s"]


# ---------------------------------------------------------------------------------------------------- output
def gib(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 0.1 * 2**30 else f"{n / 2**20:.1f} MiB"


def table(shapes: dict[str, ShapeBench]) -> str:
    head = f"{'shape':<12} {'measurement':<64} {'median':>10} {'tokens/s':>12} {'MFU':>6} {'peak':>11} " \
           f"{'planned':>11} {'meas/plan':>9}"
    lines = [head, "-" * len(head)]
    for name, bench in shapes.items():
        for row in bench.results.values():
            if "error" in row:
                lines.append(f"{name:<12} {row['label']:<64} {row['error'][:60]}")
                continue
            tps = f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else "-"
            mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a"
            ratio = f"{row['measured_over_planned']:.2f}" if row.get("measured_over_planned") else "n/a"
            lines.append(f"{name:<12} {row['label']:<64} {row['median_s'] * 1e3:>8.1f}ms {tps:>12} {mfu:>6} "
                         f"{gib(row['peak_bytes']):>11} {gib(row['planned_peak_bytes']):>11} {ratio:>9}")
    for name, bench in shapes.items():
        a = bench.args
        r = bench.ratios
        if "lora_sequential_over_batched" in r:
            lines.append(f"ratio ({name}): ENS-LoRA K={a.members} scoring, sequential passes / batched multi-LoRA: "
                         f"{r['lora_sequential_over_batched']:.2f}x"
                         + (f"; PEFT's mixed-adapter batch / batched: {r['lora_peft_mixed_over_batched']:.2f}x"
                            if "lora_peft_mixed_over_batched" in r else ""))
        if "lora_batched_over_extraction" in r:
            lines.append(f"ratio ({name}): ENS-LoRA batched member-tokens/s / extraction tokens/s: "
                         f"{r['lora_batched_over_extraction']:.2f} (aim >= 0.8)")
        if "extraction_planned_over_fixed" in r:
            lines.append(f"ratio ({name}): extraction tokens/s at the planner's batch / at {a.batch} x {a.length}: "
                         f"{r['extraction_planned_over_fixed']:.2f}x")
        if "lora_batched_planned_over_extraction_planned" in r:
            lines.append(f"ratio ({name}): ENS-LoRA batched member-tokens/s / extraction tokens/s, both at the "
                         f"planner's batch: {r['lora_batched_planned_over_extraction_planned']:.2f} (aim >= 0.8)")
        if "lora_train_sequential_over_batched" in r:
            lines.append(f"ratio ({name}): ENS-LoRA K={a.members} training step, sequential passes / batched: "
                         f"{r['lora_train_sequential_over_batched']:.2f}x")
        diffs = [f"{row['label']} {row['max_abs_reward_diff_vs_batched']:.2e}" for row in bench.results.values()
                 if "max_abs_reward_diff_vs_batched" in row]
        if diffs:
            lines.append(f"ENS-LoRA ({name}) max |reward - batched reward|: " + "; ".join(diffs))
        if "mcd_passes_over_masks" in bench.ratios:
            lines.append(f"ratio ({name}): MCD-DPO K={a.masks} full passes / shared backbone with K masks: "
                         f"{bench.ratios['mcd_passes_over_masks']:.2f}x")
        plan_ratios = [f"{k} {r['measured_over_planned']:.2f}" for k, r in bench.results.items()
                       if r.get("measured_over_planned")]
        lines.append(f"ratio ({name}): measured / planned peak: "
                     + (", ".join(plan_ratios) if plan_ratios else "n/a (no CUDA memory statistics on a CPU)"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated model names with a shape (default on a GPU: {GPU_SHAPES}; "
                             f"without one: {TINY})")
    parser.add_argument("--batch", type=int, default=None, help="sequences per forward (GPU 8, smoke 4)")
    parser.add_argument("--length", type=int, default=None, help="tokens per sequence (GPU 512, smoke 32)")
    parser.add_argument("--members", type=int, default=None, help="ENS-LoRA K (GPU 8, smoke 4)")
    parser.add_argument("--masks", type=int, default=None, help="MCD-DPO K dropout masks (GPU 20, smoke 4)")
    parser.add_argument("--lora-pairs", type=int, default=None,
                        help="pairs of --length tokens in the ENS-LoRA training step (GPU 4, smoke 2)")
    parser.add_argument("--mcd-pairs", type=int, default=None,
                        help="pairs of --length tokens in the MCD-DPO training step (GPU 16, smoke 2)")
    parser.add_argument("--pairs", type=int, default=None,
                        help="BAY-LIN training pairs (GPU: UltraFeedback's 62,135; smoke 2,048)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up (GPU 5, smoke 2)")
    parser.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape at tiny sizes, whatever the device")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not known")
    parser.add_argument("--cache-dir", default="outputs/cache", help="where the tiny model is built")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on a CPU, where a busy machine's cores make more slower)")
    parser.add_argument("--weights-cache", default=None,
                        help="a cache folder: the bf16 body of a shipped shape is built once into "
                             "<folder>/models/random-<shape> and loaded from there after (gpu_check.py's mission "
                             "loads the same); default: built in memory each time")
    parser.add_argument("--out", default="outputs/bench_gpu.json")
    args = parser.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    threads = torch.get_num_threads()
    try:
        run(args)
    finally:
        torch.set_num_threads(threads)   # a caller running this in its own process keeps its setting


def results_json(args, device, gpu_name, tflops, memory, smoke, done: dict, t0: float, complete: bool) -> dict:
    return {"device": str(device), "device_name": gpu_name, "peak_bf16_tflops": tflops, "memory": memory.kind,
            "settings": {k: getattr(args, k) for k in ("batch", "length", "members", "lora_pairs", "masks",
                                                       "mcd_pairs", "pairs", "repeats")}
            | {"lora_rank": LORA_RANK, "dropout": DROPOUT, "logprob_chunk": "auto", "smoke": smoke},
            "torch": torch.__version__, "seconds": time.perf_counter() - t0, "complete": complete,
            "shapes": {name: {"dtype": str(b.dtype).removeprefix("torch."), "params_causal_lm":
                              b.arch.params_causal_lm, "params_body": b.arch.params_body,
                              "measurements": b.results, "ratios": b.ratios, "budgets": b.budgets,
                              "plans": b.planner.plans}
                       for name, b in done.items()}}


def run(args) -> None:

    from rewarduq_exp.core.strict_json import write_json
    from rewarduq_exp.models.backbone import resolve_device
    from rewarduq_exp.runner.plan import KNOWN_TRAIN_PAIRS

    device = resolve_device(args.device)
    smoke = args.smoke or device.type == "cpu"
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    for key, (gpu, tiny) in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if smoke else gpu)
    if args.pairs is None:
        args.pairs = KNOWN_TRAIN_PAIRS["ultrafeedback"]
    shapes = [TINY] if args.smoke else (args.shapes or (TINY if smoke else GPU_SHAPES)).split(",")
    gpu_name, tflops = peak_tflops(device, args.peak_tflops)
    memory = Memory(device)
    print(f"device {device} ({gpu_name}), dense bf16 peak {f'{tflops:g} TFLOPS' if tflops else 'n/a'}; "
          f"batch {args.batch} x {args.length} tokens, ENS-LoRA K={args.members} (training step: "
          f"{args.lora_pairs} pairs), MCD-DPO K={args.masks} "
          f"(training step: {args.mcd_pairs} pairs), "
          f"BAY-LIN {args.pairs:,} pairs, median of {args.repeats} after a warm-up, torch threads "
          f"{torch.get_num_threads()}; memory: {memory.kind}",
          flush=True)
    t0 = time.perf_counter()
    done: dict[str, ShapeBench] = {}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name in shapes:
        bench = ShapeBench(name.strip(), args, device, memory, tflops, args.cache_dir)
        print(f"{bench.name}: {bench.arch.params_causal_lm:,} parameters, hidden {bench.arch.hidden}, "
              f"{bench.arch.layers} layers, {str(bench.dtype).removeprefix('torch.')}", flush=True)
        bench.run()
        done[bench.name] = bench
        # after each shape, so that a caller's time limit (gpu_check.py) still finds the shapes measured so far
        write_json(args.out, results_json(args, device, gpu_name, tflops, memory, smoke, done, t0,
                                          complete=len(done) == len(shapes)))
    print(table(done), flush=True)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
