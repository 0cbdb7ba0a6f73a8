"""The RewardUQ selection rule (paper section 5.1): keep configurations with ECE <= 0.05 and EBCE <= 0.01 on the
validation set (UltraFeedback test), then rank them by RS_0.2, higher is better.

The thresholds and the ranking each read either the raw metrics (the paper's rule, the default) or the ones after
each run's recalibration (``recal/<metric>``, fitted on the run's calibration split): ``Criteria.filter_on`` and
``Criteria.rank_on``. They are separate because recalibration can make nearly every configuration pass the
thresholds, and the rule then reduces to the ranking alone; whichever the rule filters on, a :class:`Configuration`
says whether it passes each threshold on both, so the reports can show how much each one filtered.

Runs that differ only by seed form one configuration (same method, backbone, training dataset and method
hyperparameters). The rule is applied to the mean over seeds, so one lucky seed does not win; means and sample
standard deviations of every reported metric are kept for the reports. Selection is done separately for each
(method, backbone, training dataset), because Table 1 holds one setting per method and backbone.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import pandas as pd

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.runs.run_identity import NOT_HYPERPARAMETERS
from rewarduq_exp.runs.run_records import RunRecord

DEFAULT_DATASET = "ultrafeedback_test"
DEFAULT_ECE = 0.05
DEFAULT_EBCE = 0.01
DEFAULT_RANK = "rs_0.2"
# The metrics every report shows, in this order (the rank metric is added when it is another one).
REPORTED = ("win_rate", "ct_rate", "cf_rate", "rs_0.2", "ece", "ebce")
THRESHOLDED = ("ece", "ebce")
N_CLOSEST = 5
SOURCES = ("raw", "recalibrated")  # what filter_on / rank_on may be; "raw" is the paper's
PAPER_SOURCE = "raw"
RECAL_PREFIX = "recal/"


def source_key(metric: str, source: str) -> str:
    """The metrics.json key of ``metric`` read raw or after the run's recalibration."""
    return f"{RECAL_PREFIX}{metric}" if source == "recalibrated" else metric


def _check_source(option: str, value) -> str:
    if not isinstance(value, str) or value not in SOURCES:
        raise UserError(f"{option} {value!r} is invalid: allowed: {', '.join(SOURCES)}")
    return value


@dataclass(frozen=True)
class Criteria:
    dataset: str = DEFAULT_DATASET  # the evaluation block of metrics.json the rule reads
    ece: float = DEFAULT_ECE
    ebce: float = DEFAULT_EBCE
    rank: str = DEFAULT_RANK  # ranked in descending order
    # Which metrics the thresholds (ECE, EBCE) read, and which the ranking (and the other reported metrics) reads:
    # "raw", as the paper does, or "recalibrated" (``recal/<metric>``, rewarduq_exp/recalibration). Runs without
    # recalibrated metrics (trained before it existed) have none there and never pass / rank last.
    filter_on: str = PAPER_SOURCE
    rank_on: str = PAPER_SOURCE

    def __post_init__(self):
        for name in THRESHOLDED:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise UserError(f"--{name} {value!r} is invalid: must be a finite number >= 0")
        _check_source("--filter-on", self.filter_on)
        _check_source("--rank-on", self.rank_on)

    @property
    def metrics(self) -> tuple[str, ...]:
        return REPORTED if self.rank in REPORTED else (*REPORTED, self.rank)

    def threshold(self, metric: str) -> float:
        return getattr(self, metric)

    def source(self, metric: str) -> str:
        """Raw or recalibrated: the thresholded metrics follow ``filter_on``, every other one ``rank_on``."""
        return self.filter_on if metric in THRESHOLDED else self.rank_on

    def key(self, metric: str) -> str:
        """The metrics.json key the rule reads for ``metric``."""
        return source_key(metric, self.source(metric))

    def describe_filter(self) -> str:
        if self.filter_on == PAPER_SOURCE:
            return "filtered on raw metrics, as the paper does"
        keys = ", ".join(self.key(m) for m in THRESHOLDED)
        return f"filtered on recalibrated metrics ({keys}; the paper filters on the raw ones)"

    def describe_rank(self) -> str:
        if self.rank_on == PAPER_SOURCE:
            return f"ranked by raw {self.rank}"
        return f"ranked by recalibrated {self.rank} ({self.key(self.rank)}; the paper ranks by the raw one)"

    def describe_sources(self) -> str:
        """In words, which metrics filter and which rank, and where that departs from the paper."""
        return f"{self.describe_filter()}; {self.describe_rank()}"

    def describe(self) -> str:
        return (f"{self.dataset}, ECE <= {self.ece:g}, EBCE <= {self.ebce:g}, best {self.rank}; "
                f"{self.describe_sources()}")


