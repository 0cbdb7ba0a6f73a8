"""BoRP through the runner, as a user runs it: train.py method=borp probe=borp_contrastive on rated responses (the
synthetic world's 1-5 ratings, tiny model, offline), scored on the rated eval splits against the two baselines of the
same run and on a preference eval set with RewardUQ's metrics; evaluate.py and the Python API rebuild it."""

import json

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT
from entry_points import run_entry_point
from strict_files import assert_strict_json_files
from tolerances import OTHER_BATCHES

pytestmark = pytest.mark.e2e  # end to end: make test-e2e (.ci/run), not make test

# A 4-layer tiny Qwen3, so the intermediate layer (3/8 of the depth) differs from the final one.
ARGS = ["method=borp", "probe=borp_contrastive", "dataset=synthetic_ratings", "model.build.num_layers=4",
        "dataset.n_train=400", "dataset.n_eval=200", "dataset.n_ood=100", "dataset.n_cal=100",
        "also_evaluate=[{name:synthetic_eval,n_eval:200}]"]  # a preference eval set, sized like the run's own


def run(script, args, cwd, cache, check=True, flags=()):
    # Hydra's flags (--config-dir) go first: argparse takes the overrides as one run of positional arguments.
    args = [*flags, f"paths.output_root={cwd / 'outputs'}", f"paths.cache_dir={cache}", "progress=false", *args]
    proc = run_entry_point(ROOT / script, args, cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def borp_run(tmp_path_factory, shared_cache):
    cwd = tmp_path_factory.mktemp("borp")
    proc = run("train.py", [*ARGS, f"hydra.run.dir={cwd}/run"], cwd, shared_cache)
    return cwd, cwd / "run", proc


def test_probe_beats_the_baselines_and_its_uncertainty_tracks_the_error(borp_run):
    _, folder, proc = borp_run
    assert "alpha_judge" in proc.stdout  # the summary table shows the three side by side
    blocks = json.loads((folder / "metrics.json").read_text())
    ev = blocks["synthetic_ratings_eval"]
    # chance level is alpha = 0, pearson = 0; the judge reads digits from a random-init LM (chance)
    assert ev["probe/alpha_interval"] > 0.5 and ev["probe/pearson"] > 0.5
    assert ev["probe/alpha_interval"] > ev["probe/baseline/score_judge/alpha_interval"] + 0.3
    assert ev["probe/pearson"] > ev["probe/baseline/score_judge/pearson"] + 0.3
    assert ev["probe/alpha_interval"] > ev["probe/baseline/mean_pool_ridge/alpha_interval"]
    ood = blocks["synthetic_ratings_ood"]
    assert ood["probe/alpha_interval"] > ood["probe/baseline/mean_pool_ridge/alpha_interval"]
    # ahead of every baseline by more than the margin (alpha 0.12 vs -0.27 at best on ood): no line says otherwise
    assert ev["probe/matched_by_baseline"] is False and ood["probe/matched_by_baseline"] is False
    assert not any(ev[f"probe/baseline/{b}/matches_probe"] for b in ("score_judge", "mean_pool_ridge", "length_ridge"))
    assert "matches or beats the probe" not in proc.stdout + proc.stderr
    # eq. 3's layer gap grows with the error, weakly: 0.11 on eval, 0.08 on ood since the resampling thins the
    # low distances and the searches are grouped by prompt (0.1+ on both before)
    assert ev["probe/u_abs_error_spearman"] > 0.05 and ood["probe/u_abs_error_spearman"] > 0.05
    predictions = pd.read_parquet(folder / "predictions" / "synthetic_ratings_eval.parquet")
    assert np.allclose(predictions["upper"] - predictions["prediction"], predictions["u"])  # beta = 1
    assert predictions["prediction"].between(1, 5).all()
    assert (folder / "figures" / "synthetic_ratings_eval" / "probe.png").exists()
    # the component and alpha searches were grouped by prompt: the world's 8 topic prompts
    assert json.loads((folder / "status.json").read_text())["fit"]["cv_groups"] == 8
    # every JSON file of the run (metrics, status, data summary, method.json) parses with a strict parser
    assert_strict_json_files(folder)
    assert ev["probe/baseline/score_judge/constant"] is False and ev["probe/baseline/mean_pool_ridge/constant"] is False
    assert ev["probe/judge_constant"] is False


def test_length_baselines_are_reported_beside_the_probe(borp_run):
    """The length ridge (characters, words, tokens; raw and log) fitted like the mean-pooled ridge, and what the probe
    knows beyond length: its partial correlation with the ratings given length, recomputed here by lstsq from the
    predictions file; the saved ridge reproduces the run's length-ridge predictions."""
    from rewarduq_exp.methods.borp import RidgeBaseline
    from rewarduq_exp.metrics.probe import LENGTH_COLUMNS, length_covariates

    _, folder, proc = borp_run
    assert "alpha_len" in proc.stdout
    blocks = json.loads((folder / "metrics.json").read_text())
    ridge = RidgeBaseline.load(folder / "model" / "length_ridge.npz")
    assert ridge.inputs == "length features"
    for name in ("synthetic_ratings_eval", "synthetic_ratings_ood"):
        block = blocks[name]
        for key in ("alpha_interval", "alpha_ordinal", "pearson", "spearman", "rmse", "mae", "n"):
            assert f"probe/baseline/length_ridge/{key}" in block
        predictions = pd.read_parquet(folder / "predictions" / f"{name}.parquet")
        lengths = predictions[list(LENGTH_COLUMNS)].to_numpy()
        assert (lengths > 0).all() and (predictions["n_chars"] >= predictions["n_words"]).all()
        design = np.c_[np.ones(len(lengths)), length_covariates(lengths)]
        res = [v - design @ np.linalg.lstsq(design, v, rcond=None)[0]
               for v in (predictions["prediction"].to_numpy(), predictions["score"].to_numpy())]
        assert block["probe/partial_pearson_given_length"] == pytest.approx(np.corrcoef(*res)[0, 1], abs=1e-9)
        assert block["probe/pearson_with_log_length"] == pytest.approx(
            np.corrcoef(predictions["prediction"], np.log1p(predictions["n_chars"]))[0, 1], abs=1e-9)
        np.testing.assert_allclose(ridge.predict(length_covariates(lengths)),
                                   predictions["prediction_length_ridge"], atol=1e-9)
    # "the longer completion wins" beside the probe's win rate on the preference pairs
    assert 0 <= blocks["synthetic_eval"]["baseline/longer_wins/win_rate"] <= 1


def test_probe_scores_preferences_with_rewarduq_metrics(borp_run):
    _, folder, _ = borp_run
    pairs = json.loads((folder / "metrics.json").read_text())["synthetic_eval"]
    assert pairs["win_rate"] > 0.6 and pairs["bound_width"] > 0
    assert {"ct_rate", "cf_rate", "rs_0.2", "ece", "ebce"} <= set(pairs)
    # the entry's own n_eval sized the default world's eval split (1000 pairs without it)
    assert len(pd.read_parquet(folder / "predictions" / "synthetic_eval.parquet")) == 200


def test_evaluate_and_the_python_api_rebuild_the_probe(borp_run, shared_cache):
    cwd, folder, _ = borp_run
    import rewarduq_exp as r

    model = r.load_run(folder, cache_dir=shared_cache, progress=False)
    frame = pd.read_parquet(folder / "predictions" / "synthetic_eval.parquet")
    written = json.loads((folder / "metrics.json").read_text())["synthetic_eval"]
    from rewarduq_exp.data.synthetic import SyntheticWorld

    data = SyntheticWorld(n_eval=200).load("eval").set_index("id").loc[frame["id"][:20]]
    pairs = model.score_pairs(list(data["prompt"]), list(data["chosen"]), list(data["rejected"]))
    written_margin = (frame["chosen_reward"] - frame["rejected_reward"])[:20].to_numpy()
    # float32 hidden states in other batches (other padding)
    np.testing.assert_allclose(pairs["margin"].to_numpy(), written_margin, **OTHER_BATCHES)
    trained = json.loads((folder / "metrics.json").read_text())["synthetic_ratings_ood"]
    run("evaluate.py", [f"run={folder}", "eval_datasets=[synthetic_ratings_ood]"], cwd, shared_cache)
    again = json.loads((folder / "metrics.json").read_text())
    for key in ("probe/alpha_interval", "probe/pearson", "probe/u_abs_error_spearman",
                "probe/baseline/length_ridge/alpha_interval", "probe/partial_pearson_given_length"):
        # the features come back from the run's feature cache: the same numbers, whatever the device
        assert again["synthetic_ratings_ood"][key] == pytest.approx(trained[key], abs=1e-6)
    assert again["synthetic_eval"] == written


@pytest.fixture(scope="module")
def ablation_run(borp_run, shared_cache):
    """The resampling ablation of the same probe, beside the first run (a two-configuration sweep)."""
    cwd, _, _ = borp_run
    run("train.py", [*ARGS, "method.resample=false", f"hydra.run.dir={cwd}/ablation"], cwd, shared_cache)
    return cwd / "ablation"


def test_a_second_run_reads_every_backbone_output_from_the_feature_cache(borp_run, ablation_run):
    """A sweep over the regressor's settings shares the difference vectors, the ridge's mean-pooled states and the
    judge's digit logits: the second run does no backbone forward pass."""
    _, folder, _ = borp_run
    first = json.loads((folder / "status.json").read_text())["features"]
    assert first["backbone_forward_passes"] > 0
    second = json.loads((ablation_run / "status.json").read_text())["features"]
    assert second["backbone_forward_passes"] == 0 and second["cache_misses"] == 0
    assert second["cache_hits"] == first["cache_hits"] + first["cache_misses"]
    a = json.loads((folder / "metrics.json").read_text())["synthetic_ratings_eval"]
    b = json.loads((ablation_run / "metrics.json").read_text())["synthetic_ratings_eval"]
    for name in ("score_judge", "mean_pool_ridge", "length_ridge"):  # same cached inputs, same baselines
        key = f"probe/baseline/{name}/pearson"
        assert a[key] == pytest.approx(b[key], abs=1e-12)
    assert sorted(p.name for p in (folder / "model").iterdir() if p.suffix == ".npz") == [
        "length_ridge.npz", "mean_pool_ridge.npz", "probe.npz"]


def test_selection_and_table1_pick_up_borp_runs(borp_run, ablation_run):
    """BoRP scored on preference pairs enters RewardUQ's selection (ECE/EBCE filter, best RS_0.2) and Table 1 like
    any other method."""
    cwd, _, _ = borp_run
    for script in ("select_runs.py", "table1.py"):
        proc = run_entry_point(ROOT / "scripts" / script, [cwd, "--dataset", "synthetic_eval", "--out", cwd / "sel"],
                               cwd)
        assert proc.returncode == 0, proc.stderr[-2000:]
    table = pd.read_csv(cwd / "sel" / "selection.csv")
    assert set(table["method"]) == {"borp"} and len(table) == 2
    assert "resample" in table.columns
    assert "borp" in (cwd / "sel" / "table1.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["method=borp"], "pass probe=borp_contrastive"),
    (["method=ens_mlp"], "allowed methods here: borp"),
    (["method=borp", "probe=borp_contrastive", "probe.layer=9"], "layer"),
    (["method=borp", "probe=borp_contrastive", "probe.instruction=''"], "instruction is empty"),
    (["method=borp", "probe=borp_contrastive", "method.regressor=lasso"], "regressor"),
    (["method=borp", "probe=borp_contrastive", "probe.rubrics=[on topic]", "probe.rubric_instruction=Judge"],
     "must contain {rubric}"),
    (["method=borp", "probe=borp_contrastive", "probe.rubrics=['on topic',' ']"], "probe.rubrics[1] is empty"),
    (["method=borp", "probe=borp_contrastive", "probe.backend=sglang"], "engine returns only the final layer"),
    (["method=borp", "probe=borp_contrastive", "probe.backend=vllm"], "allowed: hf"),
])
def test_bad_input_is_one_line(tmp_path, shared_cache, args, message):
    proc = run("train.py", [*args, "dataset=synthetic_ratings", "dataset.n_train=50", "dataset.n_eval=20",
                            "dataset.n_ood=20"], tmp_path, shared_cache, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


def test_refined_probe_with_two_rubrics_trains(tmp_path, shared_cache):
    """Phase 3 as the README shows it: a probe config of the user's own (--config-dir) whose rubrics replace the
    generic instruction; two rubrics give twice the feature width."""
    (tmp_path / "mine" / "probe").mkdir(parents=True)
    (tmp_path / "mine" / "probe" / "refined.yaml").write_text(
        "defaults: [borp_contrastive]\nname: refined\nrubrics:\n"
        "  - |\n    Reward replies that stay on the topic.\n    Penalise replies that repeat words.\n"
        "  - Reward short replies.\n")
    run("train.py", ["method=borp", "probe=refined", "dataset=synthetic_ratings", "model.build.num_layers=4",
                     "dataset.n_train=60", "dataset.n_eval=20", "dataset.n_ood=20", "method.baselines=false",
                     "metric.diagrams=false", f"hydra.run.dir={tmp_path}/run"], tmp_path, shared_cache,
        flags=["--config-dir", str(tmp_path / "mine")])
    fit = json.loads((tmp_path / "run" / "status.json").read_text())["fit"]
    assert fit["feature_dim"] == 2 * 256
    block = json.loads((tmp_path / "run" / "metrics.json").read_text())["synthetic_ratings_eval"]
    assert np.isfinite(block["probe/pearson"])
    # method.baselines=false: no judge, no mean-pooled ridge; the length ridge (no backbone pass) is still there
    assert not any(k.startswith(("probe/baseline/score_judge/", "probe/baseline/mean_pool_ridge/")) for k in block)
    assert np.isfinite(block["probe/baseline/length_ridge/rmse"]) and "probe/pearson_with_log_length" in block
    assert sorted(p.name for p in (tmp_path / "run" / "model").glob("*.npz")) == ["length_ridge.npz", "probe.npz"]


def test_a_judge_that_answers_one_digit_is_reported_as_constant(tmp_path, shared_cache, monkeypatch):
    """A small LM as score-only judge can answer the same digit for every text. Its agreement with the ratings
    (alpha, Pearson, Spearman) is then undefined: those keys are absent, ``constant`` is true, one log line says so,
    and no file holds a bare NaN."""
    from rewarduq_exp.methods import score_judge
    from rewarduq_exp.runner.evaluation import UNDEFINED_FOR_CONSTANT

    monkeypatch.setattr(score_judge.JudgeResult, "scores",
                        lambda self, scoring="digit": np.full(len(self.argmax), 3.0))  # always "3"
    proc = run("train.py", ["method=borp", "probe=borp_contrastive", "dataset=synthetic_ratings",
                            "model.build.num_layers=4", "dataset.n_train=60", "dataset.n_eval=20", "dataset.n_ood=20",
                            "metric.diagrams=false", f"hydra.run.dir={tmp_path}/run"], tmp_path, shared_cache)
    assert_strict_json_files(tmp_path / "run")
    blocks = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert set(blocks) == {"synthetic_ratings_eval", "synthetic_ratings_ood"}
    for block in blocks.values():
        assert block["probe/baseline/score_judge/constant"] is True and block["probe/judge_constant"] is True
        assert not {f"probe/baseline/score_judge/{k}" for k in UNDEFINED_FOR_CONSTANT} & set(block)
        assert np.isfinite(block["probe/baseline/score_judge/rmse"])
        assert block["probe/baseline/mean_pool_ridge/constant"] is False
        assert np.isfinite(block["probe/baseline/mean_pool_ridge/pearson"])
    log = (tmp_path / "run" / "train.log").read_text()
    assert "synthetic_ratings_eval: the score_judge baseline answered 3 for all 20 texts (constant)" in log
    assert "alpha_ridge" in proc.stdout and "alpha_judge" not in proc.stdout  # no judge column: nothing to show


def test_helpsteer2_command_runs_on_a_fixture_in_the_hub_schema(tmp_path, shared_cache):
    """The issue's command, `train.py method=borp dataset=helpsteer2 probe=borp_contrastive`, on a local copy of
    nvidia/HelpSteer2 in its exact schema: verbosity (0-4) read on BoRP's 1-5 scale."""
    from hub_fixtures import write_helpsteer2

    write_helpsteer2(tmp_path / "hub")
    run("train.py", ["method=borp", "probe=borp_contrastive", "dataset=helpsteer2",
                     f"paths.datasets_dir={tmp_path}/hub", "method.cv_folds=2", "method.n_components=1",
                     "method.resample=false", "method.baselines=false", "metric.diagrams=false",
                     f"hydra.run.dir={tmp_path}/run"], tmp_path, shared_cache)
    block = json.loads((tmp_path / "run" / "metrics.json").read_text())["helpsteer2_validation"]
    predictions = pd.read_parquet(tmp_path / "run" / "predictions" / "helpsteer2_validation.parquet")
    assert block["probe/n"] == len(predictions) > 0 and predictions["score"].between(1, 5).all()
    assert np.isfinite(block["probe/rmse"])


def test_polarization_mining_writes_both_tails(borp_run, shared_cache):
    cwd, folder, _ = borp_run
    pool = cwd / "pool.jsonl"
    rows = [{"prompt": f"Topic {i}: write a reply.", "response": " ".join(["vobe", "mada", "gobo"][: 1 + i % 3])}
            for i in range(12)]
    pd.DataFrame(rows).to_json(pool, orient="records", lines=True)
    proc = run_entry_point(ROOT / "scripts" / "mine_polarized.py",
                           [f"run={folder}", f"data={pool}", "--top", "3", "--out", cwd / "mined"], cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = pd.read_csv(cwd / "mined" / "polarized.csv")
    assert len(table) == 12 and table["polarization"].is_monotonic_decreasing
    top = (cwd / "mined" / "polarized_top.md").read_text()
    assert top.count("\n| ") == 4  # header + 3 samples
    teacher = (cwd / "mined" / "teacher_prompt.md").read_text()
    assert teacher.count("\n- ") == 6 and "## Most negative (3)" in teacher
    proc = run_entry_point(ROOT / "scripts" / "mine_polarized.py", [f"run={folder}"], cwd)
    assert proc.returncode == 2 and "nothing to mine" in proc.stderr


def test_cold_start_mining_ranks_an_unlabeled_pool_by_its_own_statistics(tmp_path, shared_cache):
    # The paper's phase 2 has no labels and no trained probe yet: the pool's own centroid, norm z-scores and mean
    # distance define the index.
    from omegaconf import OmegaConf

    from rewarduq_exp.methods.borp import PolarizationStats, polarization_index
    from rewarduq_exp.methods.borp_method import BorpMethod
    from rewarduq_exp.models.backbone import Backbone
    from rewarduq_exp.models.features import FeatureEncoder

    words = ["vobe", "mada", "gobo", "tiba", "kodi", "nede"]
    rows = [{"prompt": f"Topic {words[i % 6]}: write a reply.", "response": " ".join(words[: 1 + i % 6])}
            for i in range(14)]
    pool = tmp_path / "pool.jsonl"
    pd.DataFrame(rows).to_json(pool, orient="records", lines=True)
    proc = run_entry_point(ROOT / "scripts" / "mine_polarized.py",
                           [f"data={pool}", "model=tiny-qwen3", "model.build.num_layers=4", "device=cpu",
                            f"paths.cache_dir={shared_cache}", "--top", "3", "--out", tmp_path / "mined"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = pd.read_csv(tmp_path / "mined" / "polarized.csv")
    assert len(table) == 14 and table["score"].isna().all()  # no probe: the index alone
    assert "cold start" in (tmp_path / "mined" / "polarized_top.md").read_text()

    model_cfg = OmegaConf.load(ROOT / "conf" / "model" / "tiny-qwen3.yaml")
    model_cfg.build.num_layers = 4
    backbone = Backbone(model_cfg, cache_dir=shared_cache, device="cpu")
    encoder = FeatureEncoder(backbone, OmegaConf.load(ROOT / "conf" / "probe" / "borp_contrastive.yaml"),
                             tmp_path / "features", 2048, show_progress=False)
    method = BorpMethod(encoder=encoder, show_progress=False)
    prompts = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    responses = [[{"role": "assistant", "content": r["response"]}] for r in rows]
    final = method.features(prompts, responses)[method.layers()[0]]
    pi = polarization_index(final, PolarizationStats.from_reference(final))
    # both on the CPU (device=cpu), the same texts in the same batches: float32 rounding at most
    np.testing.assert_allclose(table.sort_values("index")["polarization"], pi, rtol=1e-4, atol=1e-6)
    assert table["index"].head(3).tolist() == np.argsort(-pi)[:3].tolist()  # the top rows: the largest pool PI
