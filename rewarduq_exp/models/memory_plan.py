"""The shared vocabulary of memory plans: what a run of a method holds on its device, phase by phase, and the FLOPs
it spends (``train.py ... plan=true``, the Slurm launcher's memory check, and each method's own batch sizing).

Each method owns its memory model: a reward method that can be planned overrides ``plan_memory(ctx)``
(:class:`rewarduq_exp.methods.base.RewardMethod`) and builds a :class:`Plan` from the :class:`PlanContext` the
planner gives it (the composed config, the backbone's shapes, the device, the data sizes). Nothing outside the method
is keyed by its name. The feature-cache part that every frozen-backbone head shares (extraction, the features on the
device) is :func:`feature_head_plan`; a head adds its own training parts through ``head_memory``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.models.activation_memory import inference_token_bytes
from rewarduq_exp.models.shapes import Architecture
from rewarduq_exp.models.token_budget import budget_from_memory, check_setting, free_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
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


def attention_flops(a: Architecture, tokens: float, mean_tokens: int) -> float:
    """Causal attention scores and values: 2 matmuls x 2 FLOPs x L/2 keys x q_dim, per layer and token."""
    return 2 * a.layers * mean_tokens * a.q_dim * tokens


@dataclass
class PlanContext:
    """What a method's memory model is given: the composed train config, the method's settings as its constructor
    checks them (``method``: its settings dataclass, so a memory model reads ``ctx.method.num_heads`` already checked
    and normalised, never the raw config node), the backbone's shapes on the meta device, the device and the
    backbone's dtype there, and the data sizes. Sequences are planned at ``length`` (max_length) tokens, times at
    ``mean_tokens``."""

    cfg: DictConfig
    name: str
    arch: Architecture
    device: str
    dtype: str
    n_train: int
    n_eval: int
    length: int
    mean_tokens: int
    tflops: float
    method: object   # the method's checked settings (a MethodSettings dataclass)

    @property
    def math_kernel(self) -> bool:
        """Attention runs as a plain softmax (PyTorch's math kernel: the CPU with a padding mask), which keeps the
        attention matrix; GPU kernels keep none."""
        return self.device == "cpu"

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def memory(self) -> float:
        return device_memory(self.cfg, self.device)

    def budget_tokens(self, setting, key: str, per_token: float, reserved: float, rows: int | None = None) -> int:
        return budget_tokens(setting, key, self.cfg, self.device, per_token, reserved, rows, self.length)

    def attention_flops(self, tokens: float) -> float:
        return attention_flops(self.arch, tokens, self.mean_tokens)

    def plan(self, params_total: int, params_trainable: int, phases: list[Phase], flops: dict[str, float],
             **extra) -> Plan:
        return Plan(self.name, self.arch.name, self.device, self.dtype, params_total, params_trainable, phases, flops,
                    self.tflops, self.n_train, self.n_eval, self.length, **extra)


@dataclass
class HeadMemory:
    """What a head on cached features adds in training: its trainable parameters, the parts it holds (bytes, by
    name) beside the train features, and the FLOPs of its training."""

    trainable: int
    parts: dict[str, float]
    flops: float


def feature_head_plan(ctx: PlanContext, head: HeadMemory) -> Plan:
    """The plan of a head trained on frozen-backbone features (``uses_feature_cache``).

    Extraction = the frozen body in the backbone's dtype + one layer's inference activations for ``probe.batch_size``
    sequences (all layers' hidden states when ``probe.layer`` is not -1) + the pooled rows. Training = the train
    features (chosen and rejected, float32) on the device + ``head``. The encoder keeps the body loaded after
    extracting, so in a run that extracts its features the body is counted in training too; with every feature in the
    cache (``plan.features_cached=true``) it is never loaded. The feature cache on disk: 2 x (train + eval pairs) rows
    x d x the backbone dtype's bytes."""
    cfg, a = ctx.cfg, ctx.arch
    wb = ctx.dtype_bytes
    weights = a.params_body * wb
    rows = check_setting(OmegaConf.select(cfg, "probe.batch_size", default="auto"), "probe.batch_size")
    all_hidden = int(OmegaConf.select(cfg, "probe.layer", default=-1)) != -1
    texts = 2 * ctx.n_train
    # The two-pass shared-prompt forward keeps its KV cache: counted, as the run's budget counts it (the plan sees
    # no data, so it cannot know that no prompt repeats).
    per_token = inference_token_bytes(a, ctx.length, wb, ctx.math_kernel, all_hidden, kv_cache=True)
    tokens = ctx.budget_tokens(OmegaConf.select(cfg, "probe.batch_tokens", default="auto"), "probe.batch_tokens",
                               per_token, weights, None if rows == "auto" else rows)
    extraction = Phase("extraction", {
        "backbone weights": weights,
        f"activations (inference, batches of {tokens:,} tokens)": tokens * per_token})
    # the pooled rows stay on the device until the end of the extraction (one copy back)
    extraction.parts["extracted features"] = texts * a.hidden * wb
    cached = bool(OmegaConf.select(cfg, "plan.features_cached", default=False))
    training = Phase("training", {})
    if not cached:
        training.parts["backbone weights (kept by the encoder)"] = weights
    training.parts["train features (float32)"] = texts * a.hidden * 4
    if ctx.device == "cpu" and wb != 4:
        training.parts["features as read from the cache"] = texts * a.hidden * wb
    training.parts.update(head.parts)
    extract_tokens = 2 * (ctx.n_train + ctx.n_eval) * ctx.mean_tokens
    flops = {"extraction": 2 * a.params_body * extract_tokens + ctx.attention_flops(extract_tokens),
             "training": head.flops}
    plan = ctx.plan(a.params_body + head.trainable, head.trainable, [extraction, training], flops,
                    disk={"feature cache (one layer)": 2 * (ctx.n_train + ctx.n_eval) * a.hidden * wb})
    if cached:
        plan.notes.append("plan.features_cached=true: the backbone is never loaded; extraction is not run")
        plan.phases = [training]
        plan.flops["extraction"] = 0.0
    return plan