def add_selection_arguments(parser: argparse.ArgumentParser, dataset_option: str = "--dataset") -> None:
    """The rule's command-line options, shared by scripts/select_runs.py, table1.py and figures.py."""
    parser.add_argument(dataset_option, dest="select_dataset", default=DEFAULT_DATASET,
                        help=f"evaluation block of metrics.json the rule reads (default: {DEFAULT_DATASET})")
    parser.add_argument("--ece", type=float, default=DEFAULT_ECE,
                        help=f"keep mean ECE <= this (default: {DEFAULT_ECE})")
    parser.add_argument("--ebce", type=float, default=DEFAULT_EBCE,
                        help=f"keep mean EBCE <= this (default: {DEFAULT_EBCE})")
    parser.add_argument("--rank", default=DEFAULT_RANK,
                        help=f"metric to rank the kept configurations by, higher is better (default: {DEFAULT_RANK})")
    parser.add_argument("--filter-on", choices=SOURCES, default=None,
                        help="which ECE / EBCE the thresholds read: raw (the paper's rule, default) or recalibrated "
                             "(recal/<metric>, fitted on each run's calibration split)")
    parser.add_argument("--rank-on", choices=SOURCES, default=None,
                        help=f"which {DEFAULT_RANK} (--rank) the ranking reads: raw (default) or recalibrated")
    parser.add_argument("--recalibrated", action="store_true",
                        help="shorthand for --filter-on recalibrated --rank-on recalibrated")


def criteria_from_args(args: argparse.Namespace) -> Criteria:
    shorthand = "recalibrated" if getattr(args, "recalibrated", False) else None
    sources = {}
    for name in ("filter_on", "rank_on"):
        given = getattr(args, name, None)
        option = "--" + name.replace("_", "-")
        # --recalibrated with an explicit raw side is a contradiction, not a preference: say so instead of guessing.
        if shorthand and given not in (None, shorthand):
            raise UserError(f"--recalibrated (both recalibrated) contradicts {option} {given}: give "
                            "--filter-on and --rank-on instead")
        sources[name] = given or shorthand or PAPER_SOURCE
    return Criteria(dataset=args.select_dataset, ece=args.ece, ebce=args.ebce, rank=args.rank, **sources)


@dataclass
class Configuration:
    """One point of the grid: its seed runs and the mean / std over them of each reported metric."""

    method: str
    model: str
    dataset: str
    hyperparameters: dict
    runs: list[RunRecord]  # completed runs with the evaluation block, one per seed
    mean: dict[str, float]
    std: dict[str, float]
    criteria: Criteria
    rank: int | None = None  # 1 = winner; None when a threshold is missed
    # Mean over seeds of ECE and EBCE on both sources, by metrics.json key (ece, recal/ece, ...): ``mean`` holds only
    # what the rule reads, and the reports count passes on the other source too.
    threshold_means: dict[str, float] = field(default_factory=dict)

    @property
    def seeds(self) -> list:
        return [r.seed for r in self.runs]

    @property
    def n_seeds(self) -> int:
        return len(self.runs)

    def excess(self, metric: str, on: str | None = None) -> float:
        """How far the mean is above the threshold (negative: below it), on ``on`` (raw | recalibrated; default:
        what the rule filters on). NaN when the metric is missing."""
        key = source_key(metric, _check_source("on", on)) if on is not None else self.criteria.key(metric)
        return self.threshold_means.get(key, math.nan) - self.criteria.threshold(metric)

    def passes(self, metric: str, on: str | None = None) -> bool:
        # NaN never passes; the boundary (mean exactly at the threshold) does.
        return self.excess(metric, on) <= 0

    def passes_both(self, on: str | None = None) -> bool:
        return all(self.passes(m, on) for m in THRESHOLDED)

    def has(self, on: str) -> bool:
        """Whether the runs have both thresholded metrics on ``on`` (old runs have no recalibrated ones)."""
        return all(not math.isnan(self.threshold_means.get(source_key(m, on), math.nan)) for m in THRESHOLDED)

    @property
    def passes_all(self) -> bool:
        return self.passes_both()

    @property
    def miss(self) -> float:
        """Sum of the positive excesses over the thresholds: how far from passing (0 when it passes)."""
        total = 0.0
        for m in THRESHOLDED:
            e = self.excess(m)
            total += math.inf if math.isnan(e) else max(e, 0.0)
        return total

    @property
    def score(self) -> float:
        return self.mean.get(self.criteria.rank, math.nan)


