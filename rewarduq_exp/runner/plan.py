"""What a run will need, before it runs: ``python train.py <overrides> plan=true``.

From the composed config alone (no weights, no data) the plan gives, per device, the bytes of every part the
configured method holds in each of its phases, the expected peak, the FLOPs of feature extraction, training and
scoring, and a time estimate at ``plan.tflops``. Parameter counts come from the architecture built on the meta device
(:mod:`rewarduq_exp.models.shapes`); the rest follows what the methods' code holds:

* ENS-MLP / BAY-LIN (``uses_feature_cache``): extraction = the frozen body in the backbone's dtype + one layer's
  inference activations for ``probe.batch_size`` sequences (all layers' hidden states when ``probe.layer`` is not
  -1). Training = the train features (chosen and rejected, float32) on the device, the heads with gradients, AdamW
  states and the anchor copy (ENS-MLP: K stacked MLPs) or the d x d float64 posterior precision and its Cholesky
  factor (BAY-LIN). The encoder keeps the body loaded after extracting, so in a run that extracts its features
  the body is counted in training too; with every feature in the cache (``plan.features_cached=true``) it is never
  loaded. The feature cache on disk: 2 x (train + eval pairs) rows x d x the backbone dtype's bytes.
* ENS-LoRA: one frozen body + K adapters (LoRA on every Linear, float32) with gradients, AdamW states and the
  anchor's initial copy, + K linear heads; activations of the training forward for a micro-batch of m pairs: K x 2
  x m rows when all members run in one batched forward (``mixed_adapter_training=auto``, the default on every
  device, or true), 2 x m rows when each member runs its own pass (false, or auto where K members of one pair do
  not fit the device even checkpointed). m and activation checkpointing (which keeps each layer's input and
  recomputes one layer at a time) are what the method's ``auto`` picks on the device's memory, or as set.
* MCD-DPO: the causal LM in float32 (bf16 autocast on a bf16 backbone), its gradients and two AdamW states (the
  reference log-probs are pre-computed with the policy itself: no reference copy while training), activations of
  ``micro_batch_size`` pairs (2 x rows), and the completion log-probs (GPU: one checkpointed chunk of
  ``logprob_chunk`` x vocabulary logits; CPU: every chunk's logits are kept for backward). Scoring holds the policy
  and a float32 reference copy, with K masked copies of one chunk of hidden states through the LM head.

Activation sizes are counted per token and layer from what a Qwen3 decoder layer saves for backward (two RMSNorms,
q/k/v with their per-head norms and rotary embedding, attention output, the SwiGLU MLP's four I-sized tensors):
``6 d + 6 q + 6 kv + 4 I`` elements, stored in the compute dtype; the attention matrix adds ``2 heads x L`` per
token where the attention runs as a plain softmax (PyTorch's math kernel, the CPU with a padding mask) and nothing
on a GPU (flash / memory-efficient kernels). Inference keeps one layer alive: ``2 d + max(3 q + 3 kv (+ the
attention matrix), 3 I)`` per token, + the hidden states passed on.
Sequences are planned at ``max_length`` tokens (the longest a run keeps), which makes the peak an upper bound; the
time estimate uses ``plan.mean_tokens`` (null: max_length, again an upper bound).

FLOPs: 2 x params x tokens per forward, 4 x for a backward through frozen weights (ENS-LoRA: activation gradients
only), 6 x for full training, +2 x for the recomputation under gradient checkpointing, plus the causal attention
term 2 x layers x L x q per token and pass direction. Time = FLOPs / (plan.tflops x 1e12): the default, 40 % of an
H100's dense bf16 peak (989 TFLOPS), is 396 TFLOPS.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.models.activation_memory import (  # noqa: F401  (part of the planner's API)
    attention_matrix_elems,
    inference_activation_elems,
    inference_activations,
    inference_token_bytes,
    train_activation_elems,
    training_activations,
    training_token_bytes,
)
from rewarduq_exp.models.shapes import Architecture, architecture
from rewarduq_exp.models.token_budget import budget_from_memory, check_setting, free_bytes

H100_BF16_DENSE_TFLOPS = 989.0
DEFAULT_TFLOPS = 0.4 * H100_BF16_DENSE_TFLOPS
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PLANNED_METHODS = ("ens_mlp", "bay_lin", "ens_lora", "mcd_dpo")
# Training pairs of the hub datasets whose whole train split a run reads (num_samples: all), as the dataset configs
# describe them; anything else takes plan.n_train. Eval pairs likewise (plan.n_eval otherwise).
KNOWN_TRAIN_PAIRS = {"ultrafeedback": 62_135, "skywork_pref": 77_016}
KNOWN_EVAL_PAIRS = {"ultrafeedback": 1_000, "reward_bench": 2_985}
GIB = 2**30
DEFAULT_GPU_MEMORY_GIB = 79.6   # an H100 80GB as nvidia-smi reports its usable memory


@dataclass
class Phase:
    """One phase of a run (extraction, training, scoring): what it holds at its peak, by part, in bytes."""

    name: str
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        return sum(self.parts.values())


@dataclass
class Plan:
    method: str
    model: str
    device: str
    dtype: str
    params_total: int
    params_trainable: int
    phases: list[Phase]
    flops: dict[str, float]
    tflops: float
    n_train: int
    n_eval: int
    max_length: int
    disk: dict[str, float] = field(default_factory=dict)
    without_checkpointing: float | None = None   # peak with activation checkpointing switched the other way
    checkpointing: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return max(p.peak for p in self.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: p.peak).name

    @property
    def seconds(self) -> float:
        return sum(self.flops.values()) / (self.tflops * 1e12)

    def as_dict(self) -> dict:
        return {"method": self.method, "model": self.model, "device": self.device, "dtype": self.dtype,
                "params_total": self.params_total, "params_trainable": self.params_trainable,
                "peak_bytes": self.peak, "peak_phase": self.peak_phase,
                "phases": {p.name: {"peak_bytes": p.peak, **p.parts} for p in self.phases},
                "flops": self.flops, "tflops": self.tflops, "seconds": self.seconds, "disk_bytes": self.disk,
                "n_train": self.n_train, "n_eval": self.n_eval, "max_length": self.max_length,
                "checkpointing": self.checkpointing, "peak_bytes_other_checkpointing": self.without_checkpointing}


# ---------------------------------------------------------------------------------------------------- memory
def device_memory(cfg: DictConfig, device: str) -> float:
    """Bytes of the device a run gets: ``plan.device_memory_gib``, else an H100's 79.6 GiB for a GPU (what the token
    budgets and the default batch sizes aim at) or this host's available memory for a CPU."""
    given = OmegaConf.select(cfg, "plan.device_memory_gib", default=None)
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, (int, float)) or given <= 0:
            raise UserError(f"plan.device_memory_gib={given!r} is invalid: must be a number of GiB > 0")
        return float(given) * GIB
    if device == "cuda":
        return DEFAULT_GPU_MEMORY_GIB * GIB
    return free_bytes("cpu")


