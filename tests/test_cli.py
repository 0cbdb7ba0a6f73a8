"""The command line as a user runs it: train.py / evaluate.py in subprocesses, run folders, sweeps, bad input."""

import json
import os
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT
from entry_points import run_entry_point
from strict_files import assert_strict_json_files

from rewarduq_exp.methods.registry import method_names
from rewarduq_exp.metrics import METRIC_NAMES

SMALL = ["progress=false", "dataset.n_train=600", "dataset.n_eval=200", "dataset.n_ood=200"]
# Runs whose test does not look at the PNGs skip them (~0.4 s each, four per run);
# test_train_writes_complete_run_folder, test_diagrams and the wandb test check that they are written.
NO_FIGURES = ["metric.diagrams=false"]


def run(script, args, cwd, cache, check=True, env=None, flags=(), fresh_process=False):
    """``python <script> <flags> paths.output_root=... paths.cache_dir=... <args>`` in ``cwd`` (see entry_points)."""
    args = [*flags, f"paths.output_root={cwd / 'outputs'}", f"paths.cache_dir={cache}", *args]
    proc = run_entry_point(ROOT / script, args, cwd, env=env, fresh_process=fresh_process)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("outputs/runs/*/status.json"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_cache):
    """A default-config ENS-MLP run and a BAY-LIN run on a small synthetic world."""
    cwd = tmp_path_factory.mktemp("trained")
    out = {}
    for method, figures in (("ens_mlp", []), ("bay_lin", NO_FIGURES)):
        proc = run("train.py", [f"method={method}", *SMALL, *figures, f"hydra.run.dir={cwd}/outputs/runs/{method}"],
                   cwd, shared_cache)
        out[method] = (cwd / "outputs" / "runs" / method, proc)
    return out


