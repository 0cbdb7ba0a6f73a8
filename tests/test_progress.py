"""With progress bars off, long loops log a line every few minutes: done/total, the values they carry, elapsed time
and an ETA; with bars on they are tqdm bars; the other processes of a distributed run stay silent."""

from __future__ import annotations

import logging

import pytest
from tqdm.auto import tqdm

from rewarduq_exp.core import progress as pg


@pytest.fixture
def every_update(monkeypatch):
    monkeypatch.setattr(pg, "LOG_EVERY_SECONDS", 0.0)


def lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "rewarduq_exp"]


def test_bars_off_log_done_total_values_elapsed_and_eta(caplog, every_update):
    caplog.set_level(logging.INFO, logger="rewarduq_exp")
    loop = pg.progress(range(2, 6), desc="ens_lora", show=False, unit="steps", initial=2, total=6)
    for i in loop:
        loop.set_postfix(loss=f"{1 / (i + 1):.4f}")
    got = lines(caplog)
    assert len(got) == 4
    assert got[0].startswith("ens_lora: 3/6 steps (50%), loss 0.3333, elapsed ") and ", ETA " in got[0]
    assert got[-1].startswith("ens_lora: 6/6 steps (100%), loss 0.1667, elapsed ") and "ETA" not in got[-1]


def test_lines_come_at_most_every_interval(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="rewarduq_exp")
    monkeypatch.setattr(pg, "LOG_EVERY_SECONDS", 3600.0)
    for _ in pg.progress(range(100), desc="quick", show=False):
        pass
    assert lines(caplog) == []  # a loop shorter than the interval says nothing


def test_bars_on_and_quiet_processes(caplog, every_update):
    caplog.set_level(logging.INFO, logger="rewarduq_exp")
    assert isinstance(pg.progress(range(3), desc="x", show=True), tqdm)
    quiet = pg.progress(range(3), desc="x", show=False, quiet=True)
    quiet.set_postfix(loss="1")
    assert list(quiet) == [0, 1, 2] and lines(caplog) == []


def test_clock_without_total_and_durations(caplog, every_update):
    caplog.set_level(logging.INFO, logger="rewarduq_exp")
    pg.ProgressClock("scoring", None, "batches").update(7, loss=0.25)
    assert lines(caplog)[0].startswith("scoring: 7 batches, loss 0.25, elapsed ")
    assert [pg.duration(s) for s in (4.4, 62, 3 * 3600 + 5 * 60 + 9)] == ["4s", "1m02s", "3h05m"]