def budget_tokens(setting, key: str, cfg: DictConfig, device: str, per_token: float, reserved: float,
                  rows: int | None = None, length: int = 0) -> int:
    """Tokens per forward as a run decides them (:mod:`rewarduq_exp.models.token_budget`): ``setting`` when it is a
    number, else what the device's memory left after ``reserved`` bytes holds at ``per_token``; never more than
    ``rows`` sequences of ``length`` tokens when the rows are capped."""
    setting = check_setting(setting, key)
    if setting == "auto":
        setting = budget_from_memory(device_memory(cfg, device), per_token, device, reserved)
    return min(setting, rows * length) if rows else setting


# ---------------------------------------------------------------------------------------------------- the plan
def method_name_of_config(cfg: DictConfig) -> str | None:
    from rewarduq_exp.methods.registry import method_name_of_target

    return method_name_of_target(cfg.method.get("_target_"))


def method_name(cfg: DictConfig) -> str:
    name = method_name_of_config(cfg)
    if name not in PLANNED_METHODS:
        raise UserError(f"plan=true covers the methods {', '.join(PLANNED_METHODS)}, not method={name}")
    return name


def plan_device(cfg: DictConfig) -> str:
    """cuda or cpu: ``plan.device`` (auto: a GPU unless the run says device=cpu; the planner describes the job,
    not the login node it is typed on)."""
    wanted = str(OmegaConf.select(cfg, "plan.device", default="auto") or "auto")
    if wanted == "auto":
        wanted = "cpu" if str(cfg.get("device", "auto")) == "cpu" else "cuda"
    if wanted.split(":")[0] not in ("cpu", "cuda"):
        raise UserError(f"plan.device={wanted} is invalid; allowed: auto, cpu, cuda")
    return wanted.split(":")[0]