@pytest.mark.parametrize("method", ["ens_mlp", "bay_lin"])
def test_train_writes_complete_run_folder(trained, method, shared_cache):
    folder, proc = trained[method]
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "completed" and len(status["config_hash"]) == 12
    assert (folder / ".hydra" / "config.yaml").exists() and (folder / ".hydra" / "overrides.yaml").exists()
    assert (folder / "train.log").exists()
    metrics = json.loads((folder / "metrics.json").read_text())
    assert list(metrics) == ["synthetic_eval", "synthetic_ood"]
    for block in metrics.values():
        assert set(METRIC_NAMES) <= set(block) and "truth/bayes_win_rate" in block
        assert abs(block["ct_rate"] + block["ut_rate"] + block["cf_rate"] + block["uf_rate"] - 1) < 1e-9
    preds = pd.read_parquet(folder / "predictions" / "synthetic_eval.parquet")
    assert list(preds.columns[:9]) == ["id", "subset", "weight", "chosen_reward", "chosen_lower", "chosen_upper",
                                       "rejected_reward", "rejected_lower", "rejected_upper"]
    assert len(preds) == 200 and (preds.chosen_lower <= preds.chosen_upper).all()
    for name in ("synthetic_eval", "synthetic_ood"):
        for png in ("calibration_pred.png", "calibration_bounds.png"):
            if method == "ens_mlp":  # the bay_lin run was made with metric.diagrams=false
                assert (folder / "figures" / name / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            else:
                assert not (folder / "figures").exists()
    assert sorted(p.name for p in (folder / "model").iterdir()) == ["method.json", "state.safetensors"]
    # the summary table is printed at the end, with the truth column beside the win rate
    assert "win_rate" in proc.stdout and "bayes_win" in proc.stdout and "synthetic_ood" in proc.stdout
    assert not list(folder.rglob("*.tmp"))
    assert_strict_json_files(folder)  # no bare NaN / Infinity in any JSON file of the run
    # Every result file and folder has the permissions the umask gives (colleagues on a cluster read run folders
    # and the shared cache); mkstemp's 0600 would hide them.
    umask = os.umask(0)
    os.umask(umask)
    tiny_model = [p for link in shared_cache.glob("models/*") for p in [link.resolve(), *link.resolve().rglob("*")]]
    for path in [*folder.rglob("*"), *shared_cache.rglob("*"), *tiny_model]:
        if path.is_symlink() or path.name.endswith(".lock"):
            continue
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert path.stat().st_mode & 0o777 == expected, (path, oct(path.stat().st_mode & 0o777))


def test_second_run_does_no_backbone_forward(trained):
    # ens_mlp ran first and extracted; bay_lin used the same backbone, probe and data
    status = json.loads((trained["bay_lin"][0] / "status.json").read_text())
    assert status["features"]["backbone_forward_passes"] == 0
    assert status["features"]["cache_misses"] == 0
    first = json.loads((trained["ens_mlp"][0] / "status.json").read_text())
    assert first["features"]["backbone_forward_passes"] > 0
    # the length filter's token counts are shared the same way (train, eval, ood and the calibration split): recorded
    # per conversation by the first run, so the second counts, renders and loads nothing (no tokenizer)
    assert first["token_count_cache"]["misses"] == 4 and first["conversations"]["rendered"] > 0
    assert status["token_count_cache"] == {"hits": 0, "misses": 0}
    assert status["conversations"] == {"rendered": 0, "recorded": 0}


def test_evaluate_run_folder_reproduces_training_metrics(trained, tmp_path, shared_cache):
    folder, _ = trained["ens_mlp"]
    before = json.loads((folder / "metrics.json").read_text())
    proc = run("evaluate.py", [f"run={folder}", "dataset=synthetic_ood", "progress=false"], tmp_path, shared_cache)
    after = json.loads((folder / "metrics.json").read_text())
    assert set(after) == set(before)  # merged, not replaced
    for key in METRIC_NAMES:  # features from the run's feature cache, the heads in the same batches: the same numbers
        assert after["synthetic_ood"][key] == pytest.approx(before["synthetic_ood"][key], abs=1e-9)
    assert "synthetic_ood" in proc.stdout


def test_evaluate_rescores_predictions_with_other_metric_config(trained, tmp_path, shared_cache):
    folder, _ = trained["bay_lin"]
    pred = folder / "predictions" / "synthetic_eval.parquet"
    run("evaluate.py", [f"predictions={pred}", "metric.n_bins=10", "hydra.run.dir=" + str(tmp_path / "ev")], tmp_path,
        shared_cache)
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())["synthetic_eval"]
    original = json.loads((folder / "metrics.json").read_text())["synthetic_eval"]
    assert metrics["win_rate"] == original["win_rate"]  # binning does not touch accuracy ...
    assert metrics["ece"] != original["ece"]  # ... but 10 bins give another ECE than 20
    assert (tmp_path / "ev" / "figures" / "synthetic_eval" / "calibration_pred.png").exists()


@pytest.mark.parametrize("method", ["ens_mlp", "bay_lin"])
def test_python_api_scores_as_evaluate_does(trained, method, tmp_path, shared_cache):
    from test_api import assert_api_scores_as_evaluate

    from rewarduq_exp.data.synthetic import SyntheticWorld

    folder, _ = trained[method]
    run("evaluate.py", [f"run={folder}", "dataset=synthetic_eval", "progress=false", *NO_FIGURES], tmp_path,
        shared_cache)
    assert_api_scores_as_evaluate(folder, "synthetic_eval", SyntheticWorld(n_train=600, n_eval=200).load("eval"))


@pytest.mark.e2e
def test_multirun_and_relaunch_skips_completed(tmp_path, shared_cache):
    args = ["method=ens_mlp,bay_lin", "method.beta=1.0,2.0", *SMALL, *NO_FIGURES]
    run("train.py", args, tmp_path, shared_cache, flags=["-m"])
    folders = sorted((tmp_path / "outputs" / "multirun" / "default").glob("*/status.json"))
    assert len(folders) == 4
    assert all(json.loads(f.read_text())["state"] == "completed" for f in folders)
    stamps = {f: f.stat().st_mtime_ns for f in folders}
    again = run("train.py", args, tmp_path, shared_cache, flags=["-m"])
    # skipped before running (not even a job): the summary says so, and nothing was rewritten
    assert "sweep: 4 jobs: 0 completed, 4 skipped" in again.stdout
    assert all(f.stat().st_mtime_ns == stamps[f] for f in folders)  # nothing was re-run or rewritten


