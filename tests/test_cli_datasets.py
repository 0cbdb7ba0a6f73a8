"""Hub datasets from the command line: train on a fixture copy, evaluate on several named datasets, clear errors."""

import json

import pandas as pd
import pytest
from hub_fixtures import write_all
from test_cli import run

pytestmark = pytest.mark.e2e  # end to end: make test-e2e (.ci/run), not make test


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("hub"))


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory, shared_cache, hub_root):
    cwd = tmp_path_factory.mktemp("hub_run")
    folder = cwd / "outputs" / "runs" / "uf"
    proc = run("train.py", ["dataset=ultrafeedback", f"paths.datasets_dir={hub_root}", "progress=false",
                            "eval_datasets=[ultrafeedback_test,reward_bench,reward_bench2,hh_rlhf_test]",
                            f"hydra.run.dir={folder}"], cwd, shared_cache)
    return folder, proc


def test_one_metrics_block_and_predictions_file_per_eval_dataset(hub_run):
    folder, proc = hub_run
    metrics = json.loads((folder / "metrics.json").read_text())
    names = ["ultrafeedback_test", "reward_bench_filtered", "reward_bench2_test", "hh_rlhf_test"]
    assert list(metrics) == names
    for name in names:
        assert (folder / "predictions" / f"{name}.parquet").exists()
        assert (folder / "figures" / name / "calibration_pred.png").exists()
        assert name in proc.stdout  # the summary table lists every dataset
    assert metrics["ultrafeedback_test"]["n_pairs"] == 12
    assert metrics["hh_rlhf_test"]["n_pairs"] == 12


def test_reward_bench_block_is_scored_per_category(hub_run):
    folder, _ = hub_run
    rb = json.loads((folder / "metrics.json").read_text())["reward_bench_filtered"]
    cats = ["chat", "chat_hard", "safety", "reasoning"]
    assert all(f"{c}/win_rate" in rb for c in cats)
    assert rb["win_rate"] == pytest.approx(sum(rb[f"{c}/win_rate"] for c in cats) / 4)
    assert "subset/math-prm/win_rate" in rb
    predictions = pd.read_parquet(folder / "predictions" / "reward_bench_filtered.parquet")
    assert set(predictions.subset) >= {"math-prm", "hep-go"} and len(predictions) == 16


def test_reward_bench2_block_is_kwise(hub_run):
    folder, _ = hub_run
    rb2 = json.loads((folder / "metrics.json").read_text())["reward_bench2_test"]
    # 10 prompts of 1 correct + 3 incorrect, and the Ties pair: ref:0 (1 + 3) and tied:0 (3 correct + 2 incorrect)
    assert rb2["n_prompts"] == 12 and rb2["n_pairs"] == 10 * 3 + 3 + 3 * 2
    assert 0.0 <= rb2["best_of_k_accuracy"] <= 1.0
    # the official overall score: the mean over the six subsets, Ties with its own score
    subsets = ["Factuality", "Precise IF", "Math", "Safety", "Focus", "Ties"]
    assert rb2["rb2_score"] == pytest.approx(sum(rb2[f"subset/{s}/score"] for s in subsets) / 6)
    predictions = pd.read_parquet(folder / "predictions" / "reward_bench2_test.parquet")
    assert len(predictions) == 12 and sorted(len(r) for r in predictions.rewards) == [4] * 11 + [5]
    assert (predictions.best == 0).all() and sorted(predictions.num_correct) == [1] * 11 + [3]


def test_data_summary_lists_every_dataset(hub_run):
    folder, _ = hub_run
    summary = json.loads((folder / "data_summary.json").read_text())
    assert [s["dataset"] for s in summary] == ["ultrafeedback_train", "ultrafeedback_test", "reward_bench_filtered",
                                                "reward_bench2_test", "hh_rlhf_test", "ultrafeedback_cal"]
    assert all(s["before"] >= s["after"] > 0 and "50" in s["length_percentiles"] for s in summary)