def backbone_dtype(cfg: DictConfig, device: str) -> str:
    """The dtype the backbone is loaded in: model.dtype on a GPU; float32 on a CPU unless model.keep_dtype_on_cpu
    (as :class:`rewarduq_exp.models.backbone.Backbone` decides)."""
    dtype = str(cfg.model.get("dtype", "float32"))
    if device == "cpu" and dtype != "float32" and not cfg.model.get("keep_dtype_on_cpu", False):
        return "float32"
    return dtype


def dataset_sizes(cfg: DictConfig) -> tuple[int, int]:
    """(train pairs, eval pairs) without loading data: the dataset config's own sizes (synthetic worlds), a known
    size of a hub dataset read whole (:data:`KNOWN_TRAIN_PAIRS`), a number of samples it asks for, else
    ``plan.n_train`` / ``plan.n_eval``."""
    ds = cfg.dataset
    name = str(ds.get("name"))
    n_train = OmegaConf.select(cfg, "plan.n_train", default=None)
    n_eval = OmegaConf.select(cfg, "plan.n_eval", default=None)
    if n_train is None:
        if ds.get("n_train") is not None:
            n_train = int(ds.n_train)
        elif name in KNOWN_TRAIN_PAIRS:
            n_train = _sampled(ds.get("num_samples", "all"), KNOWN_TRAIN_PAIRS[name])
        elif isinstance(ds.get("num_samples"), int):
            n_train = int(ds.num_samples)
        else:
            raise UserError(f"plan: the size of dataset '{name}' is not known without loading it; set "
                            "plan.n_train=<training pairs>")
    if n_eval is None:
        n_eval = int(ds.get("n_eval") or 0) + int(ds.get("n_ood") or 0)
        if not n_eval:
            n_eval = _sampled(ds.get("eval_num_samples", "all"), KNOWN_EVAL_PAIRS.get(name, 0))
        n_eval += sum(KNOWN_EVAL_PAIRS.get(str(e), 0) for e in (cfg.get("also_evaluate") or []))
    return int(n_train), int(n_eval)


def _sampled(num_samples, total: int) -> int:
    if num_samples in (None, "all"):
        return total
    value = float(num_samples)
    return int(value * total) if value <= 1 and not float(value).is_integer() else min(int(value), total)


def make_plan(cfg: DictConfig) -> Plan:
    """The plan of the run that ``cfg`` (a composed train config) describes."""
    name = method_name(cfg)
    device = plan_device(cfg)
    dtype = backbone_dtype(cfg, device)
    a = architecture(cfg.model, OmegaConf.select(cfg, "paths.cache_dir", default=None))
    n_train, n_eval = dataset_sizes(cfg)
    length = int(cfg.max_length)
    mean_tokens = int(OmegaConf.select(cfg, "plan.mean_tokens", default=None) or length)
    tflops = float(OmegaConf.select(cfg, "plan.tflops", default=None) or DEFAULT_TFLOPS)
    math_kernel = device == "cpu"
    builder = {"ens_mlp": _feature_head, "bay_lin": _feature_head, "ens_lora": _ens_lora, "mcd_dpo": _mcd_dpo}[name]
    plan = builder(cfg, name, a, device, dtype, n_train, n_eval, length, mean_tokens, tflops, math_kernel)
    return plan


def _attention_flops(a: Architecture, tokens: float, mean_tokens: int) -> float:
    """Causal attention scores and values: 2 matmuls x 2 FLOPs x L/2 keys x q_dim, per layer and token."""
    return 2 * a.layers * mean_tokens * a.q_dim * tokens


