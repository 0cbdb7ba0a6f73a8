"""The Python API (rewarduq_exp/api.py): a completed run folder as a model that scores text with uncertainty.

End to end for every method: ENS-MLP and BAY-LIN on the command-line runs of tests/test_cli.py, ENS-LoRA and MCD-DPO
on those of tests/test_cli_finetune.py (``assert_api_scores_as_evaluate``). Here: the pieces, on one small run.
"""

import re

import numpy as np
import pandas as pd
import pytest
from tolerances import OTHER_BATCHES

import rewarduq_exp as r
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.synthetic import SyntheticWorld


def assert_api_scores_as_evaluate(folder, name: str, frame: pd.DataFrame) -> None:
    """``load_run(folder)`` gives, for the rows of ``frame``, the scores in ``predictions/<name>.parquet`` that
    ``evaluate.py run=<folder> dataset=<name>`` wrote, to float32 rounding: here only the chosen texts are scored,
    so the batches pad to other lengths than evaluate's and matmuls round differently (1.6e-6 seen on ENS-LoRA on a
    CPU; ``OTHER_BATCHES`` covers a GPU's kernels too)."""
    model = r.load_run(folder, progress=False)
    pred = pd.read_parquet(folder / "predictions" / f"{name}.parquet").set_index("id")
    frame = frame.set_index(frame["id"].astype(str)).loc[pred.index]
    prompts = [m[0]["content"] for m in frame["prompt"]]  # plain strings, as a user passes them
    chosen = model.score(prompts, [m[0]["content"] for m in frame["chosen"]], raw=True)   # the predictions are raw
    for col in ("reward", "lower", "upper"):
        np.testing.assert_allclose(chosen[col], pred[f"chosen_{col}"], **OTHER_BATCHES, err_msg=col)
    np.testing.assert_allclose(chosen["uncertainty"], (pred["chosen_upper"] - pred["chosen_reward"]) / model.beta,
                               **OTHER_BATCHES)
    assert (chosen["uncertainty"] > 0).all()


@pytest.fixture(scope="module")
def run_cwd(tmp_path_factory, shared_cache):
    """A folder with one small BAY-LIN run in outputs/runs/, as after `python train.py` there."""
    from test_cli import NO_FIGURES, run

    cwd = tmp_path_factory.mktemp("api")
    run("train.py", ["method=bay_lin", "progress=false", "dataset.n_train=200", "dataset.n_eval=40",
                     "dataset.n_ood=8", *NO_FIGURES, f"hydra.run.dir={cwd / 'outputs' / 'runs' / 'bay_lin'}"], cwd,
        shared_cache)
    return cwd


@pytest.fixture(scope="module")
def model(run_cwd):
    return r.load_run(run_cwd / "outputs" / "runs" / "bay_lin", progress=False)


def docs_page_code(page: str) -> list[str]:
    """The ```python blocks of docs/<page>."""
    from conftest import ROOT

    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), flags=re.S)


def test_the_documented_python_api_runs_as_written(run_cwd, monkeypatch, capsys):
    (code,) = docs_page_code("api.md")
    monkeypatch.chdir(run_cwd)
    # a newer run that failed (fourth hardening round, item 11): the snippet picks the newest *completed* run
    failed = run_cwd / "outputs" / "runs" / "zz_failed"
    failed.mkdir(exist_ok=True)
    (failed / "status.json").write_text('{"state": "failed", "error": "device=\'tpu\' is not supported"}')
    exec(compile(code, "docs/api.md", "exec"), {})
    out = capsys.readouterr().out
    assert "uncertainty" in out and "p_chosen" in out
    assert any(line.split(" ")[0] in ("Blue.", "Seven.", "Red.") for line in out.splitlines())  # best_of_n's pick
    rewards = out.strip().splitlines()[-1]  # the TRL reward function's list of floats
    assert rewards.startswith("[") and len(rewards.split(",")) == 2


@pytest.fixture(scope="module")
def pairs():
    frame = SyntheticWorld(n_train=8, n_eval=24, n_ood=8).load("eval")
    return tuple([m[0]["content"] for m in frame[col]] for col in ("prompt", "chosen", "rejected"))


