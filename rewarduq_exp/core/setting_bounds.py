"""One table of the integer settings, with the bounds of those that size an allocation (bins, ensemble members, MC
samples, batch sizes and token budgets, candidates, layers, hidden sizes, pair counts, bootstrap draws), checked
before anything is allocated.

A setting's kind alone let ``evaluate.py metric.n_bins=1000000000`` grow to 18.7 GB before the kernel killed it and
``max_length=99999999999999999999999`` run: here every such setting has a range, generous enough for every shipped
config, sweep grid and the paper's sizes (Qwen3-32B, max_length up to 40,960, K = 20, 2000 bootstrap draws), and a
value outside it is one line naming the setting, the value, the limit and why::

    metric.n_bins=1000000000 is too large: at most 10000 bins (each bin needs pairs: ...)

The same table is read by every check of a value:

* the command line, before Hydra starts (:func:`rewarduq_exp.core.checks.check_like_default`, for ``train.py``,
  ``evaluate.py`` and ``downstream.py`` alike, and ``evaluate.py``'s ``dataset.<key>=`` options);
* the composed config of a run (:func:`check_config_bounds`), so a value from a config file of one's own, a tuned
  config or a sweep's grid is held to the same bounds;
* the metric functions' own ``n_bins`` check (:func:`rewarduq_exp.core.checks.check_n_bins`), for the Python API.

Limits that depend on the run (the backbone's context window for ``max_length``, its depth for ``probe.layer``, the
device's memory for K heads of a given width) are checked where the model is known
(:mod:`rewarduq_exp.runner.validation`).

Integer settings take integers only: ``probe.layer=-1.5`` is refused (it ran as -1 while the config recorded -1.5),
and so is ``dataset.n_train=2000.0``: the config would record 2000.0 while the code ran ``int(2000.0)``, and the run's
identity (its config hash, hence its folder and a sweep's "already completed" check) would differ from that of
``dataset.n_train=2000``, the same run; one spelling per value keeps them one run.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rewarduq_exp.core.errors import UserError

AUTO = "auto"


@dataclass(frozen=True)
class Bound:
    """An integer setting in [``minimum``, ``maximum``] (``maximum`` None: no upper bound), ``unit`` naming what it
    counts, ``why`` saying why the maximum (and ``why_min`` the minimum, when it is not the obvious one). ``allow``:
    the non-integer values the setting also takes (``auto``, null). ``each``: a list of such integers (at most
    ``max_items`` of them)."""

    minimum: int
    maximum: int | None
    unit: str
    why: str = ""
    why_min: str = ""
    allow: tuple = ()
    each: bool = False
    max_items: int = 64


TOKENS = 1_048_576        # 2**20: more than any backbone's context window (Qwen3: 40,960; the longest: 1M)
PAIRS = 1_000_000         # pairs of a generated world, and the active-learning pool drawn from it
BATCH_ROWS = 65_536       # pairs or rows per step / per forward
MAX_BINS = 10_000
WIDTH = 65_536            # hidden units of a head

_TOKENS_WHY = "more than any backbone's context window: the paper's Qwen3 read 40,960 tokens, the longest 1M"
_BINS_WHY = "each bin needs pairs; with 1000 eval pairs more than 1000 bins are empty"

# The settings of the run, the data, the metrics, the planner and the tasks. A method's integer settings carry their
# bounds on its settings dataclass (``setting(bound=...)`` in :mod:`rewarduq_exp.methods.settings`), so adding a method
# edits nothing here; the checks below take them as ``bound=`` / ``extra=``.
BOUNDS: dict[str, Bound] = {
    # ---- sequence lengths and token budgets
    "max_length": Bound(1, TOKENS, "tokens", _TOKENS_WHY + "; the backbone's own window is checked once it is known",
                        allow=(None,)),
    "plan.mean_tokens": Bound(1, TOKENS, "tokens", _TOKENS_WHY, allow=(None,)),
    "probe.batch_tokens": Bound(1, TOKENS, "tokens", "16x the largest budget auto picks, 65,536 on a GPU; one "
                                "forward holds the activations of every token", allow=(AUTO,)),
    # ---- pairs and rows
    "dataset.n_train": Bound(2, PAIRS, "training examples", "a generated world holds ~2 KB of text per pair in "
                             "memory: 1M pairs are ~2 GB, more than the largest real preference set used here, Tulu "
                             "3's 271K", why_min="a method cannot learn a preference from a single example",
                             allow=(None,)),
    "dataset.n_eval": Bound(1, PAIRS, "examples", "a generated world holds ~2 KB of text per pair in memory",
                            allow=(None,)),
    "dataset.n_ood": Bound(1, PAIRS, "examples", "a generated world holds ~2 KB of text per pair in memory",
                           allow=(None,)),
    "dataset.n_cal": Bound(0, PAIRS, "examples", "a generated world holds ~2 KB of text per pair in memory",
                           why_min="0: no calibration split", allow=(None,)),
    "dataset.min_words": Bound(1, 10_000, "words", "longer replies than any max_length of the paper keeps"),
    "dataset.max_words": Bound(1, 10_000, "words", "longer replies than any max_length of the paper keeps"),
    "dataset.candidate_max_words": Bound(1, 10_000, "words", "longer replies than any max_length of the paper keeps",
                                         allow=(None,)),
    "dataset.folds": Bound(2, 1000, "folds", "every fold trains the learner again"),
    "dataset.vocab_size": Bound(2, 256, "words", "the synthetic world has 256 words, each one token of the tiny "
                                "tokenizer"),
    "dataset.num_topics": Bound(1, 16, "topics", "the synthetic world has 16 topic words"),
    "plan.n_train": Bound(1, 10**9, "pairs", "more than any preference dataset", allow=(None,)),
    "plan.n_eval": Bound(1, 10**9, "pairs", "more than any preference dataset", allow=(None,)),
    # ---- batches
    "probe.batch_size": Bound(1, BATCH_ROWS, "rows", "one forward holds the activations of every row; auto lets the "
                              "token budget decide", allow=(AUTO,)),
    "task.batch_size": Bound(1, BATCH_ROWS, "rows", "one forward holds the activations of every row",
                             allow=(None,)),
    # ---- layers of the backbone (its own depth is checked once it is known)
    "probe.layer": Bound(-1025, 1024, "", "deeper than any backbone: Qwen3-32B has 64 layers"),
    "probe.intermediate_layer": Bound(-1025, 1024, "", "deeper than any backbone: Qwen3-32B has 64 layers",
                                      allow=(None, "none")),
    # ---- metrics
    "metric.n_bins": Bound(1, MAX_BINS, "bins", _BINS_WHY),
    "metric.ranking.n_bins": Bound(1, MAX_BINS, "bins", _BINS_WHY),
    "metric.ranking.max_k": Bound(1, 100, "", "k never exceeds the number of items, and every k adds its events"),
    "metric.ranking.max_subsets": Bound(1, 1_000_000, "subsets", "each k-subset is a calibration problem of its own",
                                        allow=(None,)),
    "metric.ranking.kernel_max_samples": Bound(2, 10_000_000, "samples", "the kernel estimator is quadratic in them",
                                               allow=(None,)),
    "recalibrate.isotonic_min_pairs": Bound(10, 10**8, "pairs", "more than any preference dataset",
                                            why_min="an isotonic map of fewer pairs follows noise"),
    # ---- the backbone (the offline tiny model is built from these)
    "model.hidden_size": Bound(1, WIDTH, "units", "wider than any backbone: Qwen3-32B is 5120 wide", allow=(None,)),
    "model.build.hidden_size": Bound(8, 8192, "units", "the offline test backbone is built on this machine; "
                                     "Qwen3-32B is 5120 wide"),
    "model.build.num_layers": Bound(1, 128, "layers", "the offline test backbone is built on this machine; "
                                    "Qwen3-32B has 64"),
    "model.build.num_heads": Bound(1, 256, "heads", "Qwen3-32B has 64"),
    "model.build.num_kv_heads": Bound(1, 256, "heads", "Qwen3-32B has 8"),
    "model.build.vocab_size": Bound(1, 262_144, "tokens", "the tokenizer is trained on this machine; Qwen3's has "
                                    "151,936"),
    # ---- checkpoints
    "checkpoint.every_steps": Bound(1, None, "steps", allow=(None,)),
    # ---- downstream tasks (conf/task/*.yaml)
    "task.prompts": Bound(1, 100_000, "prompts", "each prompt's candidates are generated and scored"),  # >= 2: the
    # task's own check, which says why (k is chosen on some prompts and reported on the others)
    "task.n_max": Bound(1, TOKENS, "candidates", "every candidate of every prompt is generated and scored; "
                        "task.prompts x task.n_max is bounded as well"),
    "task.knn": Bound(1, 10_000, "neighbours", "the k-NN distance sorts this many training features per candidate"),
    "task.draws": Bound(100, 100_000, "draws", "each draw resamples every prompt's curve; 2000 give intervals to "
                        "their third decimal", why_min="fewer draws give no interval worth reporting"),
    "task.pool": Bound(2, PAIRS, "pairs", "the pool is drawn from a generated world's training pairs"),
    "task.initial": Bound(2, PAIRS, "pairs", "the pool is drawn from a generated world's training pairs"),
    "task.batch": Bound(1, PAIRS, "pairs", "the pool is drawn from a generated world's training pairs"),
    "task.rounds": Bound(0, 10_000, "rounds", "each round retrains the method"),
    "task.repeats": Bound(1, 1000, "repeats", "each repeat runs every round of every strategy again"),
    # task=rl: each RL step samples, scores and trains on prompts_per_step x generations completions
    "task.steps": Bound(1, 100_000, "steps", "each step generates, scores and trains on a batch of completions"),
    "task.eval_every": Bound(1, 100_000, "steps", "a measurement every this many steps"),
    "task.prompts_per_step": Bound(1, 4096, "prompts", "each step generates and trains on every prompt's group"),
    "task.generations": Bound(2, 1024, "completions", "each step generates and trains on every completion",
                              why_min="a group of one completion has no advantage to estimate"),
    "task.eval_samples": Bound(2, 1_000_000, "completions", "each measurement samples, scores and measures every one"),
    "task.max_tokens": Bound(1, 32_768, "tokens", "every completion may run this long in every step"),
    "task.check_samples": Bound(2, 1_000_000, "completions", "the reference samples and scores every one"),
    "task.seeds": Bound(0, 2**31 - 1, "", "a seed", each=True),
    "task.select_seeds": Bound(0, 2**31 - 1, "", "a seed", each=True),
    "task.workers": Bound(1, 256, "processes", "each worker process holds a policy, its reference and a reward model"),
    "task.sft.examples": Bound(1, 10_000_000, "completions", "each is generated and tokenised before the SFT"),
    "task.sft.steps": Bound(0, 1_000_000, "steps", "each step trains the policy on a batch"),
    "task.sft.batch_size": Bound(1, BATCH_ROWS, "rows", "one step holds the activations of every row"),
    # serve.py (conf/serve.yaml)
    "serve.port": Bound(0, 65535, "", "a TCP port (0: any free one)"),
    "serve.max_batch": Bound(1, BATCH_ROWS, "completions", "one model call holds the activations of every row"),
    "serve.max_items": Bound(1, BATCH_ROWS, "completions", "a request's completions are parsed and held at once"),
    "serve.max_chars": Bound(1, 100_000_000, "characters", "a text is held, rendered and tokenised whole"),
    "serve.max_body_bytes": Bound(1, 2**31, "bytes", "a request's body is held whole before it is parsed"),
    "serve.max_queue": Bound(1, 100_000_000, "completions", "what waits to be scored is held in memory"),
}

# task.prompts x task.n_max: the candidates of one split, each generated, scored (the backbone's features kept) and
# sorted; 4M candidates of a 5120-wide backbone are 80 GiB of float32 features.
MAX_CANDIDATES = 4_194_304

# Settings whose default is a whole number but that take any number: minutes, epochs (a fraction of one is a shorter
# schedule), LoRA's alpha, the kernel's p-norm, a score offset, BoRP's score range. Every other setting with an
# integer default takes integers only (:func:`rewarduq_exp.core.checks.check_like_default`).
REAL_VALUED = frozenset({"checkpoint.every_minutes", "progress_log_minutes", "task.method.num_epochs",
                         "metric.ranking.kernel_p", "dataset.score_offset", "serve.max_wait_ms",
                         "serve.body_timeout_s", "serve.request_timeout_s"})


def is_integer(value) -> bool:
    """A whole number written as one: Python and numpy integers, not booleans, not floats (2.0 included)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def shown(value) -> str:
    """A value as it is written on the command line."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def integer_kind_problem(key: str, value, default=None, text: str | None = None, allow: Sequence = ()) -> str | None:
    """The message when ``value`` of an integer setting is not an integer (or one of ``allow``), else None."""
    if is_integer(value) or any(value is a or (isinstance(a, str) and value == a) for a in allow):
        return None
    text = shown(value) if text is None else text
    allowed = " or ".join([*map(shown, allow), "an integer"])
    its_default = f" (its default is {default})" if default is not None else ""
    whole = isinstance(value, float) and math.isfinite(value) and value.is_integer()
    hint = f"; write it without a decimal point or exponent: {key}={int(value)}" if whole else ""
    return f"{key}={text} is invalid: must be {allowed}{its_default}{hint}"


def bound_of(key: str) -> Bound | None:
    return BOUNDS.get(key)


def check_bound(key: str, value, text: str | None = None, bound: Bound | None = None):
    """``value`` of setting ``key`` (dotted, as on the command line) when it has no bound or it is of the bound's kind
    and within it; else a one-line :class:`UserError`. ``bound``: the setting's own (a method's settings carry theirs,
    :func:`rewarduq_exp.methods.settings.setting`); default: this table's entry. ``text``: the value as the user wrote
    it. Interpolations (``${...}``) are judged once resolved."""
    bound = BOUNDS.get(key) if bound is None else bound
    if bound is None or (isinstance(value, str) and "${" in value):
        return value
    if bound.each:
        if value is None or value in bound.allow:
            return value
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise UserError(f"{key}={shown(value) if text is None else text} is invalid: must be a list of integers "
                            f"in [{bound.minimum}, {bound.maximum}]")
        if len(value) > bound.max_items:
            raise UserError(f"{key} has {len(value)} entries, too many: at most {bound.max_items}")
        for item in value:
            _check_one(key, item, bound, None, element=True)
        return value
    return _check_one(key, value, bound, text)


def _check_one(key: str, value, bound: Bound, text: str | None, element: bool = False):
    if any(value is a or (isinstance(a, str) and value == a) for a in bound.allow):
        return value
    text = shown(value) if text is None else text
    what = f"{key} holds {text}, which" if element else f"{key}={text}"
    if not is_integer(value):
        raise UserError(integer_kind_problem(key, value, text=text, allow=bound.allow) if not element
                        else f"{what} is invalid: must be an integer")
    unit = f" {bound.unit}" if bound.unit else ""
    if bound.maximum is not None and value > bound.maximum:
        why = f" ({bound.why})" if bound.why else ""
        raise UserError(f"{what} is too large: at most {bound.maximum}{unit}{why}")
    if value < bound.minimum:
        why = f" ({bound.why_min})" if bound.why_min else ""
        raise UserError(f"{what} is invalid: must be an integer >= {bound.minimum}{why}")
    return value


def check_config_bounds(cfg, prefixes: Sequence[str] | None = None, at: str = "",
                        extra: Mapping[str, Bound] | None = None) -> None:
    """Every setting of the table (and of ``extra``: the bounds the run's method declares on its settings,
    ``method.<key>``) that the composed config ``cfg`` holds (all of them, or those under ``prefixes``), and the
    products the table bounds (:data:`MAX_CANDIDATES`). ``at``: the key of ``cfg`` in the whole config (``metric``
    for a run's metric config). Values that do not resolve here are left to the setting's own check."""
    from omegaconf import OmegaConf

    def value_of(key: str):
        if at:
            if not key.startswith(f"{at}."):
                return _ABSENT
            key = key[len(at) + 1:]
        try:
            found = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False)
        except Exception:  # noqa: BLE001 (an interpolation that resolves only in a run: its own check judges it)
            return _ABSENT
        if OmegaConf.is_config(found):
            found = OmegaConf.to_container(found, resolve=True) if OmegaConf.is_list(found) else _ABSENT
        return found

    table = {**BOUNDS, **(extra or {})}
    for key, bound in table.items():
        if prefixes is not None and not key.startswith(tuple(prefixes)):
            continue
        value = value_of(key)
        if value is not _ABSENT and value != "???":
            check_bound(key, value, bound=bound)
    prompts, n_max = value_of("task.prompts"), value_of("task.n_max")
    if is_integer(prompts) and is_integer(n_max) and prompts * n_max > MAX_CANDIDATES:
        raise UserError(f"task.prompts={prompts} x task.n_max={n_max} = {prompts * n_max} candidates per split is too "
                        f"many: at most {MAX_CANDIDATES} (each is generated and scored, and its backbone features "
                        "kept: 4M candidates of a 5120-wide backbone are 80 GiB); lower task.prompts or task.n_max")


_ABSENT = object()
