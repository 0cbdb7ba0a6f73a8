"""The paper's grid as a real multirun: every point a run, failed runs recorded, relaunch without re-running what
completed; the same grid through submitit's local launcher (slow; the default run launches a two-task submitit job in
tests/test_sweep_multitask.py), and the Slurm sbatch script that submitit itself generates from
conf/hydra/launcher/slurm.yaml."""

import json
import os
import stat

import pytest
from entry_points import run_entry_point
from hub_fixtures import write_ultrafeedback
from test_cli import run

# 3 points of the ENS-MLP grid; reg_lambda=-1 is invalid, so 1 of the 3 runs fails on purpose.
# A command-line value of a grid key replaces that axis (with -m, which comma lists need on the command line).
REDUCED_GRID = ["method.learning_rate=1e-3", "method.reg_lambda=0.0,0.1,-1.0", "method.center_gamma=0.0"]


def grid_args(cwd) -> list[str]:
    hub = write_ultrafeedback(cwd / "hub").parents[1]
    return ["sweep=ens_mlp", f"paths.datasets_dir={hub}", "progress=false", "method.num_heads=4",
            "metric.diagrams=false", *REDUCED_GRID]


def sweep_status(folder) -> dict:
    return {p.parent: json.loads(p.read_text()) for p in folder.glob("*/status.json")}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, shared_cache):
    """The grid on the default launcher for local multiruns (in this process, as `python train.py -m` runs it), then
    launched again."""
    cwd = tmp_path_factory.mktemp("sweep")
    args = grid_args(cwd)
    first = run("train.py", args, cwd, shared_cache, flags=["-m"], check=False)
    folder = cwd / "outputs" / "multirun" / "ens_mlp"
    stamps = {p: p.stat().st_mtime_ns for p in folder.glob("*/status.json")}
    second = run("train.py", args, cwd, shared_cache, flags=["-m"], check=False)
    return {"cwd": cwd, "folder": folder, "status": sweep_status(folder), "stamps": stamps, "first": first,
            "second": second}


def assert_grid_outcome(status: dict, proc) -> None:
    assert len(status) == 3
    states = sorted(s["state"] for s in status.values())
    assert states == ["completed"] * 2 + ["failed"]
    # the sweep went on past the failure, then says so and fails the command
    assert proc.returncode == 1
    assert "sweep: 3 jobs: 2 completed, 0 skipped (already completed with the same config), 1 failed" in proc.stdout
    for path, st in status.items():
        if st["state"] == "completed":
            metrics = json.loads((path / "metrics.json").read_text())
            assert list(metrics) == ["ultrafeedback_test"]  # the sweep evaluates on the validation split only
        else:
            assert "method.reg_lambda=-1.0 is invalid" in st["error"]
            assert not (path / "metrics.json").exists()


@pytest.mark.e2e
def test_grid_runs_every_point_and_records_the_failed_one(sweep):
    assert_grid_outcome(sweep["status"], sweep["first"])


@pytest.mark.e2e
def test_relaunch_reruns_only_what_did_not_complete(sweep):
    log = sweep["second"].stdout + sweep["second"].stderr
    assert log.count("completed, same config") == 2
    completed = [p for p, st in sweep["status"].items() if st["state"] == "completed"]
    for path in completed:  # not re-run, not rewritten
        assert (path / "status.json").stat().st_mtime_ns == sweep["stamps"][path / "status.json"]
    assert "sweep: 3 jobs: 0 completed, 2 skipped (already completed with the same config), 1 failed" in log
    assert sweep["second"].returncode == 1


@pytest.mark.slow
def test_grid_as_separate_submitit_jobs(tmp_path, shared_cache):
    """The same grid through submitit's local launcher: one fresh process per point (5-7 s each of imports on 2
    cores), hence slow. The default run covers the parts: the launcher's skip-and-summarise code with the in-process
    launcher (above), and a submitit job for real in tests/test_sweep_multitask.py."""
    proc = run("train.py", [*grid_args(tmp_path), "hydra/launcher=local"], tmp_path, shared_cache, flags=["-m"],
               check=False)
    folder = tmp_path / "outputs" / "multirun" / "ens_mlp"
    assert len(list(folder.glob(".submitit/*/*_log.out"))) == 3  # really launched through submitit, one job each
    assert_grid_outcome(sweep_status(folder), proc)