def test_reference_weighting_rescores_the_same_predictions(hub_run, tmp_path, shared_cache):
    folder, _ = hub_run
    file = folder / "predictions" / "reward_bench_filtered.parquet"
    official = json.loads((folder / "metrics.json").read_text())["reward_bench_filtered"]
    out = tmp_path / "outputs" / "evaluate" / "ref"
    run("evaluate.py", [f"predictions={file}", "metric.reward_bench_weighting=reference", "progress=false",
                        f"hydra.run.dir={out}"], tmp_path, shared_cache)
    ref = json.loads((out / "metrics.json").read_text())["reward_bench_filtered"]
    assert ref["chat/win_rate"] == pytest.approx(official["chat/win_rate"])  # equal counts in the fixture's Chat
    assert ref["n_pairs"] == official["n_pairs"]


def test_local_file_with_hub_eval_datasets(tmp_path, shared_cache, hub_root):
    rows = [{"prompt": f"Question {i}?", "chosen": f"A good answer number {i}.", "rejected": "No."}
            for i in range(40)]
    path = tmp_path / "pairs.jsonl"
    pd.DataFrame(rows).to_json(path, orient="records", lines=True)
    folder = tmp_path / "outputs" / "runs" / "local"
    run("train.py", ["dataset=local", f"dataset.path={path}", f"paths.datasets_dir={hub_root}", "progress=false",
                     "eval_datasets=[reward_bench,ultrafeedback_test]", f"hydra.run.dir={folder}"], tmp_path,
        shared_cache)
    metrics = json.loads((folder / "metrics.json").read_text())
    assert list(metrics) == ["reward_bench_filtered", "ultrafeedback_test"]
    assert "safety/ece" in metrics["reward_bench_filtered"]


def one_error_line(proc) -> str:
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    return lines[0]


def test_unreachable_hub_fails_with_one_clear_line(tmp_path, shared_cache):
    folder = tmp_path / "outputs" / "runs" / "offline"
    proc = run("train.py", ["dataset=ultrafeedback", "progress=false", f"hydra.run.dir={folder}"], tmp_path,
               shared_cache, check=False, env={"HF_HUB_OFFLINE": "1", "REWARDUQ_DATASETS_DIR": ""})
    line = one_error_line(proc)
    assert "could not fetch trl-lib/ultrafeedback_binarized" in line and "dataset.path=DIR" in line
    assert not (folder / "metrics.json").exists()


