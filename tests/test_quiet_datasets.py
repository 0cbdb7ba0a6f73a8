"""progress=false silences the datasets library's bars without importing it when nothing else has (0.2 s a run)."""

import os
import sys
import types

from rewarduq_exp.runner.data_loading import quiet_datasets_unless

VARIABLE = "HF_DATASETS_DISABLE_PROGRESS_BARS"


def test_before_datasets_is_imported_the_variable_it_reads_is_set(monkeypatch):
    monkeypatch.delitem(sys.modules, "datasets", raising=False)
    monkeypatch.delenv(VARIABLE, raising=False)
    quiet_datasets_unless(True)
    assert VARIABLE not in os.environ
    quiet_datasets_unless(False)
    assert os.environ[VARIABLE] == "1" and "datasets" not in sys.modules


def test_a_user_setting_is_kept_and_an_imported_library_is_switched(monkeypatch):
    monkeypatch.delitem(sys.modules, "datasets", raising=False)
    monkeypatch.setenv(VARIABLE, "0")
    quiet_datasets_unless(False)
    assert os.environ[VARIABLE] == "0"
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(disable_progress_bars=lambda: calls.append(1)))
    quiet_datasets_unless(False)
    assert calls == [1]
