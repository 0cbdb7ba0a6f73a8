"""Settings that size an allocation are bounded before anything is allocated (issue 42, item 1), and integer settings
take integers only: one ``error:`` line naming the setting, the value, the limit and why, exit status 2, and no
results written. ``evaluate.py metric.n_bins=1000000000`` grew to 18.7 GB before the kernel killed it;
``max_length=99999999999999999999999`` ran with exit 0; ``probe.layer=-1.5`` ran as -1.

The table itself (rewarduq_exp/core/setting_bounds.py) is checked directly: every shipped config, tuned config, sweep
grid and the paper's sizes pass it, and every integer setting of the shipped configs is in it."""

from __future__ import annotations

import shutil

import pytest
from conftest import ROOT
from entry_points import run_entry_point
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from rewarduq_exp.core.checks import check_like_default, check_n_bins, is_seed
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.core.setting_bounds import BOUNDS, MAX_BINS, REAL_VALUED, check_bound, check_config_bounds
from rewarduq_exp.data.registry import available
from rewarduq_exp.methods.registry import method_bounds, method_class, method_names
from rewarduq_exp.runner.cli import register_resolvers
from rewarduq_exp.runner.validation import check_max_length

CONF = ROOT / "conf"
TINY_RUN = ["progress=false", "metric.diagrams=false", "dataset.n_train=60", "dataset.n_eval=24", "dataset.n_ood=24"]


# ------------------------------------------------------------------------------------------------ the table itself
def _compose(config: str, overrides: list[str]) -> DictConfig:
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config, overrides=overrides)


def _bounds_of(method: str) -> dict:
    """The bounds method ``method``'s settings declare (``method.<key>`` -> Bound)."""
    return method_class(method).settings_class.bounds()


def _method_of_file(path, cfg) -> str | None:
    """The method a shipped config file sets values of: its own (conf/method/<name>.yaml), the tuned values' folder
    (conf/tuned/<name>/), the method a sweep overrides (``- override /method: <name>``), else None."""
    parts = path.relative_to(CONF).parts
    if parts[0] == "method":
        return path.stem
    if parts[0] == "tuned" and len(parts) > 2:
        return parts[1]
    for entry in cfg.get("defaults", []) or []:
        if OmegaConf.is_dict(entry) and "override /method" in entry:
            return entry["override /method"]
    return None


def _shipped_configs():
    """(file, its settings under the key they have in a composed config, the bounds of the method it sets values of)
    of every shipped config file."""
    for path in sorted(CONF.rglob("*.yaml")):
        group = path.relative_to(CONF).parts[0]
        if group == "hydra":
            continue
        cfg = OmegaConf.load(path)
        packaged_global = group in ("tuned", "sweep") or path.parent == CONF   # '# @package _global_' or a root file
        method = _method_of_file(path, cfg)
        yield (path, cfg if packaged_global else OmegaConf.create({group: cfg}),
               _bounds_of(method) if method in method_names() else {})


def test_every_shipped_config_and_the_papers_sizes_pass():
    """Every shipped config file (models, methods, datasets, probes, metrics, tasks, tuned configs, sweeps: their
    values as a composed config holds them), and the paper's largest runs composed: Qwen3-32B at max_length 8192
    with K = 64 heads, ENS-LoRA with 20 members, MCD-DPO with 64 masks (the paper's K: 20, 8, 20)."""
    for path, cfg, bounds in _shipped_configs():
        try:
            check_config_bounds(cfg, extra=bounds)
        except UserError as err:
            raise AssertionError(f"{path.relative_to(ROOT)}: {err}") from None
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for overrides in (["model=qwen3-32b", "method=ens_mlp", "max_length=8192", "method.num_heads=64"],
                          ["model=qwen3-4b", "method=ens_lora", "max_length=4096", "method.num_members=20"],
                          ["model=qwen3-4b", "method=mcd_dpo", "max_length=8192", "method.num_samples=64"]):
            cfg = compose("train", overrides=overrides)
            check_config_bounds(cfg, extra=method_bounds(cfg.method))
            assert check_max_length(int(cfg.max_length), cfg.model, None) == cfg.max_length   # window: 40,960