def test_score_table_and_chat_messages_give_the_same_scores(model, pairs):
    prompts, chosen, _ = pairs
    table = model.score(prompts, chosen)
    assert list(table.columns) == ["reward", "lower", "upper", "uncertainty"] and len(table) == len(prompts)
    assert (table.lower <= table.reward).all() and (table.reward <= table.upper).all()
    np.testing.assert_allclose(table.upper - table.lower, 2 * model.beta * table.uncertainty, atol=1e-9)
    messages = model.score([[{"role": "user", "content": p}] for p in prompts],
                           [[{"role": "assistant", "content": c}] for c in chosen])
    pd.testing.assert_frame_equal(messages, table)
    assert "BayLin on tiny-qwen3" in repr(model) and "recalibrated" in repr(model)


def test_score_pairs_probability_and_its_interval(model, pairs):
    prompts, chosen, rejected = pairs
    # raw=True: the model's own probabilities (recalibrated ones may pass an isotonic map as well:
    # tests/test_recalibration_runs.py)
    table = model.score_pairs(prompts, chosen, rejected, raw=True)
    c, rj = model.score(prompts, chosen, raw=True), model.score(prompts, rejected, raw=True)
    np.testing.assert_allclose(table.p_chosen, 1 / (1 + np.exp(-(c.reward - rj.reward))), atol=1e-12)
    np.testing.assert_allclose(table.p_lower, 1 / (1 + np.exp(-(c.lower - rj.upper))), atol=1e-12)
    assert (table.p_lower <= table.p_chosen).all() and (table.p_chosen <= table.p_upper).all()
    flipped = model.score_pairs(prompts, rejected, chosen, raw=True)  # symmetry of flipped pairs
    np.testing.assert_allclose(flipped.p_chosen, 1 - table.p_chosen, atol=1e-12)
    np.testing.assert_allclose(flipped.p_upper, 1 - table.p_lower, atol=1e-12)


def test_conservative_and_optimistic_rewards(model, pairs):
    prompts, chosen, _ = pairs
    table = model.score(prompts, chosen)
    np.testing.assert_allclose(model.reward(prompts, chosen, "conservative", k=2.0),
                               table.reward - 2 * table.uncertainty)
    np.testing.assert_allclose(model.reward(prompts, chosen, "optimistic", k=0.5),
                               table.reward + 0.5 * table.uncertainty)
    np.testing.assert_allclose(model.reward(prompts, chosen, "mean"), table.reward)
    # k = beta: the conservative reward is the lower bound
    np.testing.assert_allclose(model.reward(prompts, chosen, k=model.beta), table.lower, atol=1e-9)


def test_best_of_n_picks_by_conservative_reward(model, pairs):
    prompts, chosen, rejected = pairs
    candidates = chosen[:4] + rejected[:4]
    best = model.best_of_n(prompts[0], candidates, k=1.0)
    table = best["table"]
    assert best["index"] == int(np.argmax(table.reward - table.uncertainty))
    assert best["completion"] == candidates[best["index"]]
    assert best["lower"] <= best["reward"] <= best["upper"]
    greedy = model.best_of_n(prompts[0], candidates, k=0.0)
    assert greedy["index"] == int(np.argmax(table.reward))


def test_reward_function_is_what_trl_trainers_call(model, pairs):
    from trl.trainer.utils import get_callable_name, is_async_callable

    prompts, chosen, _ = pairs
    fn = model.reward_function(k=1.0)
    assert get_callable_name(fn) == "rewarduq_conservative_reward" and not is_async_callable(fn)
    # GRPOTrainer._calculate_rewards: keyword arguments, conversational completions, extra dataset columns
    out = fn(prompts=[[{"role": "user", "content": p}] for p in prompts[:3]],
             completions=[[{"role": "assistant", "content": c}] for c in chosen[:3]],
             completion_ids=[[1, 2]] * 3, trainer_state=None, answer=["x"] * 3)
    assert isinstance(out, list) and all(isinstance(v, float) for v in out)
    np.testing.assert_allclose(out, model.reward(prompts[:3], chosen[:3], "conservative", k=1.0))


@pytest.mark.parametrize("call, message", [
    (lambda m: m.score(["a", "b"], ["c"]), "differ in length"),
    (lambda m: m.score("a", "b"), "must be a list"),
    (lambda m: m.reward(["a"], ["b"], kind="pessimistic"), "allowed values are conservative, optimistic, mean"),
    (lambda m: m.reward_function(k=-1), "must be a number >= 0"),
    (lambda m: m.best_of_n("a", []), "at least one candidate"),
])
def test_bad_input_is_one_clear_error(model, call, message):
    with pytest.raises(UserError, match=message):
        call(model)


def test_not_a_completed_run(tmp_path):
    with pytest.raises(UserError, match="is not a run folder"):
        r.load_run(tmp_path)
