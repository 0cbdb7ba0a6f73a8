"""Sizes that multiply are bounded by the host's memory before anything is allocated (fourth hardening round, item
8): ``dataset.n_train=1000000 dataset.max_words=10000`` (each within its bound) asked the allocator for 74.5 GiB and
ended in a 27-line traceback. The estimate is a lower bound of what generation really takes (measured here), so a
refusal is never a false alarm."""

import tracemalloc

import pytest
from conftest import ROOT
from entry_points import run_entry_point

from rewarduq_exp.core import host_memory
from rewarduq_exp.core.errors import UserError
from rewarduq_exp.data.synthetic import SyntheticRatings, SyntheticWorld, completions_memory


@pytest.mark.parametrize("cls, split", [(SyntheticWorld, "train"), (SyntheticWorld, "ood"),
                                        (SyntheticRatings, "train")])
@pytest.mark.parametrize("n, words", [(3000, 12), (400, 400)])
def test_the_estimate_is_a_lower_bound_of_what_generation_takes(cls, split, n, words):
    world = cls(n_train=n, n_eval=n, n_ood=n, n_cal=n, min_words=max(1, words - 4), max_words=words)
    tracemalloc.start()
    try:
        world.load(split)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    needed = world.memory_needed([split])
    assert needed <= peak, (needed, peak)
    assert needed >= 0.25 * peak   # and not a meaningless one


def test_a_world_that_cannot_fit_is_refused_before_any_pair_is_drawn(monkeypatch):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2.0**30)
    world = SyntheticWorld(n_train=200_000, max_words=200, min_words=8)
    with pytest.raises(UserError, match=r"^dataset.n_train=200000 x dataset.max_words=200 \(the synthetic world's "
                                        r"203,000 rows of up to 200 words, every split loaded\) needs at least 1\.7 "
                                        r"GiB of memory, more than this host has available \(1\.0 GiB\); lower "
                                        r"dataset.n_train or dataset.max_words$"):
        world.check_memory()
    with pytest.raises(UserError, match=r"needs at least 1\.7 GiB"):
        world.load("train")
    world.load("eval")   # 1000 pairs fit


def test_a_best_of_n_pool_and_the_rating_cuts_are_bounded_too(monkeypatch):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2.0**30)
    world = SyntheticWorld(max_words=12, candidate_max_words=2000)
    with pytest.raises(UserError, match=r"^1,000 prompts x 1,000 candidates of up to 2000 words needs at least 37\.7 "
                                        r"GiB of memory.*; lower the prompts or candidates \(or "
                                        r"dataset.candidate_max_words\)$"):
        world.candidates("eval", 1000, 1000)
    assert completions_memory(20_000, 4000) > 2.0**30
    with pytest.raises(UserError, match=r"^dataset.max_words=4000 \(the 20,000 completions the rating classes are cut "
                                        r"from\) needs at least"):
        SyntheticRatings(max_words=4000, min_words=8)


def test_train_py_refuses_it_in_one_line_and_leaves_no_run_folder(tmp_path):
    """Item 8 on the command line (and item 11: a refused single run leaves no folder to be mistaken for a run)."""
    folder = tmp_path / "outputs" / "runs" / "huge"
    proc = run_entry_point(ROOT / "train.py", ["dataset.n_train=1000000", "dataset.max_words=10000",
                                               "dataset.min_words=9000", "progress=false",
                                               f"paths.output_root={tmp_path / 'outputs'}", f"hydra.run.dir={folder}"],
                           tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("error: dataset.n_train=1000000 x dataset.max_words=10000 (the synthetic world's "
                               "1,003,000 rows") and "GiB of memory, more than this host has available" in lines[0]
    assert not folder.exists()
    assert not any((tmp_path / "outputs" / "runs").iterdir())
