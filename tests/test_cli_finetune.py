"""The two fine-tuning methods from the command line on the defaults (tiny model, synthetic world), made small:
complete run folders, and evaluate.py reproduces the training metrics from what save() wrote."""

import json

import pytest
from strict_files import assert_strict_json_files
from test_api import assert_api_scores_as_evaluate
from test_cli import run

from rewarduq_exp.data.synthetic import SyntheticWorld

pytestmark = pytest.mark.e2e  # end to end: make test-e2e (.ci/run), not make test

SMALL = ["progress=false", "dataset.n_train=160", "dataset.n_eval=60", "dataset.n_ood=60"]
FAST = {"ens_lora": ["method.num_members=3", "method.lora_rank=4"], "mcd_dpo": ["method.num_samples=5"]}


@pytest.mark.parametrize("method", ["ens_lora", "mcd_dpo"])
def test_fine_tuning_method_end_to_end(tmp_path, shared_cache, method):
    folder = tmp_path / "outputs" / "runs" / method
    proc = run("train.py", [f"method={method}", *SMALL, *FAST[method], f"hydra.run.dir={folder}"], tmp_path,
               shared_cache)
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "completed" and "features" not in status  # no feature cache for these methods
    metrics = json.loads((folder / "metrics.json").read_text())
    assert list(metrics) == ["synthetic_eval", "synthetic_ood"]
    assert all(m["bound_width"] > 0 for m in metrics.values())  # real spread from members / MC masks
    for name in metrics:
        assert (folder / "figures" / name / "calibration_bounds.png").exists()
    assert (folder / "model" / "method.json").exists()
    assert "backbone forward passes" not in proc.stdout
    again = run("evaluate.py", [f"run={folder}", "dataset=synthetic_eval", "progress=false",
                                f"hydra.run.dir={tmp_path / 'ev'}"], tmp_path, shared_cache)
    after = json.loads((folder / "metrics.json").read_text())
    # the same model scores the same pairs in the same batches (score_batch_size) on the same device: the same
    # kernels, the same scores (MC-dropout masks seeded); 1e-6 only for the metrics' own float sums
    assert after["synthetic_eval"] == pytest.approx(metrics["synthetic_eval"], abs=1e-6), again.stdout
    # the Python API rebuilds the same model: the scores evaluate.py just wrote, from plain strings
    assert_strict_json_files(folder)  # train_history.json, metrics.json (merged by evaluate.py), method.json, ...
    assert_api_scores_as_evaluate(folder, "synthetic_eval", SyntheticWorld(n_train=160, n_eval=60).load("eval"))