@pytest.mark.e2e
def test_failed_run_in_sweep_is_recorded_and_others_complete(tmp_path, shared_cache):
    # reg_lambda=-1 passes the command line's kind check (a number) and fails the run's own validation (>= 0); a
    # bounded size such as num_heads=1 is refused before the sweep starts (tests/test_setting_bounds.py)
    args = ["method.reg_lambda=-1,0.1", *SMALL, *NO_FIGURES]
    proc = run("train.py", args, tmp_path, shared_cache, flags=["-m"], check=False)
    sweep = tmp_path / "outputs" / "multirun" / "default"
    failed_dir, ok_dir = (next(sweep.glob(f"*method.reg_lambda={k}[,-]*")) for k in ("-1", "0.1"))
    failed = json.loads((failed_dir / "status.json").read_text())
    assert failed["state"] == "failed" and "method.reg_lambda=-1 is invalid" in failed["error"]
    assert failed["stage"] == "validation"  # invalid settings, not a crash of training
    assert not (failed_dir / "metrics.json").exists()
    assert json.loads((ok_dir / "status.json").read_text())["state"] == "completed"
    # The sweep went on, then says what failed, where, and fails the command.
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "sweep: 2 jobs: 1 completed, 0 skipped (already completed with the same config), 1 failed" in proc.stdout
    assert f"failed: {failed_dir}" in proc.stdout and "method.reg_lambda=-1 is invalid" in proc.stdout
    # Launched again: the completed run is skipped without running, the invalid one fails again.
    again = run("train.py", args, tmp_path, shared_cache, flags=["-m"], check=False)
    assert again.returncode == 1 and "1 skipped" in again.stdout and "0 completed" in again.stdout


@pytest.mark.parametrize("method, expected", [
    ("ens_mlp", {"learning_rate": 0.001, "reg_lambda": 0.1, "center_gamma": 0.0}),
    ("bay_lin", {"learning_rate": 0.001, "reg_lambda": 0.001}),
])
def test_tuned_hyperparameters_applied(tmp_path, shared_cache, method, expected):
    import yaml

    proc = run("train.py", [f"method={method}", "model=qwen3-4b"], tmp_path, shared_cache, flags=["--cfg", "job"])
    cfg = yaml.safe_load(proc.stdout)
    for key, value in expected.items():
        assert cfg["method"][key] == pytest.approx(value), key
    assert cfg["model"]["hub_id"] == "Qwen/Qwen3-4B"
    # a command-line value wins over the tuned file
    proc = run("train.py", [f"method={method}", "model=qwen3-4b", "method.learning_rate=0.5"], tmp_path,
               shared_cache, flags=["--cfg", "job"])
    assert yaml.safe_load(proc.stdout)["method"]["learning_rate"] == 0.5


def test_every_backbone_has_tuned_configs_for_both_methods():
    # The paper's ten backbones (Table 1); tiny-qwen3 and smollm2-135m (offline models) run on the method defaults.
    models = {p.stem for p in (ROOT / "conf/model").glob("*.yaml")} - {"tiny-qwen3", "smollm2-135m"}
    assert len(models) == 10
    for method in ("ens_mlp", "bay_lin"):
        assert {p.stem for p in (ROOT / "conf/tuned" / method).glob("*.yaml")} == models