def test_every_sweep_grid_value_passes():
    """The grids of conf/sweep (hydra.sweeper.params) as the sweep's jobs get them, value by value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for sweep in available("sweep", CONF):
        cfg = OmegaConf.load(CONF / "sweep" / f"{sweep}.yaml")
        bounds = _bounds_of(_method_of_file(CONF / "sweep" / f"{sweep}.yaml", cfg))
        for key, grid in cfg.hydra.sweeper.params.items():
            override = parser.parse_override(f"{key}={grid}")
            for value in override.sweep_iterator() if override.is_sweep_override() else [override.value()]:
                check_bound(key, value, bound=bounds.get(key))


def _integer_settings(node: dict, prefix: str = ""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _integer_settings(value, f"{path}.")
        elif isinstance(value, list):
            if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                yield path
        elif isinstance(value, int) and not isinstance(value, bool):
            yield path


def test_every_integer_setting_of_the_shipped_configs_is_in_the_table():
    """A new integer setting must be placed: bounded (it sizes something or just takes integers) or real-valued. A
    method's settings are placed on its settings dataclass (``setting(bound=...)``, or typed float), read through
    the method table: adding a method edits no table here."""
    unplaced = set()
    for path in sorted(CONF.rglob("*.yaml")):
        group = path.relative_to(CONF).parts[0]
        if group in ("hydra", "tuned", "sweep"):
            continue
        prefix = "" if path.parent == CONF else f"{group}."
        placed, real = set(BOUNDS), set(REAL_VALUED)
        if group == "method":
            settings = method_class(path.stem).settings_class
            placed |= set(settings.bounds())
            real |= settings.real_valued()
        for key in _integer_settings(OmegaConf.to_container(OmegaConf.load(path), resolve=False), prefix):
            if key not in placed and key not in real and not is_seed(key):
                unplaced.add(f"{key} ({path.relative_to(ROOT)})")
    assert not unplaced, sorted(unplaced)


def test_the_synthetic_worlds_own_limits_are_the_tables():
    from rewarduq_exp.data.synthetic import TOPIC_WORDS, WORDS

    assert BOUNDS["dataset.vocab_size"].maximum == len(WORDS)
    assert BOUNDS["dataset.num_topics"].maximum == len(TOPIC_WORDS)


@pytest.mark.parametrize("key, value, message", [
    ("metric.n_bins", 1_000_000_000, "metric.n_bins=1000000000 is too large: at most 10000 bins (each bin needs "
                                     "pairs; with 1000 eval pairs more than 1000 bins are empty)"),
    ("metric.n_bins", 0, "metric.n_bins=0 is invalid: must be an integer >= 1"),
    ("max_length", 10**23, f"max_length={10**23} is too large: at most 1048576 tokens"),
    ("dataset.n_train", 1, "dataset.n_train=1 is invalid: must be an integer >= 2 (a method cannot learn a "
                           "preference from a single example)"),
    ("probe.layer", -1.5, "probe.layer=-1.5 is invalid: must be an integer"),
    ("dataset.n_train", 2000.0, "dataset.n_train=2000.0 is invalid: must be null or an integer; write it without a "
                                "decimal point or exponent: dataset.n_train=2000"),
    ("method.num_heads", 5000, "method.num_heads=5000 is too large: at most 1024 heads"),
    ("method.num_samples", 10**6, "method.num_samples=1000000 is too large: at most 10000 dropout masks"),
    ("probe.batch_size", 2.5, "probe.batch_size=2.5 is invalid: must be auto or an integer"),
    ("method.score_batch_tokens", 10**9, "method.score_batch_tokens=1000000000 is too large: at most 1048576 tokens"),
    ("method.hidden", [100, 10**7], "method.hidden holds 10000000, which is too large: at most 65536 units"),
    ("method.hidden", [100, 1.5], "method.hidden holds 1.5, which is invalid: must be an integer"),
    ("task.draws", 10**8, "task.draws=100000000 is too large: at most 100000 draws"),
    ("task.n_max", True, "task.n_max=true is invalid: must be an integer"),
])
def test_refused_values(key, value, message):
    bound = _method_bound(key)
    with pytest.raises(UserError) as err:
        check_bound(key, value, bound=bound)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("key, value", [("probe.batch_size", "auto"), ("max_length", None), ("max_length", 40960),
                                        ("metric.n_bins", MAX_BINS), ("probe.layer", -1), ("seed", 2.5),
                                        ("method.learning_rate", 10**9), ("task.batch_size", None),
                                        ("probe.intermediate_layer", "none"), ("max_length", "${oc.env:L}")])
def test_accepted_values(key, value):
    """Values of the right kind within the bounds, settings the table does not hold (a seed has its own check, a
    learning rate none here), and interpolations (judged once resolved)."""
    assert check_bound(key, value, bound=_method_bound(key)) == value


def _method_bound(key: str):
    """The bound of ``method.<key>`` as the first method that has the setting declares it (None: no method bounds
    it, or not a method setting)."""
    for name in method_names():
        if key in _bounds_of(name):
            return _bounds_of(name)[key]
    return None


def test_integer_defaults_refuse_fractions_but_real_valued_settings_take_them():
    """The command line's kind check: an integer default makes an integer setting, except those that take any
    number (minutes, epochs)."""
    with pytest.raises(UserError, match=r"^method\.log_every=2\.5 is invalid: must be an integer \(its default is "
                                        r"10\)$"):
        check_like_default("method.log_every", 2.5, 10, bound=_method_bound("method.log_every"), real_valued=False)
    with pytest.raises(UserError, match=r"^dataset\.folds=5\.0 is invalid: must be an integer \(its default is 5\); "
                                        r"write it without a decimal point or exponent: dataset\.folds=5$"):
        check_like_default("dataset.folds", 5.0, 5)
    assert check_like_default("checkpoint.every_minutes", 0.5, 30) == 0.5
    ens_mlp = method_class("ens_mlp").settings_class
    assert "method.num_epochs" in ens_mlp.real_valued() and "method.num_heads" not in ens_mlp.real_valued()
    assert check_like_default("method.num_epochs", 0.5, 1, real_valued=True) == 0.5
    assert check_like_default("method.beta", 3, 2.0) == 3          # an integer where a float is the default


def test_the_task_candidates_product_is_bounded():
    cfg = OmegaConf.create({"task": {"prompts": 4096, "n_max": 4096}})
    with pytest.raises(UserError, match=r"^task\.prompts=4096 x task\.n_max=4096 = 16777216 candidates per split is "
                                        r"too many: at most 4194304"):
        check_config_bounds(cfg, prefixes=("task.",))


def test_metric_functions_refuse_too_many_bins_before_allocating():
    """The Python API's metric functions share the bound: 1e9 bins is refused, not a 18.7 GB allocation."""
    import numpy as np

    from rewarduq_exp.metrics.calibration import calibration_metrics

    with pytest.raises(UserError, match=r"n_bins must be an integer in \[1, 10000\], got 1000000000"):
        check_n_bins(10**9)
    p = np.array([0.6, 0.4])
    with pytest.raises(UserError, match="n_bins must be an integer in"):
        calibration_metrics(p, p - 0.1, p + 0.1, np.ones(2), n_bins=10**9)