def _feature_head(cfg, name, a, device, dtype, n_train, n_eval, length, mean_tokens, tflops, math_kernel) -> Plan:
    wb = DTYPE_BYTES[dtype]
    m = cfg.method
    weights = a.params_body * wb
    rows = check_setting(OmegaConf.select(cfg, "probe.batch_size", default="auto"), "probe.batch_size")
    all_hidden = int(OmegaConf.select(cfg, "probe.layer", default=-1)) != -1
    texts = 2 * n_train
    # The two-pass shared-prompt forward keeps its KV cache: counted, as the run's budget counts it (the plan sees
    # no data, so it cannot know that no prompt repeats).
    per_token = inference_token_bytes(a, length, wb, math_kernel, all_hidden, kv_cache=True)
    tokens = budget_tokens(OmegaConf.select(cfg, "probe.batch_tokens", default="auto"), "probe.batch_tokens", cfg,
                           device, per_token, weights, None if rows == "auto" else rows, length)
    extraction = Phase("extraction", {
        "backbone weights": weights,
        f"activations (inference, batches of {tokens:,} tokens)": tokens * per_token})
    # the pooled rows stay on the device until the end of the extraction (one copy back)
    extraction.parts["extracted features"] = texts * a.hidden * wb
    cached = bool(OmegaConf.select(cfg, "plan.features_cached", default=False))
    d = a.hidden
    training = Phase("training", {})
    if not cached:
        training.parts["backbone weights (kept by the encoder)"] = weights
    training.parts["train features (float32)"] = texts * d * 4
    if device == "cpu" and wb != 4:
        training.parts["features as read from the cache"] = texts * d * wb
    batch = min(int(m.batch_size), n_train)   # a batch never holds more pairs than the data
    if name == "ens_mlp":
        k, h, nh = int(m.num_heads), int(m.hidden_dim), int(m.num_hidden_layers)
        per_head = d * h + (nh - 1) * h * h + h + nh * h
        trainable = k * per_head
        training.parts["ENS-MLP heads (weights, grads, AdamW x2, anchor copy)"] = 5 * trainable * 4
        if float(m.reg_lambda) > 0:   # the anchor penalty's p - p0 is kept for its backward
            training.parts["anchor penalty (p - p0, kept for backward)"] = trainable * 4
        # each hidden layer's ReLU output is kept for backward, two more (K, 2B, h) tensors are alive while computing
        training.parts["head activations"] = 2 * batch * (d + k * h * (nh + 2)) * 4
        train_flops = 6 * trainable * texts * float(m.num_epochs)
    else:
        trainable = d
        training.parts["dz = chosen - rejected (float32)"] = n_train * d * 4
        # accumulation, + lambda I, kept precision and Cholesky factor (float64), one chunk of 8192 rows in float64
        training.parts["BAY-LIN Hessian d x d (float64: H, H + lambda I, Cholesky)"] = 3 * d * d * 8
        training.parts["Hessian chunk (8192 x d, float64, x2)"] = 2 * min(8192, n_train) * d * 8
        train_flops = 6 * d * n_train * float(m.num_epochs) + 2 * n_train * d * d + d**3 / 3
    extract_tokens = 2 * (n_train + n_eval) * mean_tokens
    flops = {"extraction": 2 * a.params_body * extract_tokens + _attention_flops(a, extract_tokens, mean_tokens),
             "training": train_flops}
    plan = Plan(name, a.name, device, dtype, a.params_body + trainable, trainable, [extraction, training], flops,
                tflops, n_train, n_eval, length,
                disk={"feature cache (one layer)": 2 * (n_train + n_eval) * d * wb})
    if cached:
        plan.notes.append("plan.features_cached=true: the backbone is never loaded; extraction is not run")
        plan.phases = [training]
        plan.flops["extraction"] = 0.0
    return plan