@dataclass
class Selection:
    """The rule applied to the runs of one (method, backbone, training dataset)."""

    method: str
    model: str
    dataset: str
    criteria: Criteria
    records: list[RunRecord]  # every run of the group, whatever its state
    configurations: list[Configuration]  # passing ones by rank, then the others by how far they miss
    searched: list[str]  # hyperparameters that vary in the group: the grid's keys
    duplicates: list[RunRecord] = field(default_factory=list)  # same configuration and seed seen twice; ignored

    @property
    def passing(self) -> list[Configuration]:
        return [c for c in self.configurations if c.passes_all]

    @property
    def failing(self) -> list[Configuration]:
        return [c for c in self.configurations if not c.passes_all]

    @property
    def winner(self) -> Configuration | None:
        passing = self.passing
        return passing[0] if passing else None

    def closest(self, n: int = N_CLOSEST) -> list[Configuration]:
        return self.failing[:n]

    def best_effort(self) -> tuple[Configuration | None, bool]:
        """The winner, or, when nothing passes, the configuration with the best rank metric; and whether it passed.

        For figures that need one configuration per method and backbone even when the thresholds exclude all.
        """
        if self.winner is not None:
            return self.winner, True
        scored = [c for c in self.configurations if not math.isnan(c.score)]
        return (max(scored, key=lambda c: c.score), False) if scored else (None, False)

    def without_block(self) -> list[RunRecord]:
        """Completed runs that were not evaluated on the selection dataset."""
        return [r for r in self.records if r.state == "completed" and self.criteria.dataset not in r.metrics]

    def by_state(self, state: str) -> list[RunRecord]:
        return [r for r in self.records if r.state == state]

    def passing_counts(self, on: str) -> dict[str, tuple[int, int]]:
        """Per threshold ("ece", "ebce") and for both ("both"), on ``on`` (raw | recalibrated): how many
        configurations pass, and how many runs (seeds) those configurations hold; the rule decides on the mean
        over seeds, so a run counts with its configuration, not on its own metrics."""
        out = {}
        for test in (*THRESHOLDED, "both"):
            kept = [c for c in self.configurations
                    if (c.passes_both(on) if test == "both" else c.passes(test, on))]
            out[test] = (len(kept), sum(c.n_seeds for c in kept))
        return out

    def without(self, on: str) -> int:
        """How many configurations lack ECE or EBCE on ``on``: they cannot pass there."""
        return sum(not c.has(on) for c in self.configurations)

    @property
    def n_runs(self) -> int:
        return sum(c.n_seeds for c in self.configurations)

    @property
    def filters_nothing(self) -> bool:
        """Every one of several configurations passes: the thresholds decide nothing, the ranking alone picks."""
        return len(self.configurations) > 1 and len(self.passing) == len(self.configurations)


def check_criteria(records: list[RunRecord], criteria: Criteria) -> None:
    """Fail early, naming what exists, if no completed run has the dataset block or the rank metric."""
    completed = [r for r in records if r.state == "completed"]
    if not completed:
        return  # nothing to check against; the reports list the failed and missing runs
    blocks = [r.metrics[criteria.dataset] for r in completed if isinstance(r.metrics.get(criteria.dataset), dict)]
    if not blocks:
        found = sorted({name for r in completed for name in r.metrics})
        raise UserError(f"no completed run has metrics for dataset '{criteria.dataset}'; "
                        f"datasets found: {', '.join(found) or '(none)'}")
    if not any(criteria.key(criteria.rank) in b for b in blocks):
        if criteria.rank_on == "recalibrated":
            raise UserError(f"no run has recalibrated metrics ({criteria.key(criteria.rank)}) in "
                            f"'{criteria.dataset}': they were trained without recalibration; use --rank-on raw "
                            "(not --recalibrated) or retrain them")
        found = sorted({k for b in blocks for k in b if "/" not in k})
        raise UserError(f"no run has metric '{criteria.rank}' in '{criteria.dataset}'; "
                        f"metrics found: {', '.join(found)}")
    keys = [criteria.key(m) for m in THRESHOLDED]
    if criteria.filter_on == "recalibrated" and not any(all(k in b for k in keys) for b in blocks):
        raise UserError(f"no run has recalibrated metrics ({', '.join(keys)}) in '{criteria.dataset}': they were "
                        "trained without recalibration; use --filter-on raw (not --recalibrated) or retrain them")