# ------------------------------------------------------------------------------------------------ as a user runs it
def _last_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, proc.stdout[-2000:]
    return lines[-1]


CLI_REFUSED = [
    ("train.py", ["metric.n_bins=1000000000"], "metric.n_bins=1000000000 is too large: at most 10000 bins"),
    ("train.py", ["max_length=99999999999999999999999"], "max_length=99999999999999999999999 is too large: at most "
                                                        "1048576 tokens"),
    ("train.py", ["probe.layer=-1.5"], "probe.layer=-1.5 is invalid: must be an integer (its default is -1)"),
    ("train.py", ["dataset.n_train=1"], "dataset.n_train=1 is invalid: must be an integer >= 2"),
    ("train.py", ["dataset.n_train=2000.0"], "dataset.n_train=2000.0 is invalid: must be an integer (its default is "
                                             "8000); write it without a decimal point or exponent"),
    ("train.py", ["method=ens_lora", "method.num_members=1000"], "method.num_members=1000 is too large: at most 256"),
    ("train.py", ["method=mcd_dpo", "method.score_batch_tokens=1e12"], "method.score_batch_tokens=1e12 is invalid: "
                                                                      "must be auto or an integer"),
    ("train.py", ["-m", "metric.n_bins=10,1000000000"], "metric.n_bins=1000000000 is too large"),
    ("evaluate.py", ["predictions=p.parquet", "metric.n_bins=1000000000"], "metric.n_bins=1000000000 is too large"),
    ("evaluate.py", ["predictions=p.parquet", "max_length=99999999999999999999999"], "max_length="
                                                                                   "99999999999999999999999 is too "
                                                                                   "large: at most 1048576 tokens"),
    ("downstream.py", ["run=r", "task.n_max=1000000000"], "task.n_max=1000000000 is too large: at most 1048576"),
    ("downstream.py", ["run=r", "task.draws=2.5"], "task.draws=2.5 is invalid: must be an integer"),
    ("downstream.py", ["run=r", "task=active_learning", "task.repeats=100000"], "task.repeats=100000 is too large"),
]