def _ens_lora(cfg, name, a, device, dtype, n_train, n_eval, length, mean_tokens, tflops, math_kernel) -> Plan:
    """ENS-LoRA as the method sizes itself: the micro-batch and checkpointing that ``auto`` picks on this device's
    memory for pairs of two ``max_length`` rows under K members (the batched forward), scoring batches of the token
    budget in member-tokens."""
    from rewarduq_exp.models.activation_memory import lora_training_reserved
    from rewarduq_exp.models.token_budget import choose_micro_batch, fits_in_memory

    m = cfg.method
    wb = DTYPE_BYTES[dtype]
    act = wb   # bf16 autocast on a bf16 backbone, float32 otherwise
    k, rank, batch = int(m.num_members), int(m.lora_rank), min(int(m.batch_size), n_train)
    if m.get("target_modules", "all-linear") != "all-linear":
        raise UserError("plan: ENS-LoRA is planned for method.target_modules=all-linear only")
    lora = a.lora_params(rank)
    trainable = k * (lora + a.hidden)

    def flag(key):
        value = m.get(key, "auto")
        return True if value == "auto" else bool(value)

    mixed_training, mixed_scoring = flag("mixed_adapter_training"), flag("mixed_adapter_scoring")
    gc = m.get("gradient_checkpointing", "auto")
    gc = "auto" if str(gc) == "auto" else bool(gc)
    micro_setting = check_setting(m.get("micro_batch_size", "auto"), "method.micro_batch_size")
    body = a.params_body * wb
    free = device_memory(cfg, device) - body - trainable * 4
    reserved = lora_training_reserved(trainable)
    costs = [training_token_bytes(a, length, act, math_kernel, ckpt) for ckpt in (False, True)]
    if mixed_training and m.get("mixed_adapter_training", "auto") == "auto":   # as the method falls back
        mixed_training = fits_in_memory(free, reserved, 2 * length * k, costs[0 if gc is False else 1])
    item = 2 * length * (k if mixed_training else 1)
    micro, checkpointing = choose_micro_batch(batch, item, free, reserved, *costs, device, gc, micro=micro_setting)

    def training_phase(ckpt: bool) -> Phase:
        rows = (k if mixed_training else 1) * 2 * micro
        return Phase("training", {
            "frozen body": body,
            f"{k} LoRA adapters + heads (float32: weights, grads, AdamW x2, anchor copy)": 5 * trainable * 4,
            f"activations ({rows} rows x {length} tokens{', checkpointed' if ckpt else ''})":
                rows * length * costs[ckpt]})

    rows_cap = check_setting(m.get("score_batch_size", "auto"), "method.score_batch_size")
    per_text = k if mixed_scoring else 1
    per_token = inference_token_bytes(a, length, act, math_kernel, kv_cache=True)
    tokens = budget_tokens(m.get("score_batch_tokens", "auto"), "method.score_batch_tokens", cfg, device, per_token,
                           body + trainable * 4, None if rows_cap == "auto" else rows_cap * per_text, length)
    scoring = Phase("scoring", {"frozen body": body, f"{k} LoRA adapters + heads": trainable * 4,
                                f"activations (inference, batches of {tokens:,} member-tokens)": tokens * per_token})
    train_tokens = 2 * n_train * mean_tokens * float(m.num_epochs)
    per_member = 4 * a.params_body + 6 * lora + (2 * a.params_body if checkpointing else 0)
    flops = {"training": k * (per_member * train_tokens + 2 * _attention_flops(a, train_tokens, mean_tokens)),
             "scoring": k * (2 * a.params_body + 2 * lora) * 2 * n_eval * mean_tokens}
    plan = Plan(name, a.name, device, dtype, a.params_body + trainable, trainable, [training_phase(checkpointing),
                scoring], flops, tflops, n_train, n_eval, length, checkpointing=checkpointing)
    plan.without_checkpointing = max(training_phase(not checkpointing).peak, scoring.peak)
    plan.notes.append(f"micro-batch of {micro} pairs x {k if mixed_training else 1} member(s) "
                      f"({'auto' if micro_setting == 'auto' else 'as set'}), activation checkpointing "
                      f"{'on' if checkpointing else 'off'}")
    return plan