@pytest.mark.e2e
def test_sweep_turns_tuned_values_off_and_uses_the_grid(sweep):
    import yaml

    for path in sweep["status"]:
        cfg = yaml.safe_load((path / ".hydra" / "config.yaml").read_text())
        assert cfg["dataset"]["name"] == "ultrafeedback" and cfg["method"]["learning_rate"] == 0.001
        assert cfg["also_evaluate"] == []


def sbatch_dry_run(tmp_path, cache, args, flags=("-m",)) -> str:
    """The sbatch script submitit writes for ``train.py args``: a fake sbatch records it, then refuses it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "sbatch_script.sh"
    for name, body in {"sbatch": f'cat "$1" > {record}\necho "sbatch: error: dry run" >&2\nexit 1\n',
                       "srun": "exit 0\n"}.items():
        tool = bin_dir / name
        tool.write_text("#!/bin/sh\n" + body)
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    proc = run("train.py", args, tmp_path, cache, check=False, flags=list(flags),
               env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode != 0 and record.exists(), proc.stderr[-2000:]
    return record.read_text()


@pytest.mark.e2e
def test_slurm_script_from_submitit(tmp_path, shared_cache):
    args = ["sweep=bay_lin", "model=qwen3-0.6b", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
            "hydra.launcher.account=my_lab", "hydra.launcher.timeout_min=240",
            "method.learning_rate=1e-3", "method.reg_lambda=1e-3,1e-2"]
    script = sbatch_dry_run(tmp_path, shared_cache, args)
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=my_lab", "#SBATCH --gpus-per-node=1",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --mem=64GB", "#SBATCH --time=240", "#SBATCH --requeue",
                 "#SBATCH --array=0-1%2", "#SBATCH --signal=USR2@120", "export HF_HUB_OFFLINE="):
        assert line in script, f"{line!r} not in the sbatch script:\n{script}"
    assert "srun" in script and "submitit.core._submit" in script


@pytest.mark.e2e
def test_launcher_settings_shown_without_launching(tmp_path, shared_cache):
    proc = run("train.py", ["sweep=ens_mlp", "model=qwen3-0.6b", "hydra/launcher=slurm", "--cfg", "hydra", "-p",
                            "hydra.launcher"], tmp_path, shared_cache)
    assert "SkipCompletedSlurmLauncher" in proc.stdout and "array_parallelism: 16" in proc.stdout
    assert not (tmp_path / "outputs" / "multirun").exists()


@pytest.mark.e2e
def test_selection_on_the_real_sweep_lists_failures_and_its_tuned_file_is_picked_up(sweep, tmp_path,
                                                                                   shared_cache):
    from conftest import ROOT

    extra = tmp_path / "conf_extra"
    proc = run_entry_point(ROOT / "scripts/select_runs.py", [sweep["folder"], "--out", tmp_path / "selection",
                                                        "--tuned-dir", extra / "tuned",
                                                        "--ece", "1", "--ebce", "1"],  # any run may win: uncalibrated
                           tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "selection" / "selection.md").read_text()
    assert "method.reg_lambda=-1.0 is invalid" in report
    tuned = extra / "tuned" / "ens_mlp" / "tiny-qwen3.yaml"
    assert tuned.read_text().startswith("# @package _global_")
    import yaml

    chosen = yaml.safe_load(tuned.read_text())["method"]
    # exactly the axes that varied among valid runs
    assert set(chosen) == {"reg_lambda"}
    shown = run("train.py", ["method=ens_mlp", "model=tiny-qwen3"], tmp_path, shared_cache,
                flags=["--config-dir", str(extra), "--cfg", "job"])
    method = yaml.safe_load(shown.stdout)["method"]
    assert method["reg_lambda"] == chosen["reg_lambda"]


def test_run_folder_name_hashes_the_resolved_config():
    from omegaconf import OmegaConf

    from rewarduq_exp.runner.cli import run_name
    from rewarduq_exp.runs.run_folder import config_hash

    def root(**changes):
        base = {"hydra": {"job": {"num": 3}}, "seed": 0, "method": {"learning_rate": 1e-3}, "force": False,
                "paths": {"output_root": "a"}}
        for key, value in changes.items():
            OmegaConf.update(cfg := OmegaConf.create(base), key, value)
            return cfg
        return OmegaConf.create(base)

    name = run_name("seed=0", _root_=root())
    identity = config_hash(OmegaConf.masked_copy(root(), ["seed", "method", "force", "paths"]))
    assert name.startswith("seed=0-") and name.endswith(identity[:10])
    assert run_name("seed=0", _root_=root(**{"method.learning_rate": 1e-4})) != name  # a changed default: new folder
    assert run_name("seed=0", _root_=root(**{"paths.output_root": "b"})) == name     # where outputs go: same run
    assert run_name("seed=0", _root_=root(**{"force": True})) == name
    assert run_name("seed=0", _root_=root(**{"hydra.job.num": 7})) == name


@pytest.mark.e2e
def test_table1_and_figures_on_the_real_sweep(sweep, tmp_path):
    from conftest import ROOT

    for script, out in (("table1.py", "table1.md"), ("figures.py", "figure3_calibration.png")):
        proc = run_entry_point(ROOT / "scripts" / script, [sweep["folder"], "--out", tmp_path], tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / out).stat().st_size > 0
    assert "tiny-qwen3" in (tmp_path / "table1.md").read_text()
    assert (tmp_path / "figure2_rs.png").exists() and (tmp_path / "figure5_metrics.pdf").exists()


def test_tuned_paper_config_adds_reward_bench_to_the_default_evaluation():
    from omegaconf import OmegaConf

    from rewarduq_exp.data.registry import CONF_DIR, load_dataset_config, resolve_eval_sets

    tuned = OmegaConf.load(CONF_DIR / "tuned" / "ens_mlp" / "qwen3-0.6b.yaml")
    train_cfg = load_dataset_config("ultrafeedback", seed=0)
    names = [es.name for es in resolve_eval_sets(None, train_cfg, 0, also=tuned.also_evaluate)]
    assert names == ["ultrafeedback_test", "reward_bench_filtered"]
    explicit = [es.name for es in resolve_eval_sets(["ultrafeedback_test"], train_cfg, 0, also=tuned.also_evaluate)]
    assert explicit == ["ultrafeedback_test"]  # an explicit list replaces the default one


def test_an_also_evaluate_entry_can_size_its_dataset_and_the_plan_counts_it():
    from omegaconf import OmegaConf

    from rewarduq_exp.core.errors import UserError
    from rewarduq_exp.data.registry import load_dataset_config, resolve_eval_sets
    from rewarduq_exp.runner.plan import dataset_sizes

    train_cfg = load_dataset_config("synthetic_ratings", seed=0)
    also = OmegaConf.create([{"name": "synthetic_eval", "n_eval": 200}, {"name": "reward_bench",
                                                                          "eval_num_samples": 500}])
    sets = resolve_eval_sets(None, train_cfg, 0, also=also)
    assert [es.name for es in sets][-2:] == ["synthetic_eval", "reward_bench_filtered"]
    assert sets[-2].config.n_eval == 200 and sets[-1].config.eval_num_samples == 500
    assert load_dataset_config("synthetic", seed=0).n_eval == 1000   # the option did not leak into the dataset's file
    cfg = OmegaConf.create({"dataset": {"name": "synthetic_ratings", "n_train": 400, "n_eval": 100, "n_ood": 50},
                            "also_evaluate": also})
    assert dataset_sizes(cfg) == (400, 100 + 50 + 200 + 500)
    with pytest.raises(UserError, match="n_evl is not a setting of dataset 'synthetic'"):
        resolve_eval_sets(None, train_cfg, 0, also=[{"name": "synthetic_eval", "n_evl": 200}])
    with pytest.raises(UserError, match="needs its dataset as name"):
        resolve_eval_sets(None, train_cfg, 0, also=[{"n_eval": 200}])