@pytest.mark.parametrize("script, args, message", CLI_REFUSED, ids=[f"{s} {' '.join(a)}" for s, a, _ in CLI_REFUSED])
def test_refused_before_hydra_starts(tmp_path, script, args, message):
    """The value alone is enough to refuse: before Hydra makes a folder, before any import of a model."""
    proc = run_entry_point(ROOT / script, [*args, f"paths.output_root={tmp_path / 'outputs'}"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_downstream_candidates_product_refused_before_reading_runs(tmp_path):
    """Each of prompts and n_max is within its bound; their product is not. Refused before the runs are read (the
    run named here does not even exist)."""
    out = tmp_path / "outputs" / "ds"
    proc = run_entry_point(ROOT / "downstream.py", ["run=/nonexistent", "task.prompts=50000", "task.n_max=1024",
                                                    f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _last_line(proc).startswith("error: task.prompts=50000 x task.n_max=1024 = 51200000 candidates per split "
                                       "is too many: at most 4194304")
    from rewarduq_exp.downstream.tasks import OUTPUTS

    assert not [name for name in OUTPUTS["best_of_n"] if (out / name).exists()]   # no task output


TRAIN_REFUSED = [
    (["max_length=5000"], "max_length=5000 is too large for model 'tiny-qwen3': at most 4096 tokens, its context "
                          "window (max_position_embeddings)"),
    (["probe.layer=3"], "probe.layer=3 is out of range for model 'tiny-qwen3' (1 layer): allowed -1 (the last, after "
                        "the final norm) or 0..1"),
    (["method.num_heads=1000", "method.hidden_dim=8192", "plan.device_memory_gib=4"],
     "method.num_heads=1000 x method.hidden_dim=8192 x method.num_hidden_layers=2 is too large: the ENS-MLP heads on "
     "256-dim features need"),
]


@pytest.mark.parametrize("args, message", TRAIN_REFUSED, ids=[" ".join(a) for a, _ in TRAIN_REFUSED])
def test_train_refuses_what_the_backbone_or_device_bounds(tmp_path, shared_cache, args, message):
    """Limits that depend on the model (its context window, its depth, from its config: nothing is downloaded or
    loaded) or on the device's memory as the planner takes it: refused before the run uses its folder, in one line,
    and no folder is left behind (a single run; a sweep records the refusal in the job's folder)."""
    folder = tmp_path / "outputs" / "runs" / "r"
    proc = run_entry_point(ROOT / "train.py", [*args, *TINY_RUN, f"paths.cache_dir={shared_cache}",
                                               f"hydra.run.dir={folder}"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _last_line(proc).startswith(f"error: {message}"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not folder.exists()


# ------------------------------------------------------------------------------------------------ evaluate.py
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, shared_cache):
    """One tiny ENS-MLP run (60 training pairs), trained once for this module's evaluations."""
    cwd = tmp_path_factory.mktemp("bounds")
    folder = cwd / "outputs" / "runs" / "r"
    proc = run_entry_point(ROOT / "train.py", [*TINY_RUN, f"paths.cache_dir={shared_cache}",
                                               f"hydra.run.dir={folder}"], cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folder


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


EVALUATE_REFUSED = [
    (["metric.n_bins=1000000000"], "metric.n_bins=1000000000 is too large: at most 10000 bins (each bin needs pairs; "
                                   "with 1000 eval pairs more than 1000 bins are empty)"),
    (["max_length=99999999999999999999999"], "max_length=99999999999999999999999 is too large: at most 1048576 "
                                             "tokens"),
    (["max_length=5000"], "max_length=5000 is too large for model 'tiny-qwen3': at most 4096 tokens"),
    (["metric.n_bins=2.5"], "metric.n_bins=2.5 is invalid: must be an integer (its default is 20)"),
    (["dataset.n_eval=10000000"], "dataset.n_eval=10000000 is too large: at most 1000000 examples"),
    (["metric.ranking.n_bins=100000"], "metric.ranking.n_bins=100000 is too large: at most 10000 bins"),
]


@pytest.mark.parametrize("args, message", EVALUATE_REFUSED, ids=[" ".join(a) for a, _ in EVALUATE_REFUSED])
def test_evaluate_refuses_before_touching_the_run(tmp_path, trained_run, shared_cache, args, message):
    before = _snapshot(trained_run)
    proc = run_entry_point(ROOT / "evaluate.py", [f"run={trained_run}", *args, f"paths.cache_dir={shared_cache}",
                                                  f"paths.output_root={tmp_path / 'outputs'}"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _last_line(proc).startswith(f"error: {message}"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert _snapshot(trained_run) == before   # no metrics merged, no predictions, no diagrams


def test_evaluate_warns_when_bins_outnumber_the_pairs(tmp_path, trained_run, shared_cache):
    """24 eval pairs in 100 bins: evaluated (exit 0), with one warning line saying so."""
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    proc = run_entry_point(ROOT / "evaluate.py", [f"run={copy}", "dataset=synthetic_eval", "metric.n_bins=100",
                                                  "metric.diagrams=false", f"paths.cache_dir={shared_cache}",
                                                  f"paths.output_root={tmp_path / 'outputs'}"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if "[WARNING]" in line]
    assert any(line.endswith("dataset 'synthetic_eval' has 24 pairs, fewer than the metric.n_bins=100 calibration "
                             "bins: at least 76 bins are empty and ECE/MCE rest on a few pairs each")
               for line in warnings), proc.stdout


def test_a_setting_that_takes_a_word_or_a_number_takes_the_word_whatever_its_default():
    """``prior_precision`` is ``marglik`` or a number: with a numeric default (a config of one's own) the command line
    still takes the word (the setting's own check judges it), and the method table says which settings these are."""
    assert check_like_default("method.prior_precision", "marglik", 1.0, takes_text=True) == "marglik"
    with pytest.raises(UserError, match="must be a number"):
        check_like_default("method.prior_precision", "marglik", 1.0)
    sngp = method_class("sngp").settings_class
    assert "method.prior_precision" in sngp.takes_text() and "method.num_random_features" not in sngp.takes_text()
    assert "method.micro_batch_size" not in method_class("ens_lora").settings_class.takes_text()   # words in its bound