def _mcd_dpo(cfg, name, a, device, dtype, n_train, n_eval, length, mean_tokens, tflops, math_kernel) -> Plan:
    """MCD-DPO as the method sizes itself (:mod:`rewarduq_exp.methods.mcd_dpo.memory`): the micro-batch and
    checkpointing that ``auto`` picks on this device's memory for pairs of two ``max_length`` rows, and scoring
    batches of the token budget."""
    from rewarduq_exp.methods.mcd_dpo.memory import (
        auto_chunk,
        scoring_head,
        scoring_token,
        training_reserved,
        training_token,
    )
    from rewarduq_exp.models.token_budget import choose_micro_batch

    m = cfg.method
    if a.classifier and not a.tied:
        raise UserError(f"plan: model '{a.name}' is a sequence classifier without tied embeddings: it has no LM head "
                        "and method=mcd_dpo refuses it")
    p = a.params_causal_lm
    bf16 = dtype == "bfloat16"
    cuda = device == "cuda"
    k = int(m.num_samples)
    chunk_setting = check_setting(m.get("logprob_chunk", "auto"), "method.logprob_chunk")
    chunk = auto_chunk(a.vocab, 1) if chunk_setting == "auto" else chunk_setting
    score_chunk = auto_chunk(a.vocab, k) if chunk_setting == "auto" else chunk_setting
    gc = m.get("gradient_checkpointing", "auto")
    gc = "auto" if str(gc) == "auto" else bool(gc)
    micro_setting = check_setting(m.get("micro_batch_size", "auto"), "method.micro_batch_size")
    batch = min(int(m.batch_size), n_train)
    memory = device_memory(cfg, device)
    weights = p * 4.0
    free = memory - weights
    reserved = training_reserved(a, bf16, chunk, cuda)
    costs = [training_token(a, length, bf16, math_kernel, ckpt) for ckpt in (False, True)]
    micro, checkpointing = choose_micro_batch(batch, 2 * length, free, reserved, *costs, device, gc, divides=True,
                                              micro=micro_setting)

    def training_phase(ckpt: bool) -> Phase:
        rows = 2 * micro
        parts = {"policy weights (float32)": weights, "gradients (float32)": p * 4.0,
                 "AdamW states (2 x float32)": 2 * p * 4.0,
                 f"activations ({rows} rows x {length} tokens{', checkpointed' if ckpt else ''})":
                     rows * length * costs[ckpt]}
        rest = reserved - 12.0 * p
        if rest > 0:
            parts[f"autocast's bf16 weight copies{' + one chunk of logits' if cuda else ''}"] = rest
        return Phase("training", parts)

    rows_cap = check_setting(m.get("score_batch_size", "auto"), "method.score_batch_size")
    head = scoring_head(a, k, score_chunk, bf16)
    per_token = scoring_token(a, length, math_kernel)
    tokens = budget_tokens(m.get("score_batch_tokens", "auto"), "method.score_batch_tokens", cfg, device, per_token,
                           2 * weights + head, None if rows_cap == "auto" else rows_cap, length)
    scoring = Phase("scoring", {"policy weights (float32)": weights, "reference weights (float32)": weights,
                                f"activations (inference, batches of {tokens:,} tokens)": tokens * per_token,
                                f"{k} masked chunks of {score_chunk} positions through the LM head": head})
    completion = float(OmegaConf.select(cfg, "plan.completion_fraction", default=1.0) or 1.0)
    train_tokens = 2 * n_train * mean_tokens * float(m.num_epochs)
    eval_tokens = 2 * n_eval * mean_tokens
    v = a.vocab
    flops = {"reference pass": 2 * p * train_tokens + _attention_flops(a, train_tokens, mean_tokens),
             "training": (8 if checkpointing else 6) * p * train_tokens
             + 3 * _attention_flops(a, train_tokens, mean_tokens),
             "scoring": 2 * 2 * p * eval_tokens + 2 * (k - 1) * a.hidden * v * eval_tokens * completion}
    plan = Plan(name, a.name, device, dtype, p, p, [training_phase(checkpointing), scoring], flops, tflops, n_train,
                n_eval, length, checkpointing=checkpointing)
    plan.without_checkpointing = max(training_phase(not checkpointing).peak, scoring.peak)
    plan.notes.append(f"micro-batch of {micro} pairs ({'auto' if micro_setting == 'auto' else 'as set'}), "
                      f"{batch // micro} accumulation steps, activation checkpointing "
                      f"{'on' if checkpointing else 'off'}, log-prob chunks of {chunk} positions")
    return plan


# ---------------------------------------------------------------------------------------------------- output
def human_bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:.1f} MiB"


def human_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