@pytest.mark.parametrize("args, message", [
    (["dataset=reward_bench"], "evaluation set without a train split"),
    (["dataset=helpsteer2"], "dataset=helpsteer2 is pointwise data (rated responses); allowed methods here: borp"),
    (["metric.reward_bench_weighting=equal"], "reward_bench_weighting"),
    (["dataset=ultrafeedback", "dataset.num_samples=-1"], "dataset.num_samples=-1 is invalid"),
])
def test_dataset_choices_that_cannot_work_fail_early(tmp_path, shared_cache, args, message):
    proc = run("train.py", [*args, "progress=false", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, shared_cache,
               check=False, env={"HF_HUB_OFFLINE": "1"})
    assert message in one_error_line(proc)


def test_evaluate_run_on_another_hub_dataset_reproduces_its_block(hub_run, hub_root, tmp_path,
                                                                  shared_cache):
    folder, _ = hub_run
    before = json.loads((folder / "metrics.json").read_text())
    run("evaluate.py", [f"run={folder}", "dataset=reward_bench2", f"paths.datasets_dir={hub_root}", "progress=false",
                        f"hydra.run.dir={tmp_path / 'ev'}"], tmp_path, shared_cache)
    after = json.loads((folder / "metrics.json").read_text())
    assert list(after) == list(before)  # merged into the existing block, nothing lost
    assert after["reward_bench2_test"] == pytest.approx(before["reward_bench2_test"])  # features from the cache
    proc = run("evaluate.py", [f"run={folder}", "dataset=helpsteer2", f"paths.datasets_dir={hub_root}",
                               f"hydra.run.dir={tmp_path / 'ev2'}"], tmp_path, shared_cache, check=False)
    assert "is pointwise" in one_error_line(proc)


def write_empty_data_file(path):
    """An empty .jsonl / .csv, a header-only .csv (``header_only.csv``) or a .parquet file with the schema, no rows."""
    if path.suffix == ".parquet":
        pd.DataFrame({c: pd.Series([], dtype=str) for c in ("prompt", "chosen", "rejected")}).to_parquet(path)
    else:
        path.write_text("prompt,chosen,rejected\n" if path.name == "header_only.csv" else "")
    return path


@pytest.mark.parametrize("dataset, name, problem", [
    ("local", "empty.jsonl", "file has no rows (the file is empty)"),
    ("ultrafeedback", "empty.csv", "has no rows (the file is empty)"),
    ("local", "header_only.csv", "file has no rows (only a header line)"),
    ("ultrafeedback", "empty.parquet", "has no rows"),
])
def test_empty_data_file_fails_with_one_line(tmp_path, shared_cache, dataset, name, problem):
    """dataset=local dataset.path=<file> and a hub dataset's dataset.data_files=<file>: one line naming the file."""
    path = write_empty_data_file(tmp_path / name)
    key = "dataset.path" if dataset == "local" else "dataset.data_files"
    folder = tmp_path / "outputs" / "runs" / "empty"
    proc = run("train.py", [f"dataset={dataset}", f"{key}={path}", "progress=false", f"hydra.run.dir={folder}"],
               tmp_path, shared_cache, check=False)
    line = one_error_line(proc)
    assert str(path) in line and line.endswith(problem), line
    assert not (folder / "metrics.json").exists()


def write_hh_jsonl_gz(path, n):
    """n pairs in the exact Anthropic/hh-rlhf schema, gzipped like the hub's files."""
    import gzip

    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i in range(n):
            shared = f"\n\nHuman: Question {i}?"
            f.write(json.dumps({"chosen": f"{shared}\n\nAssistant: A careful answer {i}.",
                                "rejected": f"{shared}\n\nAssistant: No."}) + "\n")
    return path


def test_evaluate_applies_dataset_options(hub_run, hub_root, tmp_path, shared_cache):
    """evaluate.py dataset=hh_rlhf_test dataset.<key>=...: the options reach the evaluated dataset's loader."""
    import shutil

    folder = shutil.copytree(hub_run[0], tmp_path / "run")  # the shared run's hh_rlhf_test block stays as it is
    run("evaluate.py", [f"run={folder}", "dataset=hh_rlhf_test", f"dataset.path={hub_root}/Anthropic/hh-rlhf",
                        "dataset.subsets=[harmless-base]", "dataset.eval_num_samples=2", "progress=false",
                        f"hydra.run.dir={tmp_path / 'ev'}"], tmp_path, shared_cache)
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["hh_rlhf_test"]["n_pairs"] == 2  # 3 harmless-base test pairs in the fixture, 2 drawn
    predictions = pd.read_parquet(folder / "predictions" / "hh_rlhf_test.parquet")
    assert (predictions.subset == "harmless-base").all() and len(predictions) == 2
    assert metrics["ultrafeedback_test"] == json.loads((hub_run[0] / "metrics.json").read_text())["ultrafeedback_test"]

    data = write_hh_jsonl_gz(tmp_path / "my_hh.jsonl.gz", 5)
    run("evaluate.py", [f"run={folder}", "dataset=hh_rlhf_test", f"dataset.data_files={data}", "progress=false",
                        f"hydra.run.dir={tmp_path / 'ev2'}"], tmp_path, shared_cache)
    assert json.loads((folder / "metrics.json").read_text())["hh_rlhf_test"]["n_pairs"] == 5


def test_evaluate_unknown_dataset_option_fails_with_one_line(hub_run, hub_root, tmp_path, shared_cache):
    folder = tmp_path / "outputs" / "evaluate" / "bad"
    proc = run("evaluate.py", [f"run={hub_run[0]}", "dataset=hh_rlhf_test", "dataset.subset=[harmless-base]",
                               f"paths.datasets_dir={hub_root}", f"hydra.run.dir={folder}"], tmp_path, shared_cache,
               check=False)
    line = one_error_line(proc)
    assert line.startswith("error: dataset.subset is not a setting of dataset 'hh_rlhf'; allowed: ")
    assert "dataset.subsets" in line and "dataset.eval_num_samples" in line and "dataset.data_files" in line
    assert not (folder / "metrics.json").exists()
