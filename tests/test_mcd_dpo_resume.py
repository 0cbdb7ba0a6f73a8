"""MCD-DPO training checkpoints: a run stopped by a signal (or killed after a periodic save) and launched again ends
with the very weights and history of an uninterrupted run; a finished phase skips training; the checkpoint is one
safetensors file (no pickle)."""

import json
import os
import signal
import tempfile

import pytest
import torch
from safetensors import safe_open
from test_mcd_dpo import _method

from rewarduq_exp.core import job_signals, training_checkpoint
from rewarduq_exp.core.training_checkpoint import TrainingCheckpoints
from rewarduq_exp.data.synthetic import SyntheticWorld
from rewarduq_exp.methods import mcd_dpo as mod

pytestmark = pytest.mark.e2e  # end to end: make test-e2e (.ci/run), not make test

# 12 pairs in micro-batches of 2, 2 per optimizer step (accumulation), 2 epochs: 3 steps per epoch, 6 in all; a log
# record every 2nd step, so a stop at an odd step falls between two log steps (the Trainer's running loss sum must
# come back too).
SETTINGS = {"batch_size": 4, "micro_batch_size": 2, "num_epochs": 2, "num_samples": 4, "log_every": 2}
TOTAL = 6


@pytest.fixture(scope="module")
def frame():
    return SyntheticWorld(n_train=12, n_eval=4, n_ood=4).load("train")


def _weights(method) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in method.policy.named_parameters()}


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def uninterrupted(tiny_backbone, frame):
    """The Python API's fit (no checkpoints): the weights and history every resumed run must end with."""
    method = _method(tiny_backbone, **SETTINGS).fit(frame)
    assert method.fit_summary["optimizer_steps"] == TOTAL
    return _weights(method), list(method.history)


@pytest.fixture(autouse=True)
def signals():
    job_signals.install()
    yield
    job_signals.uninstall()


@pytest.fixture
def checkpoints(tmp_path):
    def make():   # a fresh object per attempt, as each launch of train.py has
        return TrainingCheckpoints(tmp_path / "run" / "checkpoint", "hash", every_steps=2)
    return make