def format_plan(plan: Plan) -> str:
    rows = [f"plan: method={plan.method} model={plan.model} on {plan.device} ({plan.dtype} backbone), "
            f"{plan.n_train} train pairs, {plan.n_eval} eval pairs, sequences at max_length={plan.max_length}",
            f"  parameters: {plan.params_total:,} total, {plan.params_trainable:,} trainable"]
    for phase in plan.phases:
        rows.append(f"  {phase.name}:")
        for part, value in phase.parts.items():
            rows.append(f"    {part:<72} {human_bytes(value):>12}")
        rows.append(f"    {'peak of the phase':<72} {human_bytes(phase.peak):>12}")
    for what, value in plan.disk.items():
        rows.append(f"  disk: {what:<66} {human_bytes(value):>12}")
    if plan.without_checkpointing is not None:
        state = "on" if plan.checkpointing else "off"
        other = "off" if plan.checkpointing else "on"
        rows.append(f"  activation checkpointing {state} (as the run decides it); {other}: peak "
                    f"{human_bytes(plan.without_checkpointing)}")
    for what, value in plan.flops.items():
        rows.append(f"  FLOPs {what:<66} {value:12.3e}")
    rows.append(f"  expected peak per device: {human_bytes(plan.peak)} ({plan.peak_phase}); time at "
                f"{plan.tflops:g} TFLOPS: {human_seconds(plan.seconds)}")
    rows += [f"  note: {n}" for n in plan.notes]
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------- commands
def sweep_points(cfg: DictConfig, overrides: list[str], config_loader=None) -> list[list[str]]:
    """The overrides of every point of a sweep, as Hydra's basic sweeper makes them: the ``hydra.sweeper.params`` of
    the config (a sweep config's grid), then the command line's ``overrides``, each ``key=value`` parsed by Hydra's
    override parser, so every form of its grammar enumerates as in the real sweep (``a,b,c``, ``choice(a,b)``,
    ``range(0,3)``, ``glob(ens_*)`` over a group's options with ``config_loader``; a quoted ``'a,b'`` is one value).
    A key given on the command line replaces the config's values for it. The cartesian product of all; one point for
    a single run. An ``interval(...)`` sweep is one line: only sampling sweepers (Optuna, ...) can run it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rewarduq_exp.core.errors import first_line

    parser = OverridesParser.create(config_loader=config_loader)
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None)
    params = OmegaConf.to_container(params) if params else {}
    texts = [(f"{k}={v}", f"hydra.sweeper.params: {k}: {v}") for k, v in params.items()]
    choices: dict[str, list[str]] = {}
    for text, shown in [*texts, *((arg, arg) for arg in overrides)]:
        try:
            parsed = parser.parse_override(text)
        except Exception as err:  # noqa: BLE001 (Hydra's parse errors have no common public type)
            raise UserError(f"{shown} is not a valid override ({first_line(err)}); see "
                            "https://hydra.cc/docs/advanced/override_grammar/extended/") from None
        parsed.config_loader = config_loader   # glob(...) lists a group's options through it
        key = parsed.get_key_element()
        if not parsed.is_sweep_override():
            choices[key] = [parsed.get_value_element_as_str()]
        elif parsed.is_discrete_sweep():
            choices[key] = list(parsed.sweep_string_iterator())
            if not choices[key]:
                raise UserError(f"{shown} gives no value to run (an empty range, or a glob that matches no option)")
        else:
            raise UserError(f"{shown}: an interval is not a grid; the basic sweeper runs lists, choice(...), "
                            "range(...) and glob(...)")
    keys = list(choices)
    return [[f"{k}={v}" for k, v in zip(keys, combo)] for combo in itertools.product(*(choices[k] for k in keys))]


PLAN_SWITCHES = ("plan=true", "plan=True", "plan=1")


def wants_plan(args: list[str]) -> bool:
    return any(a in PLAN_SWITCHES for a in args)


def compose_points(args: list[str], config_name: str = "train") -> list[tuple[list[str], DictConfig]]:
    """(overrides, composed config) of every point of the run or sweep that ``args`` describe."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rewarduq_exp.data.registry import CONF_DIR
    from rewarduq_exp.runner.cli import register_resolvers

    register_resolvers()
    parser = OverridesParser.create()
    args = [a for a in args if not a.startswith("-") and "=" in a and a not in PLAN_SWITCHES]
    fixed = [a for a in args if not parser.parse_override(a).is_sweep_override()]
    points = []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            first = compose(config_name, overrides=fixed, return_hydra_config=True)
            task_args = [a for a in args if not a.split("=", 1)[0].lstrip("+~").startswith("hydra")]
            for point in sweep_points(first, task_args, GlobalHydra.instance().config_loader()):
                points.append((point, compose(config_name, overrides=[*fixed, *point])))
    finally:
        GlobalHydra.instance().clear()
    return points


def plan_command(args: list[str]) -> int:
    """``train.py ... plan=true``: print the plan of the run (of every distinct point of a sweep, and which one
    peaks highest); nothing is loaded, created or submitted."""
    plans = [(overrides, make_plan(cfg)) for overrides, cfg in compose_points(args)]
    top_overrides, top = max(plans, key=lambda item: (item[1].peak, item[1].seconds))
    print(format_plan(top), flush=True)
    if len(plans) > 1:
        print(f"  sweep: {len(plans)} points planned; the largest peak is the point above "
              f"({' '.join(top_overrides)})", flush=True)
    return 0