def test_local_file_training_with_named_eval_datasets(tmp_path, shared_cache):
    from rewarduq_exp.data.synthetic import SyntheticWorld

    world = SyntheticWorld(n_train=300, n_eval=100)
    for split, name in (("train", "pairs.jsonl"), ("eval", "held_out.jsonl")):
        frame = world.load(split)
        rows = [{"prompt": p[0]["content"], "chosen": c[0]["content"], "rejected": r[0]["content"], "source": "x"}
                for p, c, r in zip(frame.prompt, frame.chosen, frame.rejected)]
        pd.DataFrame(rows).to_json(tmp_path / name, orient="records", lines=True)
    folder = tmp_path / "outputs" / "runs" / "local"
    run("train.py", ["dataset=local", f"dataset.path={tmp_path / 'pairs.jsonl'}",
                     f"dataset.eval_path={tmp_path / 'held_out.jsonl'}", "eval_datasets=[local_eval]",
                     "progress=false", *NO_FIGURES, f"hydra.run.dir={folder}"], tmp_path, shared_cache)
    metrics = json.loads((folder / "metrics.json").read_text())
    assert list(metrics) == ["local_eval"]  # mixed with hub eval sets: tests/test_cli_datasets.py
    assert metrics["local_eval"]["n_pairs"] == 100
    assert "truth/bayes_win_rate" not in metrics["local_eval"]  # a user file has no ground truth
    assert (folder / "predictions" / "local_eval.parquet").exists()


BAD_INPUTS = [
    (["model=gpt-5"], "unknown model 'gpt-5'; allowed:"),
    (["method=ens_foo"], f"unknown method 'ens_foo'; allowed: {', '.join(method_names())}"),   # the table's
    (["dataset=nope"], "unknown dataset 'nope'; allowed:"),
    (["method.num_heads=1"], "method.num_heads=1 is invalid"),
    (["method.beta=0"], "method.beta=0 is invalid"),
    (["method=bay_lin", "method.beta=-0.5"], "method.beta=-0.5 is invalid"),
    (["metric.n_bins=0"], "metric.n_bins=0 is invalid"),
    (["max_length=5"], "empty after the length filter"),
    (["eval_datasets=[synthetic_test]"], "synthetic split 'test' does not exist"),
    # a key typo: one line naming the config it is not in and the allowed keys (Hydra's own report is 5 lines)
    (["method.num_head=3"], "method.num_head is not a setting of method 'ens_mlp'; allowed: num_heads, hidden_dim"),
    (["method=ens_mlp,bay_lin", "method.num_heads=3"], "method.num_heads is not a setting of method 'bay_lin'"),
    (["seeed=1"], "seeed is not a setting; allowed: model, method, dataset, probe, metric, logger, seed"),
    (["device=tpu"], "device='tpu' is not supported: use auto, cpu, cuda or cuda:N"),   # hardening round 4, item 11
]