@pytest.fixture
def own_tempdir(tmp_path, monkeypatch):
    """Temporary folders (the trainer's output dir and the resume folder) under one folder the test can look into."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _with_callback(monkeypatch, callback) -> None:
    """Trainers made by the method get ``callback`` (ahead of the checkpoint's own, which is added at fit)."""
    original = mod._make_trainer_class

    def patched():
        cls = original()

        class WithCallback(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.add_callback(callback)

        return WithCallback

    monkeypatch.setattr(mod.method, "_make_trainer_class", patched)  # where McdDpo looks it up


def _sigterm_at(step: int):
    """A callback that sends this process a real SIGTERM during optimizer step ``step``."""
    from transformers import TrainerCallback

    class Terminate(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == step - 1:    # global_step counts the steps already finished
                os.kill(os.getpid(), signal.SIGTERM)

    return Terminate()


def _header(path) -> dict:
    with safe_open(str(path), framework="pt") as fh:
        return json.loads(fh.metadata()["state"])


@pytest.mark.parametrize("stop_at", [3, 5], ids=["epoch-end", "mid-epoch-between-logs"])
def test_a_run_stopped_by_sigterm_resumes_to_the_uninterrupted_result(tiny_backbone, frame, uninterrupted,
                                                                      checkpoints, own_tempdir, monkeypatch, caplog,
                                                                      stop_at):
    weights, history = uninterrupted
    with monkeypatch.context() as patch:
        _with_callback(patch, _sigterm_at(stop_at))
        with training_checkpoint.activate(checkpoints()) as ck, pytest.raises(job_signals.TrainingInterrupted) as err:
            _method(tiny_backbone, **SETTINGS).fit(frame)
    assert err.value.signum == signal.SIGTERM and f"at step {stop_at} of {TOTAL}" in str(err.value)
    files = sorted(p.name for p in ck.directory.iterdir())
    assert files == ["01-mcd_dpo.safetensors"]
    assert _header(ck.directory / files[0])["step"] == stop_at

    job_signals.install()   # the relaunched process: no signal received yet
    with training_checkpoint.activate(checkpoints()) as ck, caplog.at_level("INFO", logger="rewarduq_exp"):
        method = _method(tiny_backbone, **SETTINGS).fit(frame)
    assert f"mcd_dpo: resumed at step {stop_at} of {TOTAL}" in caplog.text
    assert ck.resumed == [f"mcd_dpo: step {stop_at} of {TOTAL}"]
    _assert_same_weights(_weights(method), weights)
    assert method.history == history
    assert method.fit_summary["optimizer_steps"] == TOTAL
    assert list(own_tempdir.iterdir()) == []    # the trainer's folder and the resume folder are gone


def test_a_run_killed_after_a_periodic_save_resumes_from_it(tiny_backbone, frame, uninterrupted, checkpoints,
                                                            monkeypatch):
    from transformers import TrainerCallback

    class Killed(TrainerCallback):   # dies during step 3, after the periodic save at step 2 (mid-epoch)
        def on_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("killed")

    with monkeypatch.context() as patch:
        _with_callback(patch, Killed())
        with training_checkpoint.activate(checkpoints()) as ck, pytest.raises(RuntimeError, match="killed"):
            _method(tiny_backbone, **SETTINGS).fit(frame)
    assert _header(ck.directory / "01-mcd_dpo.safetensors")["step"] == 2
    with training_checkpoint.activate(checkpoints()):
        method = _method(tiny_backbone, **SETTINGS).fit(frame)
    _assert_same_weights(_weights(method), uninterrupted[0])
    assert method.history == uninterrupted[1]


def test_a_finished_phase_is_not_trained_again(tiny_backbone, frame, uninterrupted, checkpoints, monkeypatch):
    # SIGTERM during the last step: the run trains to the end, keeps the result as a finished phase, then leaves.
    with monkeypatch.context() as patch:
        _with_callback(patch, _sigterm_at(TOTAL))
        with training_checkpoint.activate(checkpoints()) as ck, pytest.raises(job_signals.TrainingInterrupted) as err:
            first = _method(tiny_backbone, **SETTINGS)
            first.fit(frame)
    assert "after the last step" in str(err.value)
    rng_after_training = torch.get_rng_state()
    _assert_same_weights(_weights(first), uninterrupted[0])   # the periodic saves changed nothing
    path = ck.directory / "01-mcd_dpo.safetensors"
    header = _header(path)
    assert header["done"] and header["step"] == TOTAL and header["history"] == uninterrupted[1]
    with safe_open(str(path), framework="pt") as fh:
        assert not any(k.startswith("optimizer.") for k in fh.keys())   # a finished phase keeps only its result

    job_signals.install()
    torch.manual_seed(123)   # whatever the process drew before: fit puts back the RNG as it was after training

    def no_trainer(*args, **kwargs):
        raise AssertionError("a finished phase must not build a trainer (tokenisation, reference pass, training)")

    monkeypatch.setattr(mod.McdDpo, "_make_trainer", no_trainer)
    with training_checkpoint.activate(checkpoints()) as ck:
        method = _method(tiny_backbone, **SETTINGS).fit(frame)
    assert ck.resumed == [f"mcd_dpo: step {TOTAL} of {TOTAL} (done)"]
    _assert_same_weights(_weights(method), uninterrupted[0])
    assert method.history == uninterrupted[1]
    assert method.fit_summary["optimizer_steps"] == TOTAL and method.stats["reference_pairs_precomputed"] == 0
    assert torch.equal(torch.get_rng_state(), rng_after_training)
    assert not method.policy.training and not any(p.requires_grad for p in method.policy.parameters())
    texts = frame.iloc[:2]
    assert (method.sample_rewards(texts["prompt"], texts["chosen"])
            == first.sample_rewards(texts["prompt"], texts["chosen"])).all()


def test_the_checkpoint_is_one_safetensors_file_without_pickle(tiny_backbone, frame, checkpoints, own_tempdir,
                                                               monkeypatch, tmp_path):
    with monkeypatch.context() as patch:
        _with_callback(patch, _sigterm_at(1))
        with training_checkpoint.activate(checkpoints()) as ck, pytest.raises(job_signals.TrainingInterrupted):
            method = _method(tiny_backbone, **SETTINGS)
            method.fit(frame)
    assert [p.name for p in ck.directory.iterdir()] == ["01-mcd_dpo.safetensors"]
    path = ck.directory / "01-mcd_dpo.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert raw[8:9] == b"{" and json.loads(raw[8:8 + n])   # a safetensors header, then raw tensor bytes
    header = _header(path)
    assert header["step"] == 1 and not header["done"] and header["total"] == TOTAL
    assert header["trainer_state"]["global_step"] == 1
    with safe_open(str(path), framework="pt") as fh:
        keys = set(fh.keys())
    params = {f"param.{k}" for k, _ in method.policy.named_parameters()}
    assert params <= keys and {"rng.torch", "rng.numpy_keys", "trainer.tr_loss"} <= keys
    # AdamW's state of every parameter: both moments and the step count
    assert {k.rsplit(".", 1)[1] for k in keys if k.startswith("optimizer.")} == {"exp_avg", "exp_avg_sq", "step"}
    assert sum(k.endswith(".exp_avg") for k in keys) == len(params)
    leftovers = [p for p in tmp_path.rglob("*") if p.suffix in {".pt", ".pth", ".pkl", ".bin"}]
    assert leftovers == [] and list(own_tempdir.iterdir()) == []
