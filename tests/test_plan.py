"""The planner (``train.py ... plan=true``) and the Slurm launcher's refusal of jobs that cannot fit: parameter counts
of the shipped backbone shapes against the published sizes, the printed plan, and the one-line refusals (exit 2)
before anything is submitted. The planned peaks against measured ones: tests/test_plan_memory.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from entry_points import run_entry_point
from omegaconf import OmegaConf

from rewarduq_exp.core.errors import UserError
from rewarduq_exp.models.shapes import architecture

ROOT = Path(__file__).resolve().parents[1]

# Published sizes (the model cards): total parameters and non-embedding parameters, in billions. SmolLM2-135M's card
# gives the total only; its non-embedding count is the checkpoint's (30 layers of 3.54M, the GGUF file converted).
PUBLISHED = {"qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6), "qwen3-8b": (8.2, 6.95),
             "qwen3-14b": (14.8, 13.2), "qwen3-32b": (32.8, 31.2), "smollm2-135m": (0.135, 0.1062)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_of_the_shipped_shapes_match_the_published_sizes(name):
    a = architecture(OmegaConf.create({"name": name}))
    total, non_embedding = PUBLISHED[name]
    untied_head = 0 if a.tied else a.params_embedding
    assert a.params_causal_lm / 1e9 == pytest.approx(total, rel=0.02)
    assert (a.params_causal_lm - a.params_embedding - untied_head) / 1e9 == pytest.approx(non_embedding, rel=0.02)


@pytest.mark.parametrize("size", ["0.6b", "1.7b", "4b", "8b"])
def test_skywork_shapes_are_qwen3_sequence_classifiers_with_the_base_body(size):
    sky = architecture(OmegaConf.create({"name": f"skywork-qwen3-{size}"}))
    base = architecture(OmegaConf.create({"name": f"qwen3-{size}"}))
    assert sky.classifier and not base.classifier
    assert sky.params_body == base.params_body


def test_unknown_model_is_one_line():
    with pytest.raises(UserError, match=r"no architecture known for model 'nope': add conf/model/shapes/nope.json"):
        architecture(OmegaConf.create({"name": "nope"}))


def test_plan_prints_every_part_without_a_run_folder(tmp_path):
    proc = run_entry_point(ROOT / "train.py", ["method=mcd_dpo", "model=qwen3-0.6b", "dataset=ultrafeedback",
                                               "plan=true", f"paths.output_root={tmp_path}/out"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # at 80 GB, pairs of 2 x 2048 tokens: 4 pairs a micro-batch (16k tokens) fit without checkpointing
    for phrase in ("596,049,920 total", "AdamW states", "reference weights", "activation checkpointing off",
                   "micro-batch of 4 pairs (auto)",
                   "FLOPs training", "62135 train pairs", "expected peak per device", "395.6 TFLOPS"):
        assert phrase in proc.stdout, proc.stdout
    assert not (tmp_path / "out").exists()


def test_plan_of_a_sweep_names_its_largest_point(tmp_path):
    proc = run_entry_point(ROOT / "train.py", ["method=ens_lora", "model=qwen3-0.6b", "dataset=ultrafeedback",
                                               "method.micro_batch_size=1,2", "plan=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sweep: 2 points planned" in proc.stdout and "method.micro_batch_size=2" in proc.stdout.splitlines()[-1]


def test_feature_cache_size_on_disk_and_bay_lin_hessian(tmp_path):
    from rewarduq_exp.runner.plan import compose_points, make_plan

    cfg = compose_points(["method=bay_lin", "model=qwen3-4b", "dataset=ultrafeedback", "plan.n_eval=0"])[0][1]
    plan = make_plan(cfg)
    assert plan.disk["feature cache (one layer)"] == 2 * 62_135 * 2560 * 2   # N texts x hidden x bf16
    training = next(p for p in plan.phases if p.name == "training")
    assert training.parts["BAY-LIN Hessian d x d (float64: H, H + lambda I, Cholesky)"] == 3 * 2560**2 * 8


def fake_sbatch(tmp_path: Path) -> dict:
    """A PATH with an sbatch that records that it was called and refuses (no sinfo beside it: no cluster check), and
    an srun that submitit only looks for (a machine without Slurm has none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {"sbatch": f"touch {tmp_path / 'submitted'}\necho 'sbatch: error: dry run' >&2\nexit 1",
               "srun": "echo 'srun: not expected in this test' >&2\nexit 1"}
    for name, body in scripts.items():
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\n{body}\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_slurm_launcher_refuses_a_sweep_that_does_not_fit_the_gpu_in_one_line(tmp_path):
    # a full fine-tune of 8B: 16 bytes a parameter of weights, gradients and AdamW states before any activation
    args = ["-m", "method=mcd_dpo", "model=qwen3-8b", "dataset=ultrafeedback", "method.learning_rate=1e-4,1e-3",
            "hydra/launcher=slurm", f"paths.output_root={tmp_path}/out"]
    proc = run_entry_point(ROOT / "train.py", args, tmp_path, env=fake_sbatch(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: job "), proc.stderr
    assert "more than the 79.6 GiB of the profile's GPU" in lines[0] and "plan.force=true" in lines[0]
    assert not (tmp_path / "submitted").exists()


def test_slurm_launcher_refuses_a_sweep_longer_than_its_time_limit_and_force_submits(tmp_path):
    args = ["-m", "method=ens_mlp", "model=qwen3-0.6b", "dataset=ultrafeedback", "method.learning_rate=1e-3,1e-2",
            "hydra/launcher=slurm", "hydra.launcher.timeout_min=1", "hydra.launcher.max_num_timeout=1",
            "plan.tflops=0.01", f"paths.output_root={tmp_path}/out"]
    env = fake_sbatch(tmp_path)
    proc = run_entry_point(ROOT / "train.py", args, tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "more than hydra.launcher.timeout_min=1 x 2 runs" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "submitted").exists()
    forced = run_entry_point(ROOT / "train.py", [*args, "plan.force=true"], tmp_path, env=env)
    assert (tmp_path / "submitted").exists(), forced.stderr[-2000:]   # sbatch was called (and refused the dry run)


def test_memory_check_reads_gpu_mem_gb_or_a_known_gpu():
    from hydra_plugins.rewarduq_launchers.slurm_checks import check_plans, gpu_memory_gib
    from rewarduq_exp.runner.plan import Phase, Plan

    plan = Plan("ens_lora", "m", "cuda", "bfloat16", 1, 1, [Phase("training", {"x": 30 * 2**30})], {"t": 1.0}, 1.0,
                1, 1, 8)
    assert gpu_memory_gib({"gpu": "A100-40GB"}) == 39.4 and gpu_memory_gib({"gpu_mem_gb": 24, "gpu": "h100"}) == 24
    check_plans([(["a=1"], plan)], {"gpu": "h100", "gpus_per_node": 1})
    with pytest.raises(UserError, match=r"^job a=1 plans a peak of 30.00 GiB per device .* more than the 24 GiB"):
        check_plans([(["a=1"], plan)], {"gpu_mem_gb": 24, "gpus_per_node": 1})
    with pytest.raises(UserError, match=r"hydra.launcher.gpu=tpu is not a GPU this launcher knows"):
        check_plans([(["a=1"], plan)], {"gpu": "tpu", "gpus_per_node": 1})


# ---------------------------------------------------------------------------------------------- sweep parsing
def sweep_config(params: dict):
    """A composed config's ``hydra.sweeper.params``, as a ``conf/sweep/*.yaml`` sets it."""
    return OmegaConf.create({"hydra": {"sweeper": {"params": params}}})


SWEEPS = [   # (value, the values Hydra's basic sweeper runs): the same in hydra.sweeper.params and on the command line
    ("range(0,3)", ["0", "1", "2"]),
    ("choice(a,b)", ["a", "b"]),
    ("a,b,c", ["a", "b", "c"]),
    ("1e-3, 1e-2", ["0.001", "0.01"]),
    ("'x,y'", ["'x,y'"]),                         # quoted: one value holding a comma
    ("choice('x,y',z)", ["x\\,y", "z"]),          # as Hydra passes it on: the comma escaped
]


@pytest.mark.parametrize("value, expected", SWEEPS, ids=[v for v, _ in SWEEPS])
@pytest.mark.parametrize("where", ["sweep config", "command line"])
def test_sweep_values_are_parsed_as_hydra_parses_them(value, expected, where):
    """``hydra.sweeper.params`` values were split on commas: ``range(0,3)``, ``choice(...)`` and quoted commas
    broke. Both sources now go through Hydra's override parser, as its sweeper does."""
    from rewarduq_exp.runner.plan import sweep_points

    if where == "sweep config":
        points = sweep_points(sweep_config({"seed": value}), [])
    else:
        points = sweep_points(sweep_config({}), [f"seed={value}"])
    assert points == [[f"seed={v}"] for v in expected]


def test_command_line_replaces_a_sweep_configs_key_and_the_grid_is_the_product():
    from rewarduq_exp.runner.plan import sweep_points

    cfg = sweep_config({"seed": "range(0,2)", "method.learning_rate": "1e-3,1e-2"})
    assert sweep_points(cfg, ["method.learning_rate=0.5", "method.beta=choice(1,2)"]) == [
        [f"seed={s}", "method.learning_rate=0.5", f"method.beta={b}"] for s in (0, 1) for b in (1, 2)]


def test_a_shipped_sweep_config_with_range_choice_and_glob_on_the_command_line():
    """``sweep=bay_lin`` (a 3 x 3 grid in its params) with its learning rate fixed on the command line, x
    ``seed=range(0,2)``; ``method=glob(...)`` lists the group's options through Hydra's config loader. Each point
    composes to the values it names."""
    from rewarduq_exp.runner.plan import compose_points

    points = compose_points(["sweep=bay_lin", "model=qwen3-0.6b", "method.learning_rate=0.5", "seed=range(0,2)"])
    assert {(c.method.learning_rate, c.method.reg_lambda, c.seed) for _, c in points} == {
        (0.5, lam, s) for lam in (1e-3, 1e-2, 1e-1) for s in (0, 1)} and len(points) == 6
    globbed = compose_points(["method=glob([ens_m*,bay_*])", "model=qwen3-0.6b"])
    assert sorted(p[0] for p, _ in globbed) == ["method=bay_lin", "method=ens_mlp"]


def test_plan_of_a_range_sweep_through_train_py(tmp_path):
    proc = run_entry_point(ROOT / "train.py", ["-m", "method=ens_mlp", "model=qwen3-0.6b", "dataset=ultrafeedback",
                                               "seed=range(0,3)", "method.beta=choice(1.0,2.0)", "plan=true",
                                               f"paths.output_root={tmp_path}/out"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sweep: 6 points planned" in proc.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arg, message", [
    ("seed=interval(0,1)", "error: seed=interval(0,1) is invalid: interval(...) is sampled by optimising sweepers"),
    ("method=glob(zzz*)", "error: method=glob(zzz*) matches no method; allowed: bay_lin, "),
    ("seed=glob(*)", "error: seed=glob(*) is invalid: glob(...) picks among the options of a config group"),
    ("seed=range(3,3)", "error: seed=range(3,3) gives no value to run"),
])
def test_a_sweep_that_gives_no_grid_is_one_line(tmp_path, arg, message):
    proc = run_entry_point(ROOT / "train.py", ["-m", "model=qwen3-0.6b", arg, "plan=true",
                                               f"paths.output_root={tmp_path}/out"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert not (tmp_path / "out").exists()