@pytest.mark.parametrize("args, message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_one_line_nonzero_no_metrics(tmp_path, shared_cache, args, message):
    folder = tmp_path / "outputs" / "runs" / "bad"
    proc = run("train.py", [*args, *SMALL, f"hydra.run.dir={folder}"], tmp_path, shared_cache, check=False)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and message in lines[-1]
    assert sum(line.startswith("error:") for line in lines) == 1
    assert "Traceback" not in proc.stderr
    assert not (folder / "metrics.json").exists()
    if args == ["device=tpu"]:   # refused on the command line: no run folder at all (a failed one misleads a reader)
        assert not folder.exists()


def test_local_dataset_without_path(tmp_path, shared_cache):
    proc = run("train.py", ["dataset=local", "progress=false"], tmp_path, shared_cache, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("error: missing required setting(s): dataset.path; pass them on "
                                                    "the command line, e.g. dataset.path=<value>")
    # a single run refused before it started leaves no run folder (fourth hardening round, item 11: a failed folder
    # was the newest run a reader found); a sweep records it in the job's folder (test_failed_run_in_sweep_...)
    assert list((tmp_path / "outputs" / "runs").iterdir()) == []


def test_data_file_missing_a_column(tmp_path, shared_cache):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "hi", "chosen": "a"}\n{"prompt": "yo", "chosen": "b"}\n')
    folder = tmp_path / "outputs" / "runs" / "bad"
    proc = run("train.py", ["dataset=local", f"dataset.path={path}", "progress=false", f"hydra.run.dir={folder}"],
               tmp_path, shared_cache, check=False)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "missing column 'rejected'" in last and "found: prompt, chosen" in last
    assert not folder.exists()   # the data it names refused before anything was trained: no run folder left behind


@pytest.mark.e2e
def test_wandb_offline_logging(tmp_path, shared_cache):
    pytest.importorskip("wandb")
    folder = tmp_path / "outputs" / "runs" / "wb"
    run("train.py", ["logger=wandb", *SMALL, f"hydra.run.dir={folder}"], tmp_path, shared_cache,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    runs = list((folder / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb"))
    images = list(runs[0].rglob("files/media/images/**/*.png"))
    assert len(images) >= 4  # two diagrams per evaluated dataset
    assert (folder / "metrics.json").exists()


def test_wandb_run_is_finished_when_the_run_fails(tmp_path, shared_cache):
    pytest.importorskip("wandb")
    # in a sweep, whose failed job keeps its folder (a single run refused before training leaves none)
    sweep = tmp_path / "outputs" / "multirun" / "wbfail"
    proc = run("train.py", ["logger=wandb", "max_length=5", *SMALL, f"hydra.sweep.dir={sweep}"], tmp_path,
               shared_cache, check=False, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}, flags=["-m"])
    assert proc.returncode == 1
    log = next(sweep.glob("*/wandb/offline-run-*/logs/debug.log")).read_text()
    assert "finishing run" in log


@pytest.mark.e2e
def test_without_network_a_hub_model_fails_at_once(tmp_path, shared_cache):
    """No network: one probe of the endpoint switches the hub libraries offline, so there are no retries with
    back-off (a minute and ten warning lines before) and the error says why in one line."""
    env = {"HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9",
           "HF_HOME": str(tmp_path / "hf_home")}  # port 9 (discard) is closed: the connection is refused at once
    proc = run("train.py", ["model=qwen3-0.6b", *SMALL, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
               shared_cache, check=False, env=env)
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "Retrying" not in out and "does not answer" in out
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "no network: 127.0.0.1:9 does not answer" in line and "model.path" in line


@pytest.mark.parametrize("task", ["reward_model", "label_ranking"])
def test_one_run_lifecycle_constructs_the_method_once(tmp_path, shared_cache, monkeypatch, task):
    """Every task goes through the same lifecycle: the method is constructed once, after the config checks and with
    its backbone (a label-ranking learner is copied, unfitted, per fold), and the same logger receives the metrics
    and figures of every evaluated dataset."""
    from rewarduq_exp.methods.ens_mlp import EnsMLP
    from rewarduq_exp.methods.label_ranking import PlackettLuceNet
    from rewarduq_exp.runner import loggers

    cls = EnsMLP if task == "reward_model" else PlackettLuceNet
    built, logged = [], []
    original = cls.__init__
    monkeypatch.setattr(cls, "__init__", lambda self, *a, **k: (built.append(k.get("encoder")), original(self, *a,
                                                                                                          **k))[1])
    monkeypatch.setattr(loggers.NullLogger, "log_metrics", lambda self, name, metrics, figures: logged.append(
        (name, [Path(f).name for f in figures])))
    if task == "reward_model":
        args = [*SMALL, "eval_datasets=[synthetic_eval]"]
    else:
        data = tmp_path / "csv"
        data.mkdir()
        (data / "iris.csv").write_bytes((ROOT / "tests" / "fixtures" / "label_ranking" / "iris.csv").read_bytes())
        args = ["dataset=label_ranking/iris", "method=plackett_luce", "method.num_epochs=2",
                f"paths.label_ranking_dir={data}", "progress=false"]
    run("train.py", args, tmp_path, shared_cache)
    assert len(built) == 1
    assert (built[0] is not None) == (task == "reward_model")  # reward models get their backbone at construction
    (name, figures), = logged
    assert name == ("synthetic_eval" if task == "reward_model" else "iris") and figures
