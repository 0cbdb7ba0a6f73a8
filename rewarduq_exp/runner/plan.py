"""What a run will need, before it runs: ``python train.py <overrides> plan=true``.

From the composed config alone (no weights, no data) the plan gives, per device, the bytes of every part the
configured method holds in each of its phases, the expected peak, the FLOPs of feature extraction, training and
scoring, and a time estimate at ``plan.tflops``. Parameter counts come from the architecture built on the meta device
(:mod:`rewarduq_exp.models.shapes`); the rest follows what the methods' code holds:

Each method owns its memory model (``plan_memory`` of its class, :mod:`rewarduq_exp.models.memory_plan`): the
feature-cache heads share extraction and the features on the device and add their head (ENS-MLP:
:meth:`~rewarduq_exp.methods.ens_mlp.EnsMLP.head_memory`, BAY-LIN likewise), ENS-LoRA
(:mod:`rewarduq_exp.methods.ens_lora_memory`) and MCD-DPO (:mod:`rewarduq_exp.methods.mcd_dpo.memory`) size their
micro-batches, checkpointing and scoring batches with the same formulas they plan with. This module turns a config
into a :class:`~rewarduq_exp.models.memory_plan.PlanContext`, asks the method, and prints the answer; nothing here
is keyed by a method's name.

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

import copy
import itertools

from omegaconf import DictConfig, OmegaConf, open_dict

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.models.memory_plan import (  # noqa: F401  (part of the planner's API)
    DEFAULT_GPU_MEMORY_GIB,
    DTYPE_BYTES,
    GIB,
    Phase,
    Plan,
    PlanContext,
    budget_tokens,
    device_memory,
)
from rewarduq_exp.models.memory_plan import attention_flops as _attention_flops  # noqa: F401
from rewarduq_exp.models.shapes import architecture

H100_BF16_DENSE_TFLOPS = 989.0
DEFAULT_TFLOPS = 0.4 * H100_BF16_DENSE_TFLOPS
# Training pairs of the hub datasets whose whole train split a run reads (num_samples: all), as the dataset configs
# describe them; anything else takes plan.n_train. Eval pairs likewise (plan.n_eval otherwise).
KNOWN_TRAIN_PAIRS = {"ultrafeedback": 62_135, "skywork_pref": 77_016}
KNOWN_EVAL_PAIRS = {"ultrafeedback": 1_000, "reward_bench": 2_985}


# ---------------------------------------------------------------------------------------------------- the plan
def method_name_of_config(cfg: DictConfig) -> str | None:
    from rewarduq_exp.methods.registry import method_name_of_target

    return method_name_of_target(cfg.method.get("_target_"))


def planned_methods() -> list[str]:
    """The reward methods with a memory model (``plan_memory``), by name."""
    from rewarduq_exp.methods.registry import method_class, method_names

    return [n for n in method_names() if method_class(n).has_memory_model()]


def method_name(cfg: DictConfig) -> str:
    """The configured method's name, refused with the planned ones when it has no memory model."""
    from rewarduq_exp.methods.registry import method_class

    name = method_name_of_config(cfg)
    if name is None or not method_class(name).has_memory_model():
        raise UserError(f"plan=true covers the methods {', '.join(planned_methods())}, not method={name} (a method "
                        "is planned when its class has a memory model, plan_memory)")
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
        n_eval += sum(_also_evaluated_pairs(e) for e in (cfg.get("also_evaluate") or []))
    return int(n_train), int(n_eval)


def _also_evaluated_pairs(entry) -> int:
    """The pairs of one ``also_evaluate`` entry: its own n_eval or eval_num_samples option, else a known size."""
    from rewarduq_exp.data.registry import also_evaluate_entry

    name, options = also_evaluate_entry(entry)
    if options.get("n_eval") is not None:
        return int(options["n_eval"])
    return _sampled(options.get("eval_num_samples", "all"), KNOWN_EVAL_PAIRS.get(name, 0))


def _sampled(num_samples, total: int) -> int:
    if num_samples in (None, "all"):
        return total
    value = float(num_samples)
    return int(value * total) if value <= 1 and not float(value).is_integer() else min(int(value), total)


def make_plan(cfg: DictConfig) -> Plan:
    """The plan of the run that ``cfg`` (a composed train config) describes: the configured method's own memory model
    (``plan_memory`` of its class) on the context the config gives."""
    from rewarduq_exp.methods.registry import method_class

    name = method_name(cfg)
    device = plan_device(cfg)
    dtype = backbone_dtype(cfg, device)
    a = architecture(cfg.model, OmegaConf.select(cfg, "paths.cache_dir", default=None))
    n_train, n_eval = dataset_sizes(cfg)
    length = int(cfg.max_length)
    mean_tokens = int(OmegaConf.select(cfg, "plan.mean_tokens", default=None) or length)
    tflops = float(OmegaConf.select(cfg, "plan.tflops", default=None) or DEFAULT_TFLOPS)
    cls = method_class(name)
    ctx = PlanContext(cfg, name, a, device, dtype, n_train, n_eval, length, mean_tokens, tflops,
                      method=checked_settings(cls, cfg.method))
    return cls.plan_memory(ctx)


def checked_settings(cls, method_cfg):
    """The settings of method class ``cls`` that a composed ``method`` config gives, checked as its constructor checks
    them (a value it refuses is the same one-line error here, before anything is planned)."""
    values = OmegaConf.to_container(method_cfg, resolve=True)
    values.pop("_target_", None)
    return cls.settings_class.build(values)


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
                if not set(point) <= set(fixed):
                    points.append((point, compose(config_name, overrides=[*fixed, *point])))
                else:  # nothing beyond the config composed above: it, less the hydra node (what compose() returns)
                    cfg = copy.deepcopy(first)   # its own nodes: interpolations resolve against this root
                    with open_dict(cfg):
                        del cfg["hydra"]
                    points.append((point, cfg))
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