def select(records: list[RunRecord], criteria: Criteria = Criteria()) -> list[Selection]:
    """Apply the rule to each (method, backbone, training dataset) in ``records``; sorted by those names."""
    check_criteria(records, criteria)
    groups: dict[tuple, list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.method, r.model, r.dataset), []).append(r)
    return [_select_group(key, groups[key], criteria) for key in sorted(groups)]


def _select_group(key: tuple, records: list[RunRecord], criteria: Criteria) -> Selection:
    by_config: dict[tuple, list[RunRecord]] = {}
    for r in records:
        if r.state == "completed" and isinstance(r.metrics.get(criteria.dataset), dict):
            by_config.setdefault(r.config_key(), []).append(r)

    configurations, duplicates = [], []
    for runs in by_config.values():
        kept, dropped = _one_per_seed(runs)
        duplicates += dropped
        configurations.append(_aggregate(kept, criteria))

    passing = sorted((c for c in configurations if c.passes_all), key=_rank_order)
    failing = sorted((c for c in configurations if not c.passes_all), key=lambda c: (c.miss, *_rank_order(c)))
    for i, c in enumerate(passing, start=1):
        c.rank = i
    # Runs with invalid settings (failed validation) are not grid points: their keys are no searched columns.
    valid = [r for r in records if r.state != "invalid"]
    return Selection(*key, criteria=criteria, records=records, configurations=passing + failing,
                     searched=searched_keys(valid), duplicates=duplicates)


def _rank_order(c: Configuration) -> tuple:
    # Best rank metric first (missing ones last); ties go to the better calibrated one, then a stable order.
    score = c.score
    return (math.isnan(score), -score if not math.isnan(score) else 0.0, c.mean.get("ece", math.inf),
            repr(sorted(c.hyperparameters.items())))


def _one_per_seed(runs: list[RunRecord]) -> tuple[list[RunRecord], list[RunRecord]]:
    # A sweep relaunched into a second folder can finish the same seed twice; counting both would weight that
    # seed double. Keep the most recently finished one.
    latest: dict = {}
    dropped = []
    for r in sorted(runs, key=lambda r: (r.finished_at, str(r.path))):
        if r.seed in latest:
            dropped.append(latest[r.seed])
        latest[r.seed] = r
    kept = sorted(latest.values(), key=lambda r: (r.seed is None, r.seed if r.seed is not None else 0))
    return kept, dropped


def _aggregate(runs: list[RunRecord], criteria: Criteria) -> Configuration:
    first = runs[0]
    table = pd.DataFrame([{m: r.metrics[criteria.dataset].get(criteria.key(m)) for m in criteria.metrics}
                          for r in runs])
    table = table.apply(pd.to_numeric, errors="coerce")
    # Sample std (ddof=1): undefined (NaN) for one seed, which the reports show as a plain mean.
    mean = {m: float(table[m].mean()) for m in criteria.metrics}
    std = {m: float(table[m].std(ddof=1)) for m in criteria.metrics}
    keys = [source_key(m, on) for m in THRESHOLDED for on in SOURCES]
    thresholded = pd.DataFrame([{k: r.metrics[criteria.dataset].get(k) for k in keys} for r in runs], columns=keys)
    thresholded = thresholded.apply(pd.to_numeric, errors="coerce")
    return Configuration(first.method, first.model, first.dataset, dict(first.hyperparameters), runs, mean, std,
                         criteria, threshold_means={k: float(thresholded[k].mean()) for k in keys})


def searched_keys(records: list[RunRecord]) -> list[str]:
    """The hyperparameters that take more than one value across ``records``: the keys the sweep searched.

    Every launched run counts, failed ones included, so a grid point that failed still marks its key as searched.
    When nothing varies (a single configuration), the ``method.<key>=`` overrides of the runs name the searched keys.
    """
    order: list[str] = []
    values: dict[str, set] = {}
    for r in records:
        for k, v in r.hyperparameters.items():
            if k not in values:
                order.append(k)
                values[k] = set()
            values[k].add(v)  # 0 and 0.0 count as one value, as they do for the method
    missing = object()
    for k in order:
        if any(k not in r.hyperparameters for r in records):
            values[k].add(missing)  # a key absent from some runs also differs between them
    varying = [k for k in order if len(values[k]) > 1]
    if varying:
        return varying
    overridden = {_override_key(o) for r in records for o in r.overrides}
    return [k for k in order if k in overridden]


def _override_key(override: str) -> str | None:
    key = override.split("=", 1)[0].lstrip("+~")
    if key.startswith("method.") and key.count(".") == 1:
        name = key.split(".", 1)[1]
        return name if name not in NOT_HYPERPARAMETERS else None
    return None
